// `keel memory --params N --precision P --optimizer adamw [--batch B --seq T --layers L --hidden H
// --heads N --kv-heads N --ffn F --vocab V --tie-embeddings false]`: weights, gradients, optimizer
// state, low-precision copies and activations of a training step (keel/monitor/memory_estimate.h
// has the model behind the numbers).
#include <cmath>
#include <cstdio>

#include "apps/keel/commands.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/numerics/error.h"

namespace keel::cli {

namespace {
struct MemoryArgs {
  std::string params;
  monitor::MemoryQuery q;
  bool json = false;
};

// "100M", "1.5B", "350k", "124000000".
int64_t parse_count(const std::string& s) {
  double mult = 1;
  std::string num = s;
  if (!num.empty()) {
    const char u = static_cast<char>(std::toupper(static_cast<unsigned char>(num.back())));
    if (u == 'K' || u == 'M' || u == 'B' || u == 'G') {
      mult = u == 'K' ? 1e3 : u == 'M' ? 1e6 : 1e9;
      num.pop_back();
    }
  }
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(num, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != num.size() || !(v * mult >= 1) || !std::isfinite(v))
    throw Error("memory --params " + s + ": give a positive count such as 124000000, 100M or 1.5B",
                Error::kUsage);
  return static_cast<int64_t>(std::llround(v * mult));
}
}  // namespace

Command add_memory(CLI::App& app) {
  auto a = std::make_shared<MemoryArgs>();
  CLI::App* sub = app.add_subcommand(
      "memory", "Estimate weights, grads, optimizer state and activations of a training step");
  sub->add_option("--params", a->params, "parameter count (100M, 1.5B, ...); default: from sizes");
  sub->add_option("--precision", a->q.precision,
                  "32-true | bf16-mixed | 16-mixed | bf16-true | 16-true")
      ->capture_default_str();
  sub->add_option("--optimizer", a->q.optimizer, "adamw | sgd")->capture_default_str();
  sub->add_option("--batch", a->q.batch, "micro-batch size B");
  sub->add_option("--seq", a->q.seq, "sequence length T");
  sub->add_option("--layers", a->q.layers, "transformer layers L");
  sub->add_option("--hidden", a->q.hidden, "hidden size H");
  sub->add_option("--heads", a->q.heads, "attention heads (default hidden/64)");
  sub->add_option("--kv-heads", a->q.kv_heads, "llama: key/value heads (GQA; default: --heads)");
  sub->add_option("--tie-embeddings", a->q.tie_embeddings,
                  "llama: lm_head shares the embedding (true | false; gpt2 always ties)")
      ->default_str("true");
  sub->add_option("--ffn", a->q.ffn, "MLP width (default: the family's rule)");
  sub->add_option("--vocab", a->q.vocab, "vocabulary size (default 259, the byte tokenizer)");
  sub->add_option("--family", a->q.family, "gpt2 | llama")->capture_default_str();
  sub->add_option("--attention", a->q.attention, "eager | math | flash")->capture_default_str();
  sub->add_flag("--json", a->json, "print one JSON object (bytes)");
  return {sub, [a] {
            monitor::MemoryQuery q = a->q;
            if (!a->params.empty()) q.params = parse_count(a->params);
            const monitor::MemoryEstimate e = monitor::estimate_memory(q);
            if (a->json)
              std::printf("%s\n", monitor::memory_to_json(e).dump().c_str());
            else
              std::fputs(monitor::format_memory(e).c_str(), stdout);
            return 0;
          }};
}

}  // namespace keel::cli
