// `keel replay DIR [--precision P] [--attention A] [--bisect] [--json]`: re-runs a captured
// non-finite step (keel/monitor/replay.h) and says whether it reproduces, bit for bit, which module
// produced the first non-finite value and, with --bisect, the smallest change that fixes it.
#include <cstdio>

#include "apps/keel/commands.h"
#include "keel/monitor/replay.h"

namespace keel::cli {

namespace {
struct ReplayArgs {
  std::string dir;
  monitor::ReplayOptions opt;
  bool json = false;
};
}  // namespace

Command add_replay(CLI::App& app) {
  auto a = std::make_shared<ReplayArgs>();
  CLI::App* sub = app.add_subcommand(
      "replay", "Re-run a captured non-finite step (out_dir/debug/nan_capture/rank0)");
  sub->add_option("DIR", a->dir, "the capture directory")->required();
  sub->add_option("--precision", a->opt.precision, "re-run under another precision policy");
  sub->add_option("--attention", a->opt.attention, "re-run under another attention backend");
  sub->add_flag("--bisect", a->opt.bisect,
                "try one numerics change at a time and name the smallest that makes it finite");
  sub->add_option("--out", a->opt.out_dir, "where the replay writes (default DIR/replay)");
  sub->add_option("--set", a->opt.sets, "override a config key: section.key=value (repeatable)")
      ->allow_extra_args(false);
  sub->add_flag("--json", a->json, "print one JSON object");
  return {sub, [a] {
            const monitor::ReplayResult r = monitor::replay_capture(a->dir, a->opt);
            if (a->json)
              std::printf("%s\n", monitor::replay_to_json(r).dump().c_str());
            else
              std::fputs(monitor::format_replay(r).c_str(), stdout);
            return 0;
          }};
}

}  // namespace keel::cli
