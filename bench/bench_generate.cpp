// Decoding tokens/s of random models shaped like GPT-2 124M (12 layers, 768 wide, 12 heads, vocab
// 50,257) and Llama-3.2-1B (16 layers, 2048 wide, 32 heads / 8 kv heads, MLP 8192, vocab 128,256,
// tied, RoPE llama3 scaling) through models::generate: greedy, batch 1, with the key/value cache,
// and the peer measured in the same run — the same tokens without the cache (every step re-runs
// the whole sequence) — so the ratio shows what the cache buys. Then `rows` prompts decoded side
// by side (models::generate_rows, keel generate --input --batch-size) against the same prompts
// one after another: the prompts' passes (one after another; side by side, right-padded, in one
// pass), the decode's tokens/s over all rows, and the ratios.
//
//   ./build/bench/bench_generate [gpt2|llama|all] [new_tokens=32] [prompt=64] [cpu|cuda]
//                                [precision=32-true] [attention=eager] [rows=8]
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "keel/amp/autocast.h"
#include "keel/amp/precision.h"
#include "keel/backend/cuda_api.h"
#include "keel/models/generate.h"
#include "keel/nn/module.h"

using namespace keel;

namespace {

models::ModelSpec preset(const std::string& name) {
  models::ModelSpec s;
  if (name == "gpt2") {
    s.family = "gpt2";
    s.n_layer = 12, s.n_embd = 768, s.n_head = 12, s.vocab_size = 50257, s.max_seq_len = 1024;
  } else {
    s.family = "llama";
    s.n_layer = 16, s.n_embd = 2048, s.n_head = 32, s.n_kv_head = 8, s.intermediate_size = 8192;
    s.vocab_size = 128256, s.max_seq_len = 2048, s.rope_theta = 500000.0;
    s.rope_scaling.kind = ops::RopeScaling::Kind::kLlama3;
    s.rope_scaling.factor = 32;
    s.rope_scaling.original_max_position = 8192;
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "all";
  const int64_t new_tokens = argc > 2 ? std::atoll(argv[2]) : 32;
  const int64_t prompt_len = argc > 3 ? std::atoll(argv[3]) : 64;
  Device dev = device_from_string(argc > 4 ? argv[4] : "cpu");
  const std::string precision = argc > 5 ? argv[5] : "32-true";
  const std::string attention = argc > 6 ? argv[6] : "eager";
  const int64_t rows = argc > 7 ? std::atoll(argv[7]) : 8;
  if (dev.is_cuda() && !cuda::status().usable) {
    std::printf("no usable CUDA device (%s)\n", cuda::status().reason.c_str());
    return 1;
  }
  const PrecisionPolicy policy = resolve_precision(precision, dev, true);
  std::printf("device %s | threads %d | %s | attention %s | prompt %lld, %lld new tokens\n",
              dev.str().c_str(), omp_get_max_threads(), policy.name().c_str(), attention.c_str(),
              static_cast<long long>(prompt_len), static_cast<long long>(new_tokens));
  for (const std::string name : {"gpt2", "llama"}) {
    if (which != "all" && which != name) continue;
    models::ModelSpec s = preset(name);
    s.param_dtype = policy.param_dtype;
    s.attention = ops::attention_backend_from_name(attention);
    auto model = models::make_causal_lm(s, 1);
    if (dev.is_cuda()) nn::move_to_device(*model, dev);
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < prompt_len; ++i) prompt.push_back(static_cast<int32_t>(i * 97 % 1000));
    amp::AutocastGuard autocast(policy.autocast, policy.compute_dtype);
    models::GenerateOptions o;
    o.max_new_tokens = new_tokens;
    models::generate(*model, prompt, o);  // warm-up (kernels, memory cache)
    const models::GenerateResult cached = models::generate(*model, prompt, o);
    o.use_cache = false;
    const models::GenerateResult full = models::generate(*model, prompt, o);
    const double n = static_cast<double>(cached.tokens.size() - 1);
    const double tps = n / cached.decode_seconds, tps_full = n / full.decode_seconds;
    std::printf(
        "%-5s %6.1fM params | prompt %.1f ms | decode with cache %8.1f tokens/s | without %7.1f "
        "tokens/s | cache x%.1f | same tokens: %s\n",
        name.c_str(), model->num_parameters() / 1e6, 1e3 * cached.prompt_seconds, tps, tps_full,
        tps / tps_full, cached.tokens == full.tokens ? "yes" : "NO");
    if (rows < 2) continue;
    // Rows of different prompts (their own lengths), each decoding new_tokens.
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> p(prompt.begin(), prompt.end() - r % 4);
      p[0] = static_cast<int32_t>(r);
      prompts.push_back(p);
    }
    o.use_cache = true;
    double one_by_one = 0, prompts_alone = 0;
    int64_t tokens = 0;
    std::vector<std::vector<int32_t>> alone;
    for (const auto& p : prompts) {
      const models::GenerateResult r = models::generate(*model, p, o);
      one_by_one += r.decode_seconds;
      prompts_alone += r.prompt_seconds;
      tokens += static_cast<int64_t>(r.tokens.size()) - 1;  // the first comes from the prompt
      alone.push_back(r.tokens);
    }
    const std::vector<models::GenerateResult> side = models::generate_rows(*model, prompts, o);
    bool same = true;
    for (size_t r = 0; r < side.size(); ++r) same = same && side[r].tokens == alone[r];
    const double tps_alone = static_cast<double>(tokens) / one_by_one;
    const double tps_rows = static_cast<double>(tokens) / side[0].decode_seconds;
    // The prompts' passes: one after another, and side by side (right-padded, one pass).
    std::printf(
        "%-5s %lld rows | prompts one after another %8.1f ms, side by side %8.1f ms (x%.2f) | "
        "decode one after another %8.1f tokens/s | side by side %8.1f tokens/s | x%.2f | same "
        "tokens: %s\n",
        name.c_str(), static_cast<long long>(rows), 1e3 * prompts_alone,
        1e3 * side[0].prompt_seconds, prompts_alone / side[0].prompt_seconds, tps_alone, tps_rows,
        tps_rows / tps_alone, same ? "yes" : "NO (rounding over rows parted a near-tie)");
  }
  return 0;
}
