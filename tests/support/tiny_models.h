// The tiny GPT-2, Llama, Qwen2 and Qwen3 of tests/fixtures/gen_models.py (header-only: tests of
// any layer from models/ on include it). Qwen2 and Qwen3 are the Llama family with q/k/v biases and
// with per-head q/k norms.
#pragma once
#include <string>

#include "keel/models/causal_lm.h"

namespace keel::test {

// "qwen3_d8": the Qwen3 with heads 8 wide over n_embd 16 / 4 heads (Qwen3-0.6B's head_dim 128
// over 1024 / 16). "mistral_w3": the Llama as a Mistral whose attention slides over the last 3
// positions (Mistral-7B-v0.1's sliding_window 4096). "qwen2_w3": the Qwen2 with use_sliding_window,
// a window of 3 on layer 1 only (max_window_layers 1).
inline models::ModelSpec tiny_model_spec(const std::string& family) {
  models::ModelSpec s;
  const bool wide_heads = family == "qwen3_d8";
  const bool qwen_window = family == "qwen2_w3";
  const bool qwen = family == "qwen2" || family == "qwen3" || wide_heads || qwen_window;
  const bool mistral = family == "mistral_w3";
  s.family = qwen || mistral ? "llama" : family;
  s.hf_model_type = qwen ? family.substr(0, 5) : mistral ? "mistral" : "";
  if (wide_heads) s.head_width = 8;
  if (mistral || qwen_window) s.sliding_window = 3;
  if (qwen_window) s.sliding_from_layer = 1;
  s.n_layer = 2;
  s.n_embd = 16;
  s.vocab_size = 37;
  s.max_seq_len = 8;
  s.norm_eps = 1e-5;
  if (family == "gpt2") {
    s.n_head = 2;
  } else {
    s.n_head = 4;
    s.n_kv_head = 2;
    s.intermediate_size = 48;
    s.tie_embeddings = false;
  }
  return s;
}

}  // namespace keel::test
