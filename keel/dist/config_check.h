// Ranks agree before they talk (DESIGN §9): before the first collective of a run, every rank
// compares a digest of its effective config with the others'. Ranks with different
// dist.bucket_mb would all-reduce different sizes (heap corruption), different max_steps or
// check_every would wait for each other forever, a different batch_size would silently train
// another run; so a difference is an error, on every rank, naming the differing keys.
#pragma once
#include "keel/dist/process_group.h"
#include "keel/train/config.h"

namespace keel::dist {

// Keys that may legitimately differ per rank (a rank's own device, thread count, console).
bool may_differ_per_rank(const std::string& key);

// All-gathers a 52-bit hash of each key's value (a fixed-size exchange: first the key count, so
// that ranks of different keel builds cannot exchange different sizes), then throws (kUsage), on
// every rank alike, an Error naming each key whose value differs and this rank's value of it.
void check_config_agrees(const Config& cfg, ProcessGroup& pg);

}  // namespace keel::dist
