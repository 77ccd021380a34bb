#include "keel/dist/config_check.h"

#include <vector>

#include "keel/numerics/error.h"

namespace keel::dist {

bool may_differ_per_rank(const std::string& key) {
  return key == "run.device" || key == "run.threads" || key == "log.console";
}

namespace {

// FNV-1a over the key and its value, cut to 52 bits so that a double carries it exactly.
double hash52(const std::string& key, const std::string& value) {
  uint64_t h = 1469598103934665603ull;
  for (const std::string* s : {&key, &value})
    for (unsigned char c : *s + '\x1f') h = (h ^ c) * 1099511628211ull;
  return static_cast<double>(h & ((uint64_t{1} << 52) - 1));
}

}  // namespace

void check_config_agrees(const Config& cfg, ProcessGroup& pg) {
  const int world = pg.world_size(), rank = pg.rank();
  if (world <= 1) return;
  std::vector<std::pair<std::string, std::string>> values;
  for (auto& kv : config_values(cfg))
    if (!may_differ_per_rank(kv.first)) values.push_back(kv);
  const double count = static_cast<double>(values.size());
  std::vector<double> counts(static_cast<size_t>(world));
  pg.set_purpose("comparing the ranks' configs");
  pg.all_gather(&count, 1, counts.data());
  for (int r = 0; r < world; ++r)
    if (counts[static_cast<size_t>(r)] != count)
      throw Error("rank " + std::to_string(rank) + " and rank " + std::to_string(r) +
                      " run different keel builds (" + std::to_string(values.size()) + " and " +
                      std::to_string(static_cast<int64_t>(counts[static_cast<size_t>(r)])) +
                      " config keys); run the same keel binary on every rank",
                  Error::kUsage);
  std::vector<double> mine, all(values.size() * static_cast<size_t>(world));
  for (auto& [k, v] : values) mine.push_back(hash52(k, v));
  pg.set_purpose("comparing the ranks' configs");
  pg.all_gather(mine.data(), mine.size(), all.data());
  std::string diff;
  for (size_t i = 0; i < values.size(); ++i) {
    std::string ranks;
    int differing = 0;
    for (int r = 0; r < world; ++r)
      if (all[static_cast<size_t>(r) * values.size() + i] != mine[i])
        ranks += (differing++ == 0 ? "" : ", ") + std::to_string(r);
    if (differing > 0)
      diff += "\n  " + values[i].first + " = " + values[i].second + " here, another value on " +
              (differing == 1 ? "rank " : "ranks ") + ranks;
  }
  if (!diff.empty())
    // The caller's "error (rank R of N): " says whose values these are.
    throw Error("the ranks' configs differ before the first collective:" + diff +
                    "\nevery rank must run the same config (only run.device, run.threads and "
                    "log.console may differ); check the --set overrides and config files of each "
                    "rank",
                Error::kUsage);
}

}  // namespace keel::dist
