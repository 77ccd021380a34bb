#include "keel/data/token_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <vector>

#include "keel/io/atomic_file.h"
#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"

namespace keel::data {

namespace {

// The header and ids are little-endian, read in place.
static_assert(std::endian::native == std::endian::little, "token files are little-endian");

constexpr int32_t kGpt2Magic = 20240520, kGpt2Version = 1;      // uint16 ids
constexpr int32_t kLlama3Magic = 20240801, kLlama3Version = 7;  // uint32 ids
const char* kWhatItIs =
    "an llm.c token file (llm.c's dev/data scripts or `keel tokenize --output` write one)";

// An open file descriptor, closed on every path out.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads bytes [offset, offset + n) of `fd` whole (pread returns short counts near EOF or on a
// signal).
bool read_at(int fd, void* out, size_t n, int64_t offset) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
  return true;
}

Error file_error(const std::string& path, const std::string& key, const std::string& what) {
  return Error("token file " + path + " (" + key + "): " + what, Error::kUsage);
}

// Opens `path` for reading as a regular file of `st`'s size.
void open_token_file(const std::string& path, const std::string& key, Fd& f, struct stat& st) {
  check_input_file(path, "token file", key);
  // O_NONBLOCK: a FIFO would otherwise wait here for a writer before fstat could refuse it.
  f.fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (f.fd < 0)
    throw file_error(path, key, std::string("cannot be opened: ") + std::strerror(errno));
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
    throw file_error(path, key,
                     "is a pipe, not a file: a token file is mapped, not read as a stream; write "
                     "it to disk first");
}

TokenFileHeader header_of(int fd, const struct stat& st, const std::string& path,
                          const std::string& key) {
  const auto size = static_cast<int64_t>(st.st_size);
  if (size < kTokenFileHeaderBytes)
    throw file_error(path, key,
                     "holds " + std::to_string(size) + " bytes, less than the " +
                         std::to_string(kTokenFileHeaderBytes) + "-byte header of " + kWhatItIs);
  int32_t h[3] = {};
  if (!read_at(fd, h, sizeof h, 0))
    throw file_error(path, key, std::string("cannot read its header: ") + std::strerror(errno));
  TokenFileHeader t;
  if (h[0] == kGpt2Magic || h[0] == kLlama3Magic) {
    const bool gpt2 = h[0] == kGpt2Magic;
    const int32_t version = gpt2 ? kGpt2Version : kLlama3Version;
    if (h[1] != version)
      throw file_error(path, key,
                       "its header's version is " + std::to_string(h[1]) + "; the magic " +
                           std::to_string(h[0]) + " (" + (gpt2 ? "GPT-2" : "Llama 3") +
                           ") comes with version " + std::to_string(version));
    t.width = gpt2 ? 2 : 4;
  } else {
    char first[16];
    std::snprintf(first, sizeof first, "0x%08x", static_cast<uint32_t>(h[0]));
    throw file_error(path, key,
                     std::string("is not ") + kWhatItIs + ": its first 4 bytes read " + first +
                         " (" + std::to_string(h[0]) +
                         "), not the magic 20240520 (GPT-2, 16-bit "
                         "ids) or 20240801 (Llama 3, 32-bit ids); a text file is read with "
                         "data.task = \"text\" (keel eval: --task text)");
  }
  if (h[2] < 0)
    throw file_error(path, key,
                     "its header counts " + std::to_string(h[2]) +
                         " tokens (negative): the "
                         "header is damaged; write the file again");
  t.tokens = h[2];
  const int64_t want = t.tokens * t.width, have = size - kTokenFileHeaderBytes;
  if (have != want)
    throw file_error(path, key,
                     "its header counts " + std::to_string(t.tokens) + " tokens of " +
                         std::to_string(t.width) + " bytes (" + std::to_string(want) +
                         " bytes after the header), but " + std::to_string(have) +
                         " bytes follow it: " +
                         (have < want ? "the file is truncated (a copy or a write that did not "
                                        "finish); write it again"
                                      : "bytes after the ids; this is not one token file"));
  return t;
}

// The first id of the file at or beyond `vocab` (its position, or -1): read in 1 MiB pieces
// through the page cache, so checking a corpus does not make it resident in the process.
template <class Id>
int64_t first_id_beyond(int fd, int64_t n, int64_t vocab, Id& found, const std::string& path,
                        const std::string& key) {
  std::vector<Id> chunk(size_t{1} << 19);
  for (int64_t done = 0; done < n;) {
    const auto m =
        static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(chunk.size()), n - done));
    if (!read_at(fd, chunk.data(), m * sizeof(Id), kTokenFileHeaderBytes + done * sizeof(Id)))
      throw file_error(path, key, std::string("a read failed part-way: ") + std::strerror(errno));
    for (size_t i = 0; i < m; ++i)
      if (static_cast<int64_t>(chunk[i]) >= vocab) {
        found = chunk[i];
        return done + static_cast<int64_t>(i);
      }
    done += static_cast<int64_t>(m);
  }
  return -1;
}

// A token file cut while the run maps it (rewritten in place, as a script that reopens it for
// writing does) turns the next read of a page past its new end into SIGBUS, which would end the
// run with "Bus error" and nothing else. The mappings are registered here, and a SIGBUS inside
// one prints which file it was and exits 1 (the last checkpoint is intact); any other SIGBUS goes
// to the handler that was there before.
struct MappedFile {
  std::atomic<const char*> begin{nullptr}, end{nullptr};
  char message[768] = {};
};
constexpr int kMaxMapped = 16;
MappedFile g_mapped[kMaxMapped];
struct sigaction g_previous_sigbus = {};

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto* at = static_cast<const char*>(info->si_addr);
  for (MappedFile& m : g_mapped) {
    const char *b = m.begin.load(), *e = m.end.load();
    if (b && at >= b && at < e) {
      const ssize_t ignored = ::write(2, m.message, std::strlen(m.message));
      (void)ignored;
      ::_exit(1);
    }
  }
  if (g_previous_sigbus.sa_flags & SA_SIGINFO) {
    if (g_previous_sigbus.sa_sigaction) return g_previous_sigbus.sa_sigaction(sig, info, context);
  } else if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN) {
    return g_previous_sigbus.sa_handler(sig);
  }
  ::signal(SIGBUS, SIG_DFL);  // the default action, on the fault's own retry
}

// The slot of the mapping [map, map + bytes) of `path`, or -1 when all are taken (then a cut
// file is the default "Bus error").
int register_mapping(const void* map, size_t bytes, const std::string& path,
                     const std::string& key) {
  static std::mutex mu;
  static bool installed = false;
  std::lock_guard<std::mutex> lock(mu);
  if (!installed) {
    struct sigaction sa = {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous_sigbus);
    installed = true;
  }
  for (int i = 0; i < kMaxMapped; ++i)
    if (!g_mapped[i].begin.load()) {
      std::snprintf(g_mapped[i].message, sizeof g_mapped[i].message,
                    "\nerror: token file %s (%s) was cut while the run read it (rewritten in "
                    "place by another program?); the run stops here, its last checkpoint intact: "
                    "write token files to a new name and rename them over the old one (keel "
                    "tokenize --output does), then resume\n",
                    path.c_str(), key.c_str());
      g_mapped[i].end = static_cast<const char*>(map) + bytes;
      g_mapped[i].begin = static_cast<const char*>(map);
      return i;
    }
  return -1;
}

void unregister_mapping(int slot) {
  if (slot >= 0) g_mapped[slot].begin = nullptr;
}

// The rows of a mapped token file. `Id` is uint16_t (GPT-2's layout) or int32_t (Llama 3's
// uint32 ids, all checked below 2^31 against the vocabulary, so read as int32 in place).
template <class Id>
class TokenFileDataset : public Dataset {
 public:
  TokenFileDataset(void* map, size_t map_bytes, int64_t n, size_t len, std::string source,
                   const std::string& key)
      : slot_(register_mapping(map, map_bytes, source, key)),
        map_(map),
        map_bytes_(map_bytes),
        ids_(reinterpret_cast<const Id*>(static_cast<const char*>(map) + kTokenFileHeaderBytes),
             static_cast<size_t>(n)),
        len_(len),
        rows_(packed_rows(static_cast<size_t>(n), len)),
        all_targets_(len, 1),
        source_(std::move(source)) {}
  ~TokenFileDataset() override {
    unregister_mapping(slot_);
    ::munmap(map_, map_bytes_);
  }
  TokenFileDataset(const TokenFileDataset&) = delete;
  TokenFileDataset& operator=(const TokenFileDataset&) = delete;

  int64_t size() const override { return rows_; }
  ExampleView get(int64_t i) const override {
    check_example_index(i, rows_, source_);
    const auto [start, n] = packed_row(i, ids_.size(), len_);
    return {ids_.subspan(start, n), std::span<const uint8_t>(all_targets_).first(n)};
  }
  std::string where(int64_t i) const override {
    if (i < 0 || i >= rows_) return source_ + " row " + std::to_string(i);
    return source_ + " row " + std::to_string(i) + " (tokens from " +
           std::to_string(packed_row(i, ids_.size(), len_).first) + ")";
  }
  // The mapping is the page cache's, not the process's own memory: only the flags are held.
  int64_t held_bytes() const override { return static_cast<int64_t>(all_targets_.size()); }
  int64_t held_tokens() const override { return static_cast<int64_t>(ids_.size()); }

 private:
  int slot_;  // register_mapping's
  void* map_;
  size_t map_bytes_;
  std::span<const Id> ids_;  // [n] in the mapping
  size_t len_;               // tokens a row (seq_len)
  int64_t rows_;
  std::vector<uint8_t> all_targets_;
  std::string source_;
};

}  // namespace

TokenFileHeader read_token_file_header(const std::string& path, const std::string& key) {
  Fd f;
  struct stat st {};
  open_token_file(path, key, f, st);
  return header_of(f.fd, st, path, key);
}

std::unique_ptr<Dataset> load_token_file(const std::string& path, const std::string& key,
                                         const Tokenizer& tok, int64_t seq_len) {
  if (seq_len < 2)
    throw Error(path + ": seq_len is " + std::to_string(seq_len) +
                    "; next-token prediction needs at least 2 positions (set data.seq_len >= 2)",
                Error::kUsage);
  Fd f;
  struct stat st {};
  open_token_file(path, key, f, st);
  const TokenFileHeader h = header_of(f.fd, st, path, key);
  if (h.tokens < kTokenFileMinTokens)
    throw file_error(path, key,
                     "holds " + std::to_string(h.tokens) + (h.tokens == 1 ? " token" : " tokens") +
                         "; training needs at least " + std::to_string(kTokenFileMinTokens) +
                         " (one to predict the other)");
  const int64_t vocab = tok.vocab_size();
  int64_t at = -1, id = 0;
  if (h.width == 2) {
    uint16_t v = 0;
    at = first_id_beyond<uint16_t>(f.fd, h.tokens, vocab, v, path, key);
    id = v;
  } else {
    uint32_t v = 0;
    at = first_id_beyond<uint32_t>(f.fd, h.tokens, vocab, v, path, key);
    id = v;
  }
  // `keel eval --data F` takes its tokenizer from --tokenizer: it was told to set data.tokenizer,
  // a key of no file it reads.
  const bool flag = key.rfind("--", 0) == 0;
  if (at >= 0)
    throw file_error(path, key,
                     "token " + std::to_string(at) + " is id " + std::to_string(id) +
                         ", beyond the tokenizer's vocabulary (" + std::to_string(vocab) +
                         " ids): the file was written with another tokenizer; use that one (" +
                         (flag ? "--tokenizer gpt2:DIR" : "data.tokenizer = \"gpt2:DIR\"") +
                         " for llm.c's GPT-2 files, " +
                         (flag ? "--tokenizer hf:PATH" : "\"hf:PATH\"") + " for Llama 3's)");
  const auto bytes = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, f.fd, 0);
  if (map == MAP_FAILED)
    throw file_error(path, key, std::string("cannot be mapped: ") + std::strerror(errno));
  const auto len = static_cast<size_t>(seq_len);
  if (h.width == 2)
    return std::make_unique<TokenFileDataset<uint16_t>>(map, bytes, h.tokens, len, path, key);
  return std::make_unique<TokenFileDataset<int32_t>>(map, bytes, h.tokens, len, path, key);
}

namespace {

// The first kTokenFileHeaderBytes of a token file of `tokens` ids for a vocabulary of `vocab_size`.
std::string token_file_header(int64_t tokens, int64_t vocab_size) {
  if (tokens > INT32_MAX)
    throw Error(
        "a token file holds at most 2^31 - 1 tokens (its header counts them in an "
        "int32); this text has " +
            std::to_string(tokens) + ": split it into several files",
        Error::kUsage);
  const bool narrow = vocab_size <= 65536;
  std::string header(static_cast<size_t>(kTokenFileHeaderBytes), '\0');
  const int32_t h[3] = {narrow ? kGpt2Magic : kLlama3Magic, narrow ? kGpt2Version : kLlama3Version,
                        static_cast<int32_t>(tokens)};
  std::memcpy(header.data(), h, sizeof h);
  return header;
}

// Appends ids[i] to `out` in `width` bytes, each checked in [0, vocab_size); `first` numbers them.
void append_ids(std::string& out, std::span<const int32_t> ids, int width, int64_t vocab_size,
                int64_t first) {
  const size_t at = out.size();
  out.resize(at + ids.size() * static_cast<size_t>(width));
  char* p = out.data() + at;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size)
      throw Error("token " + std::to_string(first + static_cast<int64_t>(i)) + " is id " +
                  std::to_string(id) + ", outside the tokenizer's vocabulary of " +
                  std::to_string(vocab_size));
    if (width == 2) {
      const auto v = static_cast<uint16_t>(id);
      std::memcpy(p + i * 2, &v, 2);
    } else {
      std::memcpy(p + i * 4, &id, 4);
    }
  }
}

}  // namespace

std::string token_file_bytes(std::span<const int32_t> ids, int64_t vocab_size) {
  std::string out = token_file_header(static_cast<int64_t>(ids.size()), vocab_size);
  append_ids(out, ids, vocab_size <= 65536 ? 2 : 4, vocab_size, 0);
  return out;
}

TokenFileWriter::TokenFileWriter(const std::string& path, int64_t vocab_size)
    : path_(path),
      tmp_(path + ".tmp-" + std::to_string(::getpid())),
      vocab_size_(vocab_size),
      width_(vocab_size <= 65536 ? 2 : 4) {
  if (const std::string why = replaced_file_problem(path); !why.empty())
    throw Error("cannot write the token file " + path + ": it " + why +
                    "; give the path of a file (a token file is written whole, then renamed "
                    "into place)",
                Error::kUsage);
  // A tokenize killed while writing (SIGKILL, the OOM killer) left its FILE.tmp-PID, as large as
  // the corpus's ids, for good.
  const std::filesystem::path target(path);
  io::remove_dead_temps(target.parent_path().string(), target.filename().string() + ".tmp-");
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw Error("cannot write the token file " + path + ": " + write_failure(errno), Error::kUsage);
  const std::string header = token_file_header(0, vocab_size);
  write_all(header.data(), header.size(), 0);
}

TokenFileWriter::~TokenFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

int64_t TokenFileWriter::bytes() const { return kTokenFileHeaderBytes + tokens_ * width_; }

void TokenFileWriter::write_all(const void* data, size_t n, int64_t offset) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0)
      throw Error("cannot write the token file " + path_ + ": " +
                  write_failure(put < 0 ? errno : ENOSPC) + "; nothing was written over " + path_);
    p += put;
    n -= static_cast<size_t>(put);
    offset += put;
  }
}

void TokenFileWriter::append(std::span<const int32_t> ids) {
  if (tokens_ + static_cast<int64_t>(ids.size()) > INT32_MAX)
    token_file_header(tokens_ + static_cast<int64_t>(ids.size()), vocab_size_);  // its Error
  std::string block;
  append_ids(block, ids, width_, vocab_size_, tokens_);
  write_all(block.data(), block.size(), bytes());
  tokens_ += static_cast<int64_t>(ids.size());
}

void TokenFileWriter::commit() {
  const std::string header = token_file_header(tokens_, vocab_size_);
  write_all(header.data(), header.size(), 0);
  if (::fsync(fd_) != 0)
    throw Error("cannot write the token file " + path_ + ": fsync failed: " + write_failure(errno) +
                "; nothing was written over " + path_);
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp_.c_str());
    throw Error("cannot write the token file " + path_ + ": " + std::strerror(e));
  }
  // The rename is durable once the directory is: without this a crash could leave no file.
  io::fsync_dir(std::filesystem::path(path_).parent_path().string());
}

}  // namespace keel::data
