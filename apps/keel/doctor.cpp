// `keel doctor [CONFIG] [--set section.key=value ...] [--json]`: checks a configuration before
// training (keel/monitor/doctor.h). Exit 0 when nothing blocks training, 1 otherwise.
#include <cstdio>

#include "apps/keel/commands.h"
#include "keel/dist/process_group.h"
#include "keel/monitor/doctor.h"

namespace keel::cli {

namespace {
struct DoctorArgs {
  std::string config;
  std::vector<std::string> sets;
  bool json = false;
  bool no_sanity = false;
};
}  // namespace

Command add_doctor(CLI::App& app) {
  auto a = std::make_shared<DoctorArgs>();
  CLI::App* sub =
      app.add_subcommand("doctor", "Check a config before training (static checks + one batch)");
  sub->add_option("CONFIG", a->config, "TOML config (no CONFIG: the defaults)");
  sub->add_option("--set", a->sets, "override a key: section.key=value (repeatable)")
      ->allow_extra_args(false);
  sub->add_flag("--json", a->json, "print one JSON object");
  sub->add_flag("--no-sanity", a->no_sanity, "static checks only (no one-batch pass)");
  return {sub, [a] {
            const Config cfg = load_config(a->config, a->sets);
            // What keel train refuses, doctor refuses alike (it said "nothing blocks training"
            // to train.eval_every without a validation split).
            check_keys_take_effect(cfg);
            monitor::DoctorOptions opt;
            opt.sanity = !a->no_sanity;
            opt.progress = [](const std::string& m) {
              std::fprintf(stderr, "keel doctor | %s\n", m.c_str());
            };
            // Under the mpirun line keel train runs with, rank 0 alone checks (each rank printed
            // a whole report), and checks the windows of that many ranks.
            if (dist::launched_by_mpirun() && cfg.dist.backend != "single") {
              if (dist::launcher_rank() != 0) return 0;
              opt.ranks = dist::launcher_world_size();
            }
            const monitor::DoctorReport r = monitor::run_doctor(cfg, opt);
            if (a->json)
              std::printf("%s\n", monitor::doctor_to_json(r).dump().c_str());
            else
              std::fputs(monitor::format_doctor(r).c_str(), stdout);
            return r.blocking ? 1 : 0;
          }};
}

}  // namespace keel::cli
