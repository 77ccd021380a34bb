// Crash-safe writes: write to a temporary sibling, fsync it, rename over the target, fsync the
// directory. Readers see the old content or the new, never a mix.
#pragma once
#include <string>
#include <string_view>

namespace keel::io {

void write_file_atomic(const std::string& path, std::string_view content);
// Same for a payload in `count` pieces of memory, each written with one write(2) call (more only
// where the kernel writes less than asked: over 2 GiB, or a signal). Returns the calls made.
size_t write_file_atomic(const std::string& path, const void* const* chunks, const size_t* sizes,
                         size_t count);
// Error (naming `dir` and the fix) when the directory cannot be opened or fsynced.
void fsync_dir(const std::string& dir);
// Removes the temporaries STEM<PID> in `dir` whose process is gone: a write killed by SIGKILL,
// the OOM killer or a power loss left them for good. A live PID's is a write in progress, kept.
void remove_dead_temps(const std::string& dir, const std::string& stem);
std::string read_file(const std::string& path);  // Error naming the file when unreadable

}  // namespace keel::io
