// Autoregressive decoding of a CausalLM: the next-token choice (greedy, temperature, top-k,
// top-p) and the loop around it, with or without the key/value cache. Token ids only: text,
// stop strings and streaming are the caller's (the tokenizer lives in data/, below this layer).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "keel/models/causal_lm.h"
#include "keel/tensor/random.h"

namespace keel::models {

// HF generate's choices, applied in its order: the repetition penalty to the logits (greedy or
// sampled), then temperature, top-k, top-p and min-p to the tokens sampled from.
struct SamplingOptions {
  double temperature = 0;  // 0: greedy (argmax; the lowest id wins a tie)
  int64_t top_k = 0;       // > 0: sample among the k most likely tokens only
  double top_p = 1;        // < 1: the smallest set of most likely tokens whose mass reaches top_p
  // > 0: tokens whose probability is below min_p times the most likely one's are not sampled
  // (HF's MinPLogitsWarper, after top-p).
  double min_p = 0;
  // != 1: each token already in the sequence (the prompt's and the new ones) has its logit
  // divided by this where positive and multiplied where negative (HF's
  // RepetitionPenaltyLogitsProcessor: > 1 discourages repeats). 1: off.
  double repetition_penalty = 1;
  void validate() const;  // Error (kUsage) naming the flag and its range
};

// The next token from one row of logits (f32, length V) after the tokens of `sequence` (the
// repetition penalty's). Sampling draws one uniform from `rng`.
int32_t sample_token(const std::vector<float>& logits, const SamplingOptions& opt, Rng& rng,
                     const std::vector<int32_t>& sequence = {});

struct GenerateOptions {
  SamplingOptions sampling;
  uint64_t seed = 0;  // sampling's Rng
  int64_t max_new_tokens = 64;
  // Stop after producing any of these (not counted in `tokens`; negative ids are ignored): the
  // tokenizer's eos and the model's generation_config.json eos_token_id list (Llama-3.1-Instruct
  // ends a turn with <|eot_id|> and a tool call with <|eom_id|>). Empty: never.
  std::vector<int64_t> eos_ids;
  // > 0: choose only among ids [0, choosable), the tokenizer's vocabulary, when the model has more
  // rows (the padding row data.pad = "add" appends, a vocabulary rounded up): those ids name no
  // text, and a sampled one would end the decode in a tokenizer error. 0: every id.
  int64_t choosable = 0;
  bool use_cache = true;     // false: every step re-runs the whole sequence (the reference)
  bool keep_logits = false;  // record each step's logits row (tests compare them)
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // the new tokens, in order (eos excluded)
  // "eos", "max_new_tokens", "max_seq_len", "caller", or "nonfinite": the logits of the next
  // token held NaN or inf, so any token chosen from them would be arbitrary (argmax over NaN
  // answers whatever comparisons with NaN leave; sampling, the last id).
  std::string stop;
  int64_t nonfinite_logits = 0;                   // "nonfinite": how many of that row's values
  std::vector<std::vector<float>> logits;         // keep_logits: the row each token was chosen from
  double prompt_seconds = 0, decode_seconds = 0;  // the prompt's pass; the steps after it
};

// The key/value cache a conversation keeps between its decodes (keel chat's turns): a turn's
// prompt begins with the tokens the turns before read and wrote, so only what follows them is
// computed. `tokens` are those whose keys and values `cache` holds, in order.
struct GenerateSession {
  std::unique_ptr<KVCache> cache;
  std::vector<int32_t> tokens;
  int64_t reused = 0;  // the last decode: prompt tokens read from the cache, not computed again
};

// Decodes from `prompt` (non-empty ids < vocab_size) with gradients off, in the model's current
// autocast state and device. `on_token` (may be empty) sees every new token as it is chosen and
// returns false to stop ("caller"). Generation stops at max_seq_len ("max_seq_len") and at logits
// that are not all finite ("nonfinite") with the tokens so far; a prompt that leaves no room for
// one new token is an Error naming both lengths.
// With `session` (and the cache on), the decode starts from the session's cache where its tokens
// begin the prompt (at least the prompt's last token is computed), and leaves the cache and its
// tokens there for the next; a cache too small for this decode is replaced by one twice as large.
GenerateResult generate(CausalLM& model, const std::vector<int32_t>& prompt,
                        const GenerateOptions& opt,
                        const std::function<bool(int32_t)>& on_token = {},
                        GenerateSession* session = nullptr);

// Several prompts decoded side by side (keel generate --input --batch-size): the prompts' passes
// together (right-padded, in groups of at most 4,096 tokens), then one forward a step
// over every row still decoding, whose projections read the weights once for all the rows (a step
// of B rows costs about what one row's does while the weights, not the arithmetic, bound it), each
// row attending over its own cache. Row b is what generate(prompts[b]) gives, with its own
// Rng(opt.seed) and stops, up to the rounding of products over several rows: greedy tokens agree
// but where two logits are within rounding. on_token(b, id) as generate's. Without the cache, or
// for one prompt, each row is generate()'s.
std::vector<GenerateResult> generate_rows(
    CausalLM& model, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& opt,
    const std::function<bool(size_t row, int32_t)>& on_token = {});

}  // namespace keel::models
