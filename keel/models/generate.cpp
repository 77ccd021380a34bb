#include "keel/models/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>

#include "keel/autograd/node.h"
#include "keel/numerics/error.h"
#include "keel/ops/shape.h"

namespace keel::models {

void SamplingOptions::validate() const {
  // Flags as given ("%g"): std::to_string printed --temperature -1 as "-1.000000" and -1e-9 as
  // "-0.000000".
  auto shown = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  if (!(temperature >= 0) || !std::isfinite(temperature))
    throw Error("--temperature " + shown(temperature) + ": use 0 (greedy) or > 0", Error::kUsage);
  if (top_k < 0)
    throw Error("--top-k " + std::to_string(top_k) + ": use 0 (off) or >= 1", Error::kUsage);
  if (!(top_p > 0 && top_p <= 1))
    throw Error("--top-p " + shown(top_p) + ": use a value in (0, 1]", Error::kUsage);
  if (!(min_p >= 0 && min_p < 1))
    throw Error("--min-p " + shown(min_p) + ": use 0 (off) or a value in (0, 1)", Error::kUsage);
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
    throw Error("--repetition-penalty " + shown(repetition_penalty) +
                    ": use a positive number (1: off; above 1 discourages repeats, e.g. 1.1)",
                Error::kUsage);
  // Greedy decoding takes the most likely token whatever the cut: --top-k 5 alone was accepted
  // and ignored (HF's generate warns that top_k "is only used in sample-based generation modes").
  if (temperature == 0 && (top_k != 0 || top_p != 1 || min_p != 0))
    throw Error((top_k != 0   ? "--top-k " + std::to_string(top_k)
                 : top_p != 1 ? "--top-p " + shown(top_p)
                              : "--min-p " + shown(min_p)) +
                    " cuts the tokens sampled from, but --temperature 0 decodes greedily (the "
                    "most likely token each step) and would ignore it: give a --temperature "
                    "above 0 (e.g. 0.7) to sample, or leave it out",
                Error::kUsage);
}

int32_t sample_token(const std::vector<float>& row, const SamplingOptions& opt, Rng& rng,
                     const std::vector<int32_t>& sequence) {
  KEEL_CHECK(!row.empty(), "sample_token: no logits");
  const int64_t V = static_cast<int64_t>(row.size());
  // The repetition penalty, once per token the sequence holds (in f32, as HF's scores).
  std::vector<float> penalized;
  if (opt.repetition_penalty != 1 && !sequence.empty()) {
    penalized = row;
    const float p = static_cast<float>(opt.repetition_penalty);
    std::vector<bool> seen(static_cast<size_t>(V));
    for (int32_t id : sequence)
      if (id >= 0 && id < V && !seen[id]) {
        seen[id] = true;
        float& l = penalized[id];
        l = l < 0 ? l * p : l / p;
      }
  }
  const std::vector<float>& logits = penalized.empty() ? row : penalized;
  if (opt.temperature == 0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  // Candidates by descending logit (ties: lower id first), cut to top_k.
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const int64_t k = opt.top_k > 0 ? std::min(opt.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  ids.resize(static_cast<size_t>(k));
  // Softmax of logits / temperature in f64 over the candidates, then the top-p nucleus.
  std::vector<double> p(ids.size());
  const double top = logits[ids[0]];
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i)
    sum += p[i] = std::exp((logits[ids[i]] - top) / opt.temperature);
  size_t keep = ids.size();
  if (opt.top_p < 1) {
    double mass = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      mass += p[i] / sum;
      if (mass >= opt.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  // min-p: below min_p times the top token's probability (p[0] = 1 here: a ratio of the
  // candidates' probabilities, the same before and after top-p renormalizes them).
  if (opt.min_p > 0)
    for (size_t i = 1; i < keep; ++i)
      if (p[i] < opt.min_p) {
        keep = i;
        break;
      }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += p[i];
  double u = rng.uniform() * kept;
  for (size_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u < 0) return ids[i];
  }
  return ids[keep - 1];
}

namespace {

// A prompt the model can continue: ids in its vocabulary, room for one new token.
void check_prompt(const std::vector<int32_t>& prompt, const ModelSpec& spec) {
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (n == 0) throw Error("the prompt is empty: give at least one token", Error::kUsage);
  if (n >= spec.max_seq_len)
    throw Error("the prompt has " + std::to_string(n) + " tokens but the model's max_seq_len is " +
                    std::to_string(spec.max_seq_len) +
                    ": no room for a new token; shorten the prompt",
                Error::kUsage);
  for (int64_t i = 0; i < n; ++i)
    if (prompt[i] < 0 || prompt[i] >= spec.vocab_size)
      throw Error("prompt token " + std::to_string(prompt[i]) + " at position " +
                      std::to_string(i) + " is outside the model's vocabulary [0, " +
                      std::to_string(spec.vocab_size) + "); is this the model's tokenizer?",
                  Error::kUsage);
}

// The token a decode takes from the logits of its last position, or none when it stops there
// (r.stop says why: "nonfinite" or "eos"); a token taken is in r.tokens.
std::optional<int32_t> take_token(std::vector<float> row, const GenerateOptions& opt, Rng& rng,
                                  const std::vector<int32_t>& sequence, GenerateResult& r) {
  const int64_t V = static_cast<int64_t>(row.size());
  r.nonfinite_logits =
      std::count_if(row.begin(), row.end(), [](float v) { return !std::isfinite(v); });
  if (r.nonfinite_logits > 0) {
    r.stop = "nonfinite";
    return std::nullopt;
  }
  if (opt.choosable > 0 && opt.choosable < V) row.resize(static_cast<size_t>(opt.choosable));
  const int32_t next = sample_token(row, opt.sampling, rng, sequence);
  if (opt.keep_logits) r.logits.push_back(std::move(row));
  if (std::find(opt.eos_ids.begin(), opt.eos_ids.end(), next) != opt.eos_ids.end()) {
    r.stop = "eos";
    return std::nullopt;
  }
  r.tokens.push_back(next);
  return next;
}

}  // namespace

GenerateResult generate(CausalLM& model, const std::vector<int32_t>& prompt,
                        const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token,
                        GenerateSession* session) {
  using clock = std::chrono::steady_clock;
  opt.sampling.validate();
  const ModelSpec& spec = model.spec();
  check_prompt(prompt, spec);
  const int64_t n = static_cast<int64_t>(prompt.size());
  NoGradGuard no_grad;
  model.train(false);
  Rng rng(opt.seed);
  Device dev = Device::cpu();
  for (auto& [name, p] : model.named_parameters()) dev = p.device();
  // Room for the prompt and every token this decode may add (max_seq_len at most).
  const int64_t room = n + std::clamp<int64_t>(opt.max_new_tokens, 0, spec.max_seq_len - n);
  std::optional<KVCache> own;  // the decode's cache, when no session keeps one
  KVCache* cache = nullptr;
  int64_t reused = 0;  // prompt tokens whose keys and values the session's cache holds already
  if (session && opt.use_cache) {
    if (!session->cache || session->cache->capacity < room) {
      // Twice as large, with the rows the old one held (each conversation turn is longer).
      const int64_t twice = session->cache ? 2 * session->cache->capacity : room;
      auto grown = std::make_unique<KVCache>(model.make_kv_cache(std::max(room, twice)));
      // (session->tokens are the rows the cache holds: set below after each decode)
      const int64_t kept = static_cast<int64_t>(session->tokens.size());
      for (size_t l = 0; kept > 0 && l < grown->layers.size(); ++l) {
        auto keep = [&](Tensor& to, const Tensor& from) {
          to = Tensor::empty({grown->capacity, from.size(1)}, from.dtype(), from.device());
          Tensor rows = to.slice_rows(0, kept);
          rows.copy_from(from.slice_rows(0, kept));
        };
        keep(grown->layers[l].k, session->cache->layers[l].k);
        keep(grown->layers[l].v, session->cache->layers[l].v);
      }
      session->cache = std::move(grown);
    }
    const size_t held = std::min(session->tokens.size(), prompt.size() - 1);
    while (reused < static_cast<int64_t>(held) && session->tokens[reused] == prompt[reused])
      ++reused;
    cache = session->cache.get();
    cache->length = reused;  // later rows are written over (a decode that throws leaves these)
    session->tokens.resize(static_cast<size_t>(reused));
  } else {
    cache = &own.emplace(model.make_kv_cache(room));
  }
  std::vector<int32_t> seq = prompt;
  GenerateResult r;
  r.stop = "max_new_tokens";
  auto t0 = clock::now();
  // What the next forward reads: past what the cache holds.
  std::vector<int32_t> feed(prompt.begin() + reused, prompt.end());
  for (int64_t step = 0; step < opt.max_new_tokens; ++step) {
    if (static_cast<int64_t>(seq.size()) >= spec.max_seq_len) {
      r.stop = "max_seq_len";
      break;
    }
    // Phi-3's longrope rotates a pass by its long factors once the sequence passes
    // original_max_position_embeddings; the keys the cache holds were rotated by the short ones.
    // There HF's Phi3ForCausalLM.prepare_inputs_for_generation drops the cache and runs the
    // whole sequence again: so does this decode, once.
    if (opt.use_cache && spec.rope_scaling.kind == ops::RopeScaling::Kind::kLongRope &&
        cache->length > 0 && cache->length <= spec.rope_scaling.original_max_position &&
        std::ssize(seq) > spec.rope_scaling.original_max_position) {
      cache->length = 0;
      feed = seq;
    }
    const std::vector<int32_t>& in = opt.use_cache ? feed : seq;
    const int64_t t = static_cast<int64_t>(in.size());
    Tensor ids = Tensor::from_ints(std::vector<int64_t>(in.begin(), in.end()), {1, t}).to(dev);
    // (the cache's pass computes the head for the last position alone)
    Tensor logits = opt.use_cache ? model.forward_cached(ids, *cache, /*last_only=*/true)
                                  : model.forward(ids, Tensor());
    const int64_t V = logits.size(-1), rows = logits.numel() / V;
    std::vector<float> row = logits.view({rows, V}).slice_rows(rows - 1, rows).to_floats();
    if (step == 0) r.prompt_seconds = std::chrono::duration<double>(clock::now() - t0).count();
    const std::optional<int32_t> next = take_token(std::move(row), opt, rng, seq, r);
    if (!next) break;
    seq.push_back(*next);
    feed.assign(1, *next);
    if (on_token && !on_token(*next)) {
      r.stop = "caller";
      break;
    }
  }
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t0).count() - r.prompt_seconds;
  if (session && opt.use_cache) {  // the tokens fed: the last one chosen never was
    session->tokens.assign(seq.begin(), seq.begin() + cache->length);
    session->reused = reused;
  }
  return r;
}

std::vector<GenerateResult> generate_rows(
    CausalLM& model, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& opt,
    const std::function<bool(size_t row, int32_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  opt.sampling.validate();
  const ModelSpec& spec = model.spec();
  for (const std::vector<int32_t>& p : prompts) check_prompt(p, spec);
  std::vector<GenerateResult> results;
  // Without the cache (the reference) or alone, a row is generate()'s decode; so is a longrope
  // row that may pass original_max_position_embeddings (one RoPE table a pass serves every row,
  // and generate() re-runs a crossing row's sequence with the long factors as HF does).
  bool crosses = false;
  if (spec.rope_scaling.kind == ops::RopeScaling::Kind::kLongRope)
    for (const std::vector<int32_t>& p : prompts)
      crosses =
          crosses || opt.max_new_tokens > spec.rope_scaling.original_max_position - std::ssize(p);
  if (!opt.use_cache || prompts.size() <= 1 || crosses) {
    for (size_t b = 0; b < prompts.size(); ++b)
      results.push_back(generate(model, prompts[b], opt,
                                 [&](int32_t id) { return !on_token || on_token(b, id); }));
    return results;
  }
  NoGradGuard no_grad;
  model.train(false);
  Device dev = Device::cpu();
  for (auto& [name, p] : model.named_parameters()) dev = p.device();
  struct Row {
    KVCache cache;
    Rng rng;
    std::vector<int32_t> sequence;  // the prompt, then the tokens taken
    int32_t next = -1;              // the token to feed next
  };
  std::vector<Row> rows;
  // A row that stops gives its cache back at once (the others may decode for long).
  auto stop = [&](size_t b, const char* why) {
    if (why) results[b].stop = why;
    rows[b].cache.layers = {};
  };
  // Row b takes its next token from its logits; false when it stops there.
  auto take = [&](size_t b, std::vector<float> logits) {
    const std::optional<int32_t> next =
        take_token(std::move(logits), opt, rows[b].rng, rows[b].sequence, results[b]);
    if (!next) return stop(b, nullptr), false;
    rows[b].next = *next;
    rows[b].sequence.push_back(*next);
    if (on_token && !on_token(b, *next)) return stop(b, "caller"), false;
    return true;
  };
  results.resize(prompts.size());
  for (GenerateResult& r : results) r.stop = "max_new_tokens";
  if (opt.max_new_tokens <= 0) return results;
  // The prompts' passes side by side, right-padded to the longest of their group (causal queries
  // never see the padding, whose keys each row's decode then writes over), then each row's first
  // token from its last position's logits. A group's activations are of rows x longest tokens:
  // groups of consecutive prompts keep them to 4,096 tokens (a longer prompt alone).
  constexpr int64_t kPrefillTokens = 4096;
  for (size_t b = 0; b < prompts.size(); ++b) {
    const int64_t n = std::ssize(prompts[b]);
    const int64_t room = n + std::clamp<int64_t>(opt.max_new_tokens, 0, spec.max_seq_len - n);
    rows.push_back({model.make_kv_cache(room), Rng(opt.seed), prompts[b]});
  }
  std::vector<size_t> decoding;  // the rows still decoding
  for (size_t first = 0; first < prompts.size();) {
    size_t end = first + 1;
    int64_t longest = std::ssize(prompts[first]);
    while (end < prompts.size() &&
           static_cast<int64_t>(end + 1 - first) * std::max(longest, std::ssize(prompts[end])) <=
               kPrefillTokens)
      longest = std::max(longest, std::ssize(prompts[end++]));
    std::vector<int64_t> padded, lengths;
    std::vector<KVCache*> caches;
    for (size_t b = first; b < end; ++b) {
      const int64_t n = std::ssize(prompts[b]);
      padded.insert(padded.end(), prompts[b].begin(), prompts[b].end());
      padded.insert(padded.end(), static_cast<size_t>(longest - n), prompts[b].back());
      lengths.push_back(n);
      if (rows[b].cache.capacity < longest) rows[b].cache = model.make_kv_cache(longest);
      caches.push_back(&rows[b].cache);
    }
    const auto p0 = clock::now();
    const int64_t group = static_cast<int64_t>(end - first);
    const Tensor logits =
        model.prefill_rows(Tensor::from_ints(padded, {group, longest}).to(dev), lengths, caches);
    const Tensor all = logits.view({group, logits.size(-1)});  // each row's last position's
    const double prompt = std::chrono::duration<double>(clock::now() - p0).count();
    for (size_t b = first; b < end; ++b) {
      results[b].prompt_seconds = prompt;  // (one pass for the group's rows)
      const int64_t i = static_cast<int64_t>(b - first);
      if (take(b, all.slice_rows(i, i + 1).to_floats())) decoding.push_back(b);
    }
    first = end;
  }
  const auto prompts_done = clock::now();
  // Then one step a token for every row still decoding: one forward over the rows.
  for (int64_t step = 1; step < opt.max_new_tokens && !decoding.empty(); ++step) {
    std::erase_if(decoding, [&](size_t b) {
      if (std::ssize(rows[b].sequence) < spec.max_seq_len) return false;
      stop(b, "max_seq_len");
      return true;
    });
    if (decoding.empty()) break;
    std::vector<size_t> still;
    std::vector<int64_t> feed;
    std::vector<KVCache*> caches;
    for (size_t b : decoding) feed.push_back(rows[b].next), caches.push_back(&rows[b].cache);
    const int64_t a = static_cast<int64_t>(decoding.size());
    const Tensor logits =
        model.forward_cached_rows(Tensor::from_ints(feed, {a, 1}).to(dev), caches);
    const int64_t V = logits.size(-1);
    const Tensor all = logits.view({a, V});
    for (int64_t i = 0; i < a; ++i) {
      const size_t b = decoding[static_cast<size_t>(i)];
      if (take(b, all.slice_rows(i, i + 1).to_floats())) still.push_back(b);
    }
    decoding = std::move(still);
  }
  // (a row that took max_new_tokens keeps that stop: its last token was chosen, never fed)
  const double decode = std::chrono::duration<double>(clock::now() - prompts_done).count();
  for (GenerateResult& r : results) r.decode_seconds = decode;
  return results;
}

}  // namespace keel::models
