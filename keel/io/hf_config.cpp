#include "keel/io/hf_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <tuple>

#include "keel/data/bpe.h"
#include "keel/io/hf_json.h"
#include "keel/io/hf_weights.h"
#include "keel/io/trained_model.h"
#include "keel/numerics/input_file.h"

namespace keel::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// YaRN's attention factor from its scale and mscale (HF's get_mscale): 1 up to a scale of 1.
double yarn_mscale(double scale, double mscale = 1) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// HF's `rope_scaling` object. "rope_type" (transformers >= 4.45) or "type" (older) names it.
// `max_positions`: the file's max_position_embeddings (yarn's factor and original context).
// `field`: what the file calls it (transformers 5's rope_parameters entries are read as it).
ops::RopeScaling read_rope_scaling(const json& rs, const std::string& file, int64_t max_positions,
                                   const std::string& field = "rope_scaling") {
  using Kind = ops::RopeScaling::Kind;
  const std::string where = file + ": " + field;
  if (!rs.is_object()) throw Error(where + " must be an object or null, got " + rs.dump());
  ConfigReader c{rs, file};
  const json* type = c.find({"rope_type", "type"});
  if (!type || !type->is_string())
    throw Error(where + " has no string field 'rope_type' (or 'type'): " + rs.dump());
  const std::string t = type->get<std::string>();
  ops::RopeScaling s;
  auto required = [&](const char* name) {
    const json* v = c.find({name});
    if (!v || !v->is_number() || !(v->get<double>() > 0))
      throw Error(where + " (" + t + ") needs a positive number '" + name + "', got " +
                  (v ? v->dump() : std::string("nothing")));
    return v->get<double>();
  };
  // original_max_position_embeddings, a position count: 0.5 was cut to 0 (refused later by the
  // rope op, without the file's name), and 1e300 converted to int64 is undefined.
  auto original_positions = [&](const std::string& hint) {
    const double orig = required("original_max_position_embeddings");
    if (orig != std::floor(orig) || orig > 1073741824.0)
      throw Error(where + " (" + t +
                  "): original_max_position_embeddings must be a whole number of positions from 1 "
                  "to 2^30, got " +
                  c.find({"original_max_position_embeddings"})->dump() + hint);
    return static_cast<int64_t>(orig);
  };
  if (t == "default") return s;
  if (t == "linear") {
    s.kind = Kind::kLinear;
    s.factor = required("factor");
  } else if (t == "llama3") {
    s.kind = Kind::kLlama3;
    s.factor = required("factor");
    s.low_freq_factor = required("low_freq_factor");
    s.high_freq_factor = required("high_freq_factor");
    s.original_max_position = original_positions(" (Llama 3.1's is 8192)");
    if (!(s.high_freq_factor > s.low_freq_factor))
      throw Error(where + " (llama3): high_freq_factor (" + std::to_string(s.high_freq_factor) +
                  ") must exceed low_freq_factor (" + std::to_string(s.low_freq_factor) + ")");
  } else if (t == "longrope" || t == "su" || (t == "yarn" && c.find({"short_factor"}))) {
    // ("su" and "yarn" with factor lists: Phi3Config's aliases, which it rewrites to longrope)
    // The factors per frequency; original_max_position and attention_factor come from the
    // model's fields (read_hf_config: Phi-3 keeps original_max_position_embeddings beside
    // max_position_embeddings).
    s.kind = Kind::kLongRope;
    for (const char* name : {"short_factor", "long_factor"}) {
      const json* v = c.find({name});
      std::vector<double>& out = name[0] == 's' ? s.short_factor : s.long_factor;
      if (v && v->is_array())
        for (const json& f : *v)
          if (f.is_number() && f.get<double>() > 0 && std::isfinite(f.get<double>()))
            out.push_back(f.get<double>());
      if (!v || !v->is_array() || out.size() != v->size() || out.empty())
        throw Error(where + " (longrope) needs '" + name +
                    "', a list of positive numbers (one per pair of a head's channels), got " +
                    (v ? v->dump() : std::string("nothing")));
    }
    if (const json* af = c.find({"attention_factor"})) {
      if (!af->is_number() || !(af->get<double>() > 0))
        throw Error(where + " (longrope): attention_factor must be a positive number, got " +
                    af->dump());
      s.attention_factor = af->get<double>();
    } else {
      s.attention_factor = 0;  // derived from the context lengths (read_hf_config)
    }
  } else if (t == "dynamic") {
    // HF's dynamic NTK: the RoPE base grows with a forward's length past max_position_embeddings
    // (ops::RopeScaling); within it, none.
    s.kind = Kind::kDynamic;
    s.factor = required("factor");
    s.original_max_position = max_positions;
  } else if (t == "yarn") {
    // As transformers' _compute_yarn_parameters: the file's factor; the original context
    // rope_scaling's original_max_position_embeddings (a top-level one wins: read_hf_config),
    // else max_position_embeddings. (transformers 4.50-4.55 made the factor
    // max_position_embeddings / original_max_position_embeddings when both were given; reverted.)
    s.kind = Kind::kYarn;
    s.factor = required("factor");
    s.original_max_position = max_positions;
    if (c.find({"original_max_position_embeddings"}))
      s.original_max_position = original_positions("");
    // (HF reads `get("beta_fast") or 32`: absent, null or 0 take the default)
    for (const auto& [name, out, dflt] : {std::tuple{"beta_fast", &s.beta_fast, 32.0},
                                          std::tuple{"beta_slow", &s.beta_slow, 1.0}}) {
      const json* v = c.find({name});
      if (v && !v->is_null() && !(v->is_number() && v->get<double>() >= 0))
        throw Error(where + " (yarn): " + name + " must be a positive number, got " + v->dump());
      *out = v && v->is_number() && v->get<double>() > 0 ? v->get<double>() : dflt;
    }
    s.truncate = c.boolean("truncate", true);
    auto optional = [&](const char* name) {
      const json* v = c.find({name});
      if (v && !v->is_null() &&
          !(v->is_number() && v->get<double>() > 0 && std::isfinite(v->get<double>())))
        throw Error(where + " (yarn): " + name + " must be a positive number, got " + v->dump());
      return v && v->is_number() ? v->get<double>() : 0.0;
    };
    s.attention_factor = optional("attention_factor");
    const double mscale = optional("mscale"), mscale_all_dim = optional("mscale_all_dim");
    if (s.attention_factor == 0)  // HF: from mscale and mscale_all_dim when both are given
      s.attention_factor =
          mscale > 0 && mscale_all_dim > 0
              ? yarn_mscale(s.factor, mscale) / yarn_mscale(s.factor, mscale_all_dim)
              : yarn_mscale(s.factor);
  } else {
    throw Error(where + " type '" + t +
                "' is not supported by keel's RoPE (it runs 'default', 'linear', 'dynamic', "
                "'llama3', 'yarn' and Phi-3's 'longrope'; Llama 3.1/3.2 checkpoints use "
                "'llama3')");
  }
  return s;
}

// HF's longrope attention factor where rope_scaling gives none: sqrt(1 + ln(s) / ln(original))
// for s = max_position_embeddings / original_max_position_embeddings above 1, else 1.
double longrope_attention_factor(int64_t max_positions, int64_t original) {
  const double scale = static_cast<double>(max_positions) / static_cast<double>(original);
  return scale <= 1.0 ? 1.0
                      : std::sqrt(1.0 + std::log(scale) / std::log(static_cast<double>(original)));
}

json rope_scaling_json(const ops::RopeScaling& s) {
  switch (s.kind) {
    case ops::RopeScaling::Kind::kNone:
      return nullptr;
    case ops::RopeScaling::Kind::kLinear:
      return {{"rope_type", "linear"}, {"factor", s.factor}};
    case ops::RopeScaling::Kind::kDynamic:  // (its original context: max_position_embeddings)
      return {{"rope_type", "dynamic"}, {"factor", s.factor}};
    case ops::RopeScaling::Kind::kLlama3:
      return {{"rope_type", "llama3"},
              {"factor", s.factor},
              {"low_freq_factor", s.low_freq_factor},
              {"high_freq_factor", s.high_freq_factor},
              {"original_max_position_embeddings", s.original_max_position}};
    case ops::RopeScaling::Kind::kYarn: {
      // The factor, original context and attention factor in effect.
      json j = {{"rope_type", "yarn"},
                {"factor", s.factor},
                {"original_max_position_embeddings", s.original_max_position},
                {"attention_factor", s.attention_factor},
                {"beta_fast", s.beta_fast},
                {"beta_slow", s.beta_slow}};
      if (!s.truncate) j["truncate"] = false;
      return j;
    }
    case ops::RopeScaling::Kind::kLongRope:
      // The three fields older Phi3Configs accept (they refuse any other); the attention factor
      // only when it is not the one the context lengths give (hf_config_json).
      return {
          {"type", "longrope"}, {"short_factor", s.short_factor}, {"long_factor", s.long_factor}};
  }
  return nullptr;
}

// The HF architectures keel reads: config.json's model_type, its architectures[0] class (and the
// headless class some files name), and keel's family. Gemma, Gemma-2, Gemma-3, Granite, Mistral,
// OLMo-2, Phi-3, Qwen2, Qwen3 and SmolLM3 are Llama's layers
// (ModelSpec::hf_model_type tells them apart).
struct HfArchitecture {
  const char* model_type;
  const char* hf_class;
  const char* headless_class;  // nullptr: none
  const char* family;
};
constexpr HfArchitecture kArchitectures[] = {
    {"gpt2", "GPT2LMHeadModel", "GPT2Model", "gpt2"},
    {"llama", "LlamaForCausalLM", "LlamaModel", "llama"},
    {"gemma", "GemmaForCausalLM", nullptr, "llama"},         // 1 + w norms, GeGLU, scaled embedding
    {"gemma2", "Gemma2ForCausalLM", nullptr, "llama"},       // and sandwich norms, soft caps
    {"gemma3_text", "Gemma3ForCausalLM", nullptr, "llama"},  // and q/k norms, local RoPE
    {"granite", "GraniteForCausalLM", nullptr, "llama"},     // and four multipliers
    {"mistral", "MistralForCausalLM", nullptr, "llama"},     // and a sliding window
    {"mixtral", "MixtralForCausalLM", nullptr, "llama"},     // Mistral's with 8 experts, 2 a token
    {"olmo2", "Olmo2ForCausalLM", nullptr, "llama"},         // post-norms, whole q/k norms
    {"olmo3", "Olmo3ForCausalLM", nullptr, "llama"},         // and 3 of 4 layers sliding
    {"olmoe", "OlmoeForCausalLM", nullptr, "llama"},         // whole q/k norms, 64 experts
    {"exaone4", "Exaone4ForCausalLM", nullptr, "llama"},     // OLMo-2's norms, NoPE full layers
    {"phi3", "Phi3ForCausalLM", nullptr, "llama"},           // fused qkv and gate_up, a window
    {"qwen2", "Qwen2ForCausalLM", nullptr, "llama"},         // and q/k/v biases
    {"qwen3", "Qwen3ForCausalLM", nullptr, "llama"},         // and q/k norms
    {"qwen3_moe", "Qwen3MoeForCausalLM", nullptr, "llama"},  // Qwen3's with 128 experts, 8 a token
    {"qwen2_moe", "Qwen2MoeForCausalLM", nullptr, "llama"},  // Qwen2's, 60 experts and a shared one
    {"smollm3", "SmolLM3ForCausalLM", nullptr, "llama"},     // and NoPE layers
    {"cohere", "CohereForCausalLM", nullptr, "llama"},       // parallel blocks, LayerNorms
    {"cohere2", "Cohere2ForCausalLM", nullptr, "llama"},     // and 3 of 4 sliding, NoPE full
    {"phi", "PhiForCausalLM", nullptr, "llama"},             // parallel blocks, biases, gelu MLP
    {"gpt_neox", "GPTNeoXForCausalLM", nullptr, "llama"},    // Phi's, per-head qkv, two norms
    {"stablelm", "StableLmForCausalLM", nullptr, "llama"},  // Llama's with LayerNorms, partial RoPE
    {"olmo", "OlmoForCausalLM", nullptr, "llama"},        // Llama's, LayerNorms without parameters
    {"glm", "GlmForCausalLM", nullptr, "llama"},          // q/k/v biases, pair RoPE on half a head
    {"glm4", "Glm4ForCausalLM", nullptr, "llama"},        // and norms after each sublayer
    {"falcon", "FalconForCausalLM", nullptr, "llama"},    // GPT-NeoX's, grouped qkv, no biases
    {"gptj", "GPTJForCausalLM", nullptr, "llama"},        // Phi's block, pair RoPE, GPT-2's names
    {"codegen", "CodeGenForCausalLM", nullptr, "llama"},  // GPT-J's, q/v/k in 4 blocks of heads
    {"starcoder2", "Starcoder2ForCausalLM", nullptr, "llama"},  // LayerNorms, biases, gelu MLP
    {"gpt_bigcode", "GPTBigCodeForCausalLM", nullptr, "gpt2"},  // GPT-2's, nn.Linear, multi_query
};

const HfArchitecture& architecture_of(const json& j, const std::string& file) {
  std::string mt;
  if (j.contains("model_type") && !j["model_type"].is_null()) {
    if (!j["model_type"].is_string())
      throw Error(file +
                  ": field 'model_type' must be a string such as \"gpt2\" or \"llama\", got " +
                  j["model_type"].dump());
    mt = j["model_type"].get<std::string>();
  }
  std::string arch;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  std::string known;
  for (const HfArchitecture& a : kArchitectures) {
    if (mt == a.model_type || arch == a.hf_class || (a.headless_class && arch == a.headless_class))
      return a;
    known += std::string(known.empty() ? "" : ", ") + a.hf_class + " (" + a.model_type + ")";
  }
  throw Error(file + ": unsupported model (model_type '" + mt + "', architecture '" + arch +
              "'); keel reads " + known);
}

// transformers 5 writes RoPE's fields as one object, rope_parameters ({rope_theta, rope_type and
// its scaling's fields, partial_rotary_factor}), or as one per layer type ({"full_attention": ...,
// "sliding_attention": ...}), where earlier files give rope_theta, rope_scaling,
// partial_rotary_factor and Gemma-3's rope_local_base_freq. Sets those fields of `j` from it, so
// that both forms read alike (a reader that skips rope_parameters trains at
// rope_theta's default: a Llama-3 at 10000 instead of 500000, without a word). Where a file gives
// both forms they must agree, and a RoPE per layer type that keel's layers do not run is refused;
// each Error names the field.
void legacy_rope_fields(json& j, const std::string& file, const std::string& mt) {
  const auto found = j.find("rope_parameters");
  if (found == j.end() || found->is_null()) return;
  const json& rp = *found;
  const std::string where = "rope_parameters";
  auto usage = [&](const std::string& m) { return Error(file + ": " + m, Error::kUsage); };
  if (!rp.is_object() || rp.empty())
    throw usage(where + " must be an object (rope_theta, rope_type, ...), got " + rp.dump());
  // Per layer type when any key names one; then every key must, with an object (a flat dict
  // with layer-type entries beside it says two things at once).
  bool nested = false;
  for (const auto& [key, value] : rp.items())
    nested = nested || key == "full_attention" || key == "sliding_attention";
  for (const auto& [key, value] : rp.items())
    if (nested && ((key != "full_attention" && key != "sliding_attention") || !value.is_object()))
      throw usage(where + " mixes entries per layer type with " + key + " = " + value.dump() +
                  "; give either {\"full_attention\": {...}, \"sliding_attention\": {...}} "
                  "or one RoPE for every layer");
  const char* full_key = !nested                         ? ""
                         : rp.contains("full_attention") ? "full_attention"
                                                         : "sliding_attention";
  const json& full = nested ? rp[full_key] : rp;
  const json* sliding =
      nested && rp.contains("sliding_attention") ? &rp["sliding_attention"] : nullptr;
  const std::string full_where = nested ? where + "." + full_key : where;

  auto type_of = [](const json& o) {
    for (const char* k : {"rope_type", "type"})
      if (o.contains(k) && o[k].is_string()) return o[k].get<std::string>();
    return std::string("default");
  };
  // rope_scaling's form of an entry: its scaling's fields alone, the type as rope_type.
  auto scaling_of = [&](const json& o) {
    json sc = o;
    for (const char* k : {"rope_theta", "partial_rotary_factor", "type"}) sc.erase(k);
    sc["rope_type"] = type_of(o);
    return sc;
  };
  auto field = [](const json& o, const char* k) { return o.contains(k) ? o[k] : json(); };
  // `key` of the older form takes `value` (given at `from`); one the file gives must agree.
  auto take = [&](const char* key, const json& value, const std::string& from) {
    if (j.contains(key) && !j[key].is_null() && j[key] != value)
      throw usage(std::string(key) + " = " + j[key].dump() + " and " + from + " = " + value.dump() +
                  " disagree; keep one (transformers 5 writes rope_parameters alone)");
    j[key] = value;
  };
  if (!field(full, "rope_theta").is_null())
    take("rope_theta", full["rope_theta"], full_where + ".rope_theta");
  const bool scaled = type_of(full) != "default";
  // (a rope_scaling that is no object is the older reader's to refuse)
  if (const json given = field(j, "rope_scaling");
      given.is_object() &&
      (scaled ? scaling_of(given) != scaling_of(full) : type_of(given) != "default"))
    throw usage("rope_scaling = " + given.dump() + " and " + full_where + " = " + full.dump() +
                " disagree; keep one (transformers 5 writes rope_parameters alone)");
  if (scaled) {
    // Read here first, so that a fault names rope_parameters (the reader names rope_scaling).
    const json* positions =
        j.contains("max_position_embeddings") ? &j["max_position_embeddings"] : nullptr;
    read_rope_scaling(
        scaling_of(full), file,
        positions && positions->is_number_integer() ? positions->get<int64_t>() : 2048, full_where);
    j["rope_scaling"] = scaling_of(full);
  }
  // Phi-3's longrope reads its original context beside max_position_embeddings, where
  // transformers 5 moves it into rope_parameters.
  if (const std::string t = type_of(full);
      (t == "longrope" || t == "su") && !field(full, "original_max_position_embeddings").is_null())
    take("original_max_position_embeddings", full["original_max_position_embeddings"],
         full_where + ".original_max_position_embeddings");
  if (!field(full, "partial_rotary_factor").is_null())
    take("partial_rotary_factor", full["partial_rotary_factor"],
         full_where + ".partial_rotary_factor");
  if (!sliding) return;

  // The sliding layers' entry: the full layers' (every layer rotates alike), or for a Gemma-3 a
  // default RoPE by a base of its own (rope_local_base_freq), for an OLMo-3 by rope_theta.
  const std::string sw = where + ".sliding_attention";
  if (const json t = field(*sliding, "rope_theta");
      !t.is_null() && !(t.is_number() && t.get<double>() > 0 && std::isfinite(t.get<double>())))
    throw usage(sw + ".rope_theta must be a positive number, got " + t.dump());
  if (field(*sliding, "partial_rotary_factor") != field(full, "partial_rotary_factor"))
    throw usage(sw + " turns another share of a head's channels (partial_rotary_factor) than " +
                full_where + "; keel turns one in every layer");
  const bool unscaled_local = models::ModelSpec::unscaled_local_rope(mt);
  if (scaling_of(*sliding) == scaling_of(full) &&
      field(*sliding, "rope_theta") == field(full, "rope_theta")) {
    if (unscaled_local && scaled)
      throw usage(sw + " scales the sliding layers (" + type_of(full) + "), which keel's " + mt +
                  " rotates without scaling (as its full layers' rope_scaling does not reach "
                  "them); give them {\"rope_type\": \"default\"}");
    if (mt == "gemma3_text" && !field(full, "rope_theta").is_null())
      take("rope_local_base_freq", full["rope_theta"], sw + ".rope_theta");
    return;
  }
  if (!unscaled_local || type_of(*sliding) != "default")
    throw usage(sw + " = " + sliding->dump() + " differs from " + full_where + " = " + full.dump() +
                "; keel's " + (mt.empty() ? std::string("model") : mt) +
                (unscaled_local ? " rotates its sliding layers by a default RoPE"
                                : " rotates every layer alike"));
  const json theta = field(*sliding, "rope_theta");
  if (mt == "gemma3_text") {
    if (!theta.is_null()) take("rope_local_base_freq", theta, sw + ".rope_theta");
  } else if (!theta.is_null() && theta != field(j, "rope_theta")) {
    throw usage(sw + ".rope_theta = " + theta.dump() + " differs from the full layers' " +
                field(j, "rope_theta").dump() +
                "; keel's olmo3 rotates its sliding layers by "
                "rope_theta");
  }
}

// A Gemma3ForConditionalGeneration's config.json (Gemma-3 4B, 12B, 27B: vision and text): its
// language model's, a Gemma3ForCausalLM's — text_config over Gemma3TextConfig's defaults (the
// published files list only the fields that differ), the file's dtype. Its weights are the
// language model's under "language_model." (or "model.language_model."): io/hf_weights.cpp.
json gemma3_language_model(const json& j, const std::string& file) {
  const auto text = j.find("text_config");
  if (text == j.end() || !text->is_object())
    throw Error(file +
                    ": a Gemma3ForConditionalGeneration needs a text_config object (its "
                    "language model's fields), got " +
                    (text == j.end() ? std::string("none") : text->dump()),
                Error::kUsage);
  json t = {{"vocab_size", 262208},
            {"hidden_size", 2304},
            {"intermediate_size", 9216},
            {"num_hidden_layers", 26},
            {"num_attention_heads", 8},
            {"num_key_value_heads", 4},
            {"head_dim", 256},
            {"hidden_activation", "gelu_pytorch_tanh"},
            {"max_position_embeddings", 131072},
            {"rms_norm_eps", 1e-6},
            {"rope_theta", 1e6},
            {"rope_local_base_freq", 10000.0},
            {"query_pre_attn_scalar", 256},
            {"sliding_window", 4096},
            {"sliding_window_pattern", 6},
            {"tie_word_embeddings", true}};
  if (text->contains("rope_parameters"))  // transformers 5's form gives the bases itself
    for (const char* k : {"rope_theta", "rope_local_base_freq"}) t.erase(k);
  t.update(*text);
  t["model_type"] = "gemma3_text";
  t["architectures"] = {"Gemma3ForCausalLM"};
  for (const char* key : {"torch_dtype", "dtype", "initializer_range"})
    if (j.contains(key) && !t.contains(key)) t[key] = j[key];
  return t;
}

// The entry of a spec's architecture (Llama's for "llama" and a spec from sizes).
const HfArchitecture& architecture_of(const models::ModelSpec& s) {
  for (const HfArchitecture& a : kArchitectures)
    if (s.architecture() == a.model_type) return a;
  return kArchitectures[1];
}

}  // namespace

json hf_config_json(const models::ModelSpec& s, DType dt, const json& base) {
  json j = base.is_object() ? base : json::object();
  // Which layers slide, one entry a layer (HF's layer_types).
  auto write_layer_types = [&] {
    json types = json::array();
    for (int64_t i = 0; i < s.n_layer; ++i)
      types.push_back(s.layer_window(i) > 0 ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  };
  // RoPE is written as rope_theta and rope_scaling (every transformers reads them; 5 converts
  // them): a base's transformers-5 rope_parameters would say it twice.
  j.erase("rope_parameters");
  const char* torch_dtype = dt == DType::BF16  ? "bfloat16"
                            : dt == DType::F16 ? "float16"
                                               : "float32";
  if (s.family == "gpt2") {
    j["architectures"] = {architecture_of(s).hf_class};
    j["model_type"] = architecture_of(s).model_type;
    j["activation_function"] = s.gpt_bigcode() ? "gelu_pytorch_tanh" : "gelu_new";
    if (s.gpt_bigcode()) j["multi_query"] = s.kv_heads() == 1;
    j["n_layer"] = s.n_layer;
    j["n_embd"] = s.n_embd;
    j["n_head"] = s.n_head;
    j["n_inner"] = s.intermediate_size > 0 ? json(s.intermediate_size) : json(nullptr);
    j["n_positions"] = s.max_seq_len;
    j["n_ctx"] = s.max_seq_len;
    j["vocab_size"] = s.vocab_size;
    j["layer_norm_epsilon"] = s.norm_eps;
    j["initializer_range"] = s.init_std;
    j["tie_word_embeddings"] = true;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    // The dropouts the run trained with (not a base's: HF's gpt2 says 0.1 each, which a run at
    // keel's 0 did not apply), so that HF, or keel from this directory, goes on as it trained.
    j["resid_pdrop"] = s.dropout;
    j["embd_pdrop"] = s.dropout;
    j["attn_pdrop"] = s.attention_dropout;
  } else {
    const std::string& variant = s.hf_model_type;
    j["architectures"] = {architecture_of(s).hf_class};
    j["model_type"] = architecture_of(s).model_type;
    if (variant == "mistral" || variant == "mixtral" || variant == "phi3" ||
        variant == "starcoder2")
      j["sliding_window"] = s.sliding_window > 0 ? json(s.sliding_window) : json();
    if (models::ModelSpec::is_moe_type(variant)) {  // as the configs read them (hf_config reading)
      j[variant == "mixtral" ? "num_local_experts" : "num_experts"] = s.moe.experts;
      j["num_experts_per_tok"] = s.moe.per_token;
      if (variant != "mixtral") j["norm_topk_prob"] = s.moe.normalize;
      if (variant == "qwen3_moe" || variant == "qwen2_moe") {
        j["moe_intermediate_size"] = s.moe.ffn;
        j["decoder_sparse_step"] = s.moe.sparse_step;
        j["mlp_only_layers"] = s.moe.dense_layers;
      }
      if (variant == "qwen2_moe") j["shared_expert_intermediate_size"] = s.moe.shared_ffn;
      // The load-balancing loss this model trained with (HF's training adds it as keel's did).
      j["output_router_logits"] = s.moe.aux_coef > 0;
      if (s.moe.aux_coef > 0) j["router_aux_loss_coef"] = s.moe.aux_coef;
    }
    if (s.gemma()) {
      j["hidden_activation"] = "gelu_pytorch_tanh";
      if (s.sandwich_norms()) {  // Gemma-2 and Gemma-3
        j["sliding_window"] = s.sliding_window;
        j["query_pre_attn_scalar"] = s.query_pre_attn_scalar > 0
                                         ? s.query_pre_attn_scalar
                                         : static_cast<double>(s.head_dim());
        j["attn_logit_softcapping"] = s.attn_softcap > 0 ? json(s.attn_softcap) : json();
        j["final_logit_softcapping"] = s.final_softcap > 0 ? json(s.final_softcap) : json();
        // Gemma-2's is HF's default (every other layer from the first); Gemma-3's written out,
        // and as sliding_window_pattern for the transformers that read only that.
        j.erase("layer_types");
        if (variant == "gemma3_text") {
          write_layer_types();
          j["sliding_window_pattern"] = s.sliding_period;
          j["rope_local_base_freq"] = s.rope_local_theta;
        }
      }
    }
    if (variant == "olmo3") {  // its window, and which layers slide (Olmo3Config's layer_types)
      j["sliding_window"] = s.sliding_window > 0 ? json(s.sliding_window) : json();
      write_layer_types();
    }
    // Its window, and which layers slide (as Exaone4Config and Cohere2Config read them).
    if (variant == "exaone4" || variant == "cohere2") {
      j["sliding_window"] = s.sliding_window > 0 ? json(s.sliding_window) : json();
      j["sliding_window_pattern"] =
          s.sliding_window > 0 && s.sliding_period > 0 ? json(s.sliding_period) : json();
      write_layer_types();
    }
    if (variant == "granite") {
      j["embedding_multiplier"] = s.embedding_multiplier;
      j["residual_multiplier"] = s.residual_multiplier;
      j["attention_multiplier"] = s.attention_scale();
      j["logits_scaling"] = s.logits_scaling;
    }
    if (variant == "smollm3") {  // which layers rotate, listed as SmolLM3Config reads them
      json rotates = json::array();
      for (int64_t i = 0; i < s.n_layer; ++i) rotates.push_back(s.layer_rotates(i) ? 1 : 0);
      j["no_rope_layers"] = rotates;
      j["no_rope_layer_interval"] = s.nope_period > 0 ? s.nope_period : 4;
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
    }
    if (variant == "qwen2" || variant == "qwen3" || variant == "qwen3_moe" ||
        variant == "qwen2_moe") {
      j["use_sliding_window"] = s.sliding_window > 0;
      if (s.sliding_window > 0) {
        j["sliding_window"] = s.sliding_window;
        j["max_window_layers"] = s.sliding_from_layer;
      }
    }
    j["hidden_act"] = s.gemma()                             ? "gelu_pytorch_tanh"
                      : !s.gelu_mlp()                       ? "silu"
                      : s.mlp_gelu == ops::GeluApprox::None ? "gelu"
                                                            : "gelu_new";
    j["num_hidden_layers"] = s.n_layer;
    j["hidden_size"] = s.n_embd;
    j["num_attention_heads"] = s.n_head;
    j["num_key_value_heads"] = s.kv_heads();
    j["head_dim"] = s.head_dim();
    // (OLMoE's and Mixtral's is their experts' width; Qwen3-MoE's its dense layers')
    j["intermediate_size"] =
        s.moe.experts > 0 && s.hf_model_type != "qwen3_moe" && s.hf_model_type != "qwen2_moe"
            ? s.moe.ffn
            : s.ffn_dim();
    j["vocab_size"] = s.vocab_size;
    j["max_position_embeddings"] = s.max_seq_len;
    j[s.centered_norms() ? "layer_norm_eps" : "rms_norm_eps"] = s.norm_eps;
    if (s.cohere()) {
      j["logit_scale"] = s.logit_scale;
      if (variant == "cohere") j["use_qk_norm"] = s.qk_layernorm;  // (Cohere2Config has none)
    }
    j["rope_theta"] = s.rope_theta;
    j["rope_scaling"] = rope_scaling_json(s.rope_scaling);
    if (s.rope_scaling.kind == ops::RopeScaling::Kind::kLongRope) {
      j["original_max_position_embeddings"] = s.rope_scaling.original_max_position;
      if (s.rope_scaling.attention_factor !=
          longrope_attention_factor(s.max_seq_len, s.rope_scaling.original_max_position))
        j["rope_scaling"]["attention_factor"] = s.rope_scaling.attention_factor;
    }
    // (PhiConfig's default is 0.5, StableLmConfig's 0.25: written whatever it is. GPTNeoXConfig
    // reads rotary_pct and rotary_emb_base.)
    if (s.partial_rotary_factor != 1 || s.phi() || s.stablelm() || s.glm())
      j["partial_rotary_factor"] = s.partial_rotary_factor;
    if (s.gpt_neox()) {
      j["rotary_pct"] = s.partial_rotary_factor;
      j["rotary_emb_base"] = s.rope_theta;
    }
    if (s.gpt_neox() || s.stablelm()) j["use_parallel_residual"] = s.parallel_residual;
    if (s.phi() || s.stablelm()) j["qk_layernorm"] = s.qk_layernorm;
    if (s.olmo() || variant == "olmoe")
      j["clip_qkv"] = s.clip_qkv > 0 ? json(s.clip_qkv) : json(nullptr);
    // The sublayer dropout the run trained with, as GPT-2's (a base's embd_pdrop stays its own).
    if (const char* field = s.branch_dropout_field()) j[field] = s.dropout;
    if (s.stablelm()) j["use_qkv_bias"] = s.attention_bias;
    if (variant == "olmo3") {
      // And per layer type, as transformers 5's Olmo3Config reads it: from the older fields alone
      // it rotates the sliding layers by its default base 500000, whatever rope_theta says.
      json full = s.rope_scaling.kind == ops::RopeScaling::Kind::kNone
                      ? json{{"rope_type", "default"}}
                      : rope_scaling_json(s.rope_scaling);
      full["rope_theta"] = s.rope_theta;
      j["rope_parameters"] = {
          {"full_attention", full},
          {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", s.rope_theta}}}};
    }
    j["tie_word_embeddings"] = s.tie_embeddings;
    // (Qwen2's q/k/v biases are its architecture's, and Phi3Config has neither key.)
    // (GPT-NeoX's attention_bias is its own; PhiConfig has neither key: its biases are its
    // architecture's.)
    if (s.gpt_neox() || s.glm()) {
      j["attention_bias"] = s.attention_bias;
    } else if (variant != "qwen2" && variant != "qwen2_moe" && variant != "phi3" && !s.phi() &&
               !s.stablelm()) {
      j["attention_bias"] = false;
      j["mlp_bias"] = false;
    }
    j["initializer_range"] = s.init_std;
    // (As GPT-2's. A Phi-3's resid_pdrop and embd_pdrop, which keel does not apply, stay the
    // base's.)
    j["attention_dropout"] = s.attention_dropout;
    if (s.falcon()) {
      // FalconConfig's own fields in place of Llama's (its head_dim is a property, which a key
      // of that name would fail to set).
      for (const char* k : {"head_dim", "num_key_value_heads", "intermediate_size", "hidden_act",
                            "layer_norm_eps", "attention_bias", "mlp_bias"})
        j.erase(k);
      j["new_decoder_architecture"] = s.new_decoder_architecture;
      j["num_kv_heads"] = s.kv_heads();
      j["multi_query"] = s.kv_heads() == 1;  // (read only without new_decoder_architecture)
      j["parallel_attn"] = s.parallel_residual;
      j["num_ln_in_parallel_attn"] =
          s.new_decoder_architecture ? json(s.norm_per_branch ? 2 : 1) : json(nullptr);
      j["ffn_hidden_size"] = s.ffn_dim();
      j["activation"] = s.mlp_gelu == ops::GeluApprox::None ? "gelu" : "gelu_new";
      j["layer_norm_epsilon"] = s.norm_eps;
      j["bias"] = false;
      j["alibi"] = false;
    }
    if (s.starcoder2()) {  // Starcoder2Config's names
      for (const char* k : {"layer_norm_eps", "attention_bias", "mlp_bias"}) j.erase(k);
      j["norm_epsilon"] = s.norm_eps;
      j["use_bias"] = s.attention_bias;
      j["hidden_act"] = s.mlp_gelu == ops::GeluApprox::None ? "gelu" : "gelu_pytorch_tanh";
      j["embedding_dropout"] = s.dropout;  // (residual_dropout above: one key, model.dropout)
    }
    if (s.gptj()) {
      // GPTJConfig's own names (its attribute_map reads hidden_size as n_embd, and so on) and
      // fields; RoPE's base is its architecture's.
      for (const char* k :
           {"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "max_position_embeddings", "hidden_act",
            "layer_norm_eps", "rope_theta", "rope_scaling", "partial_rotary_factor",
            "attention_bias", "mlp_bias", "attention_dropout"})
        j.erase(k);
      j["n_layer"] = s.n_layer;
      j["n_embd"] = s.n_embd;
      j["n_head"] = s.n_head;
      j["n_positions"] = s.max_seq_len;
      if (s.codegen()) j["n_ctx"] = s.max_seq_len;  // (CodeGenConfig's, which nothing reads)
      j["n_inner"] = s.ffn_dim();
      j["rotary_dim"] = s.rotary_dim();
      j["activation_function"] = s.mlp_gelu == ops::GeluApprox::None ? "gelu" : "gelu_new";
      j["layer_norm_epsilon"] = s.norm_eps;
      j["embd_pdrop"] = s.dropout;  // (resid_pdrop above: one key, model.dropout)
      j["attn_pdrop"] = s.attention_dropout;
    }
  }
  j["torch_dtype"] = torch_dtype;
  return j;
}
namespace {
constexpr int64_t kMaxSize = std::numeric_limits<int64_t>::max();

// GPT-J's rotary_dim: the first channels of each head RoPE turns (GPT-J-6B's 64 of 256), as the
// share partial_rotary_factor of the head (its width known). HF's GPTJAttention turns the whole
// embedding's width when it is null, which no head holds: refused, as are a width past the head
// and an odd one, naming the field.
void read_gptj_rotary_dim(const ConfigReader& c, models::ModelSpec& s) {
  if (s.n_head < 1 || s.n_embd < 1) return;  // (the sizes' own check names them)
  if (c.j.contains("rotary_dim") && c.j["rotary_dim"].is_null())
    throw Error(c.file + ": rotary_dim = null is not supported by keel's " + s.architecture() +
                    " model (HF's GPT-J then "
                    "turns hidden_size channels of each head); give the channels RoPE turns",
                Error::kUsage);
  const int64_t d = s.head_dim(), r = c.integer({"rotary_dim"}, 64);  // (GPTJConfig's default)
  if (r < 2 || r % 2 || r > d)
    throw Error(c.file + ": rotary_dim = " + std::to_string(r) +
                    " must be an even number of channels from 2 to a head's " + std::to_string(d) +
                    " (RoPE turns pairs of a head's channels)",
                Error::kUsage);
  // The share whose int(d * share) is r (r / d may round below it).
  double share = static_cast<double>(r) / static_cast<double>(d);
  while (s.partial_rotary_factor = share, s.rotary_dim() < r) share = std::nextafter(share, 2.0);
}

// FalconConfig's layout fields (model_type "falcon"): its key/value heads
// (new_decoder_architecture's num_kv_heads; else multi_query's one, or one a query head), its MLP's
// width (ffn_hidden_size, 4 x hidden_size where absent), whether the attention and the MLP run side
// by side (parallel_attn) and on one norm or two (num_ln_in_parallel_attn: 2 where absent under
// new_decoder_architecture); each layout HF's FalconDecoderLayer cannot run, and Falcon-RW's ALiBi
// and biases, refused naming the field.
template <typename Unsupported>
void read_falcon_layout(const ConfigReader& c, models::ModelSpec& s,
                        const Unsupported& unsupported) {
  if (c.boolean("alibi", false))
    throw unsupported("alibi = true (Falcon-RW's ALiBi position biases in place of RoPE)");
  // (HF's FalconLinear adds a bias after the product, in f32 beside a bf16 product under autocast:
  // no published rotary Falcon has one.)
  if (c.boolean("bias", false)) throw unsupported("bias = true (Falcon-RW's biased projections)");
  s.new_decoder_architecture = c.boolean("new_decoder_architecture", false);
  s.parallel_residual = c.boolean("parallel_attn", true);
  const bool multi_query = c.boolean("multi_query", true);
  s.n_kv_head = s.new_decoder_architecture ? c.integer({"num_kv_heads"}, s.n_head)
                : multi_query              ? 1
                                           : s.n_head;
  if (s.new_decoder_architecture && !s.parallel_residual)
    throw unsupported(
        "parallel_attn = false with new_decoder_architecture = true (HF's FalconDecoderLayer "
        "then has no input for its MLP)");
  const int64_t norms = c.integer({"num_ln_in_parallel_attn"}, s.new_decoder_architecture ? 2 : 1);
  if (norms != 1 && norms != 2)
    throw unsupported("num_ln_in_parallel_attn = " + std::to_string(norms) +
                      " (a parallel block's norms: 1, or 2 under new_decoder_architecture)");
  if (norms == 2 && s.parallel_residual && !s.new_decoder_architecture)
    throw unsupported(
        "num_ln_in_parallel_attn = 2 without new_decoder_architecture (HF's FalconDecoderLayer "
        "then builds ln_attn and ln_mlp but runs input_layernorm)");
  s.norm_per_branch = s.new_decoder_architecture && norms == 2;
  s.intermediate_size =
      c.integer({"ffn_hidden_size"}, s.n_embd <= kMaxSize / 4 ? 4 * s.n_embd : kMaxSize);
}
}  // namespace

HfConfig read_hf_config(const std::string& dir) {
  const std::string file = dir + "/config.json";
  if (!path_exists(file)) {
    // A run's out_dir is what generate, eval and export take: say where its model is.
    const std::string last = dir + "/checkpoints/last";
    throw Error(dir + ": no config.json (model.path must be a Hugging Face model directory" +
                (path_exists(last + "/config.json")
                     ? "; this is a keel run's out_dir, whose model is " + last
                     : std::string()) +
                ")");
  }
  HfConfig out;
  out.json = read_json(file);
  if (!out.json.is_object()) throw Error(file + ": expected a JSON object");
  if (out.json.value("model_type", json()) == "gemma3" ||
      out.json.value("architectures", json::array()) ==
          json::array({"Gemma3ForConditionalGeneration"}))
    out.json = gemma3_language_model(out.json, file);
  const HfArchitecture& arch = architecture_of(out.json, file);
  legacy_rope_fields(out.json, file, arch.model_type);
  const json& j = out.json;
  ConfigReader c{j, file};
  models::ModelSpec& s = out.spec;
  s.family = arch.family;
  if ((s.family == "llama" && std::string(arch.model_type) != "llama") ||
      std::string(arch.model_type) == "gpt_bigcode")
    s.hf_model_type = arch.model_type;
  auto unsupported = [&](const std::string& what) {  // the user's file: a usage error (exit 2)
    return Error(file + ": " + what + " is not supported by keel's " + s.architecture() + " model",
                 Error::kUsage);
  };
  // A dropout probability the file trains with (HF's); keel's runs take model.dropout and
  // model.attention_dropout instead, saying where they differ (train/run.cpp), and write theirs
  // back (hf_config_json).
  auto probability = [&](const char* key, double def) {
    const double p = c.number({key}, def);
    if (!(p >= 0 && p < 1))
      throw Error(file + ": field '" + key + "' must be a dropout probability in [0, 1), got " +
                      c.find({key})->dump(),
                  Error::kUsage);
    return p;
  };
  if (s.family == "gpt2") {
    // (GPT2Config's defaults: 0.1 each. keel has one key for the residual and embedding
    // dropouts: resid_pdrop's.)
    s.dropout = probability("resid_pdrop", 0.1);
    probability("embd_pdrop", 0.1);
    s.attention_dropout = probability("attn_pdrop", 0.1);
    s.n_layer = c.integer({"n_layer", "num_hidden_layers"});
    s.n_embd = c.integer({"n_embd", "hidden_size"});
    s.n_head = c.integer({"n_head", "num_attention_heads"});
    s.intermediate_size = c.integer({"n_inner", "intermediate_size"}, 0);
    s.vocab_size = c.integer({"vocab_size"});
    s.max_seq_len = c.integer({"n_positions", "n_ctx", "max_position_embeddings"});
    s.norm_eps = c.number({"layer_norm_epsilon"}, 1e-5);
    s.tie_embeddings = true;
    if (!c.boolean("tie_word_embeddings", true))
      throw unsupported("tie_word_embeddings = false (GPT-2's lm_head is tied to wte)");
    // GPT-BigCode's multi_query (GPTBigCodeConfig's default): one key/value head.
    if (s.gpt_bigcode() && c.boolean("multi_query", true)) s.n_kv_head = 1;
    const std::string act =
        c.string("activation_function", s.gpt_bigcode() ? "gelu_pytorch_tanh" : "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      throw unsupported("activation_function '" + act + "' (keel's GPT-2 uses gelu_new)");
    if (c.boolean("scale_attn_by_inverse_layer_idx", false))
      throw unsupported("scale_attn_by_inverse_layer_idx = true");
    if (!c.boolean("scale_attn_weights", true)) throw unsupported("scale_attn_weights = false");
    if (c.boolean("reorder_and_upcast_attn", false))
      throw unsupported("reorder_and_upcast_attn = true");
  } else {
    s.attention_dropout = probability(s.gptj() ? "attn_pdrop" : "attention_dropout", 0.0);
    // The sublayer dropout of Phi (resid_pdrop; its embd_pdrop is not keel's), GPT-NeoX and
    // StableLM (hidden_dropout): ModelSpec::branch_dropout. (Their configs' defaults: 0.)
    if (const char* field = s.branch_dropout_field()) s.dropout = probability(field, 0.0);
    // (GPT-J's embd_pdrop and StarCoder2's embedding_dropout drop the embedding's output:
    // model.dropout's too, as GPT-2's.)
    if (s.phi() || s.gptj()) probability("embd_pdrop", 0.0);
    if (s.starcoder2()) probability("embedding_dropout", 0.0);
    s.n_layer = c.integer({"num_hidden_layers", "n_layer"});
    s.n_embd = c.integer({"hidden_size", "n_embd", "n_embed"});  // (FalconConfig's n_embed)
    s.n_head = c.integer({"num_attention_heads", "n_head"});
    if (s.falcon()) {
      read_falcon_layout(c, s, unsupported);
      // (A parallel Falcon applies its attention_dropout nowhere, as HF's.)
      if (s.parallel_residual) s.attention_dropout = 0;
    } else {
      s.n_kv_head = c.integer({"num_key_value_heads"}, s.n_head);
      // (GPT-J's n_inner: 4 x n_embd where absent or null)
      s.intermediate_size =
          s.gptj() ? c.integer({"n_inner"}, s.n_embd <= kMaxSize / 4 ? 4 * s.n_embd : kMaxSize)
                   : c.integer({"intermediate_size"});
    }
    s.vocab_size = c.integer({"vocab_size"});
    s.max_seq_len = c.integer({"max_position_embeddings", "n_positions"}, 2048);
    // (Gemma3TextConfig's default base is 1e6, SmolLM3Config's 2e6; their files give it.
    // GPTNeoXConfig's is rotary_emb_base, which transformers 5 writes as rope_theta.)
    // (GPT-J's is 10000, which its files do not give.)
    s.rope_theta = s.gptj() ? 10000.0
                   : s.gpt_neox()
                       ? c.number({"rotary_emb_base", "rope_theta"}, 10000.0)
                       : c.number({"rope_theta"}, s.hf_model_type == "gemma3_text" ? 1e6
                                                  : s.hf_model_type == "smollm3"   ? 2e6
                                                                                   : 10000.0);
    // (Olmo2Config's and Olmo3Config's default eps is 1e-5; their files give it. Cohere's, Phi's
    // and GPT-NeoX's LayerNorms take layer_norm_eps, 1e-5 in their configs.)
    // (HF's OlmoLayerNorm takes 1e-5 whatever a file says.)
    s.norm_eps = s.olmo()                 ? 1e-5
                 : s.falcon() || s.gptj() ? c.number({"layer_norm_epsilon"}, 1e-5)
                 : s.starcoder2()         ? c.number({"norm_epsilon"}, 1e-5)
                 : s.centered_norms()     ? c.number({"layer_norm_eps"}, 1e-5)
                                          : c.number({"rms_norm_eps"}, s.post_norms() ? 1e-5
                                                                       : s.glm()      ? 1.5625e-7
                                                                                      : 1e-6);
    // (Gemma, SmolLM3 and Cohere tie their head to the embedding unless the file says otherwise,
    // as their configs do.)
    // (Falcon's and StarCoder2's too: their configs keep PretrainedConfig's default.)
    s.tie_embeddings =
        c.boolean("tie_word_embeddings", s.gemma() || s.hf_model_type == "smollm3" || s.cohere() ||
                                             s.falcon() || s.starcoder2());
    if (s.cohere()) {
      // CohereForCausalLM: the logits times logit_scale (CohereConfig's 0.0625 where absent).
      s.logit_scale = c.number({"logit_scale"}, 0.0625);
      if (!(std::isfinite(s.logit_scale) && s.logit_scale > 0))
        throw Error(file + ": logit_scale = " + c.find({"logit_scale"})->dump() +
                        " must be a number > 0 (Command-R's 0.0625)",
                    Error::kUsage);
      // Command-R+'s LayerNorm over each head's query and key (weights [heads, head_dim];
      // Cohere2Config has no such field).
      if (s.hf_model_type == "cohere") s.qk_layernorm = c.boolean("use_qk_norm", false);
    }
    // OLMo's and OLMoE's clamp of the q/k/v projections (OLMo-1.7's 8; null: none).
    if (s.olmo() || s.hf_model_type == "olmoe") {
      s.clip_qkv = c.number({"clip_qkv"}, 0.0);
      if (!(s.clip_qkv > 0 && std::isfinite(s.clip_qkv)) && c.find({"clip_qkv"}))
        throw Error(file + ": clip_qkv = " + c.find({"clip_qkv"})->dump() +
                        " must be a positive bound (OLMo-1.7's 8), or null for none",
                    Error::kUsage);
    }
    if (s.glm()) s.attention_bias = c.boolean("attention_bias", true);  // (GlmConfig's default)
    if (s.stablelm()) {
      // StableLmConfig's defaults: no q/k/v biases, the branches in sequence (StableLM-2-1.6B's
      // file sets use_qkv_bias, the 12B's use_parallel_residual and qk_layernorm).
      s.attention_bias = c.boolean("use_qkv_bias", false);
      s.parallel_residual = c.boolean("use_parallel_residual", false);
      // (StableLM-2-12B's LayerNorms over each head's query and key, one per head)
      s.qk_layernorm = c.boolean("qk_layernorm", false);
    }
    if (s.gelu_mlp()) {
      // Phi and GPT-NeoX: lm_head (embed_out) is a Linear of its own (HF's Phi would tie its
      // weight and keep its bias; no published Phi or GPT-NeoX ties it).
      if (s.tie_embeddings && (s.phi() || s.gpt_neox() || s.gptj()))
        throw unsupported("tie_word_embeddings = true");
      // Their MLP's activation: PhiConfig's gelu_new, GPTNeoXConfig's and FalconConfig's gelu
      // (the exact form: Pythia, Falcon); GPT-NeoX-20B's gelu_fast is the tanh form written
      // another way.
      const char* act_key = s.falcon() ? "activation"
                            : s.gptj() ? "activation_function"
                                       : "hidden_act";
      const std::string act = c.string(act_key, s.phi() || s.gptj() ? "gelu_new"
                                                : s.starcoder2()    ? "gelu_pytorch_tanh"
                                                                    : "gelu");
      if (act == "gelu")
        s.mlp_gelu = ops::GeluApprox::None;
      else if (act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast")
        s.mlp_gelu = ops::GeluApprox::Tanh;
      else
        throw unsupported(std::string(act_key) + " '" + act + "' (keel's " + s.architecture() +
                          " MLP takes gelu, or its tanh form gelu_new)");
      // (Phi's one LayerNorm over every head's query, one over every key)
      if (s.phi()) s.qk_layernorm = c.boolean("qk_layernorm", false);
      if (s.gpt_neox()) {
        s.parallel_residual = c.boolean("use_parallel_residual", true);
        s.attention_bias = c.boolean("attention_bias", true);
      }
      // (StarCoder2's use_bias: on q, k, v, o_proj, c_fc and c_proj; Starcoder2Config's default)
      if (s.starcoder2()) s.attention_bias = c.boolean("use_bias", true);
    } else if (s.gemma()) {
      // HF's Gemma MLP: ACT2FN[hidden_activation], gelu_pytorch_tanh when absent (Gemma-1's
      // files that name only hidden_act "gelu" run it so too, with a warning).
      const std::string act = c.string("hidden_activation", "gelu_pytorch_tanh");
      if (act != "gelu_pytorch_tanh" && act != "gelu_new")
        throw unsupported("hidden_activation '" + act +
                          "' (keel's Gemma MLP is GeGLU with the tanh gelu, gelu_pytorch_tanh)");
    } else if (const std::string act = c.string("hidden_act", "silu"); act != "silu") {
      throw unsupported("hidden_act '" + act + "' (keel's Llama MLP is SwiGLU)");
    }
    if (!s.gpt_neox() && !s.glm() && c.boolean("attention_bias", false))
      throw unsupported("attention_bias = true");
    if (c.boolean("mlp_bias", false)) throw unsupported("mlp_bias = true");
    // (GPTJAttention reads no rope_scaling.)
    if (const json* rs = c.find({"rope_scaling"}); rs && !s.gptj())
      s.rope_scaling = read_rope_scaling(*rs, file, s.max_seq_len);
    const std::string& variant = s.hf_model_type;
    // HF's layer_types, one "full_attention" or "sliding_attention" a layer: which layers slide
    // (none when the file has no list); then whether the spec's layout (`layout`, for the
    // message) slides those. Either mismatch is refused naming the field.
    auto sliding_layers = [&](const std::string& layout) -> std::optional<std::vector<bool>> {
      const json* types = c.find({"layer_types"});
      if (!types) return std::nullopt;
      std::vector<bool> slides;
      if (types->is_array())
        for (const json& t : *types)
          if (t == "sliding_attention" || t == "full_attention")
            slides.push_back(t == "sliding_attention");
      if (!types->is_array() || slides.size() != types->size() || std::ssize(slides) != s.n_layer)
        throw unsupported("layer_types " + types->dump() + " (" + layout + ")");
      return slides;
    };
    auto expect_layout = [&](const std::vector<bool>& slides, const std::string& layout) {
      for (int64_t i = 0; i < s.n_layer; ++i)
        if (slides[static_cast<size_t>(i)] != (s.layer_window(i) > 0))
          throw unsupported("layer_types " + c.find({"layer_types"})->dump() + " (" + layout + ")");
    };
    // All but every Nth layer sliding: N from layer_types, when the file lists them (its first
    // full layer's index + 1; 0: all slide), which must then follow that period. Returns whether
    // it lists them.
    auto listed_sliding_period = [&](const std::string& layout) {
      const auto slides = sliding_layers(layout);
      if (!slides) return false;
      const auto full = std::find(slides->begin(), slides->end(), false);
      s.sliding_period = full == slides->end() ? 0 : full - slides->begin() + 1;
      expect_layout(*slides, layout);
      return true;
    };
    if ((variant == "qwen2" || variant == "qwen3" || variant == "qwen3_moe" ||
         variant == "qwen2_moe") &&
        c.boolean("use_sliding_window", false)) {
      // Qwen2's (and Qwen3's) sliding window is off unless use_sliding_window says so, then for
      // the layers from max_window_layers on (HF's Qwen2Config: its default 28), or those
      // layer_types names "sliding_attention".
      s.sliding_window = c.integer({"sliding_window"});
      if (s.sliding_window < 1)
        throw Error(file + ": use_sliding_window = true needs a sliding_window >= 1, got " +
                        std::to_string(s.sliding_window),
                    Error::kUsage);
      s.sliding_from_layer = c.integer({"max_window_layers"}, 28);
      const std::string layout =
          "keel slides the layers from max_window_layers on: \"full_attention\" layers, then "
          "\"sliding_attention\" ones, one per num_hidden_layers";
      if (const auto slides = sliding_layers(layout)) {  // from the first sliding one on
        s.sliding_from_layer = std::find(slides->begin(), slides->end(), true) - slides->begin();
        expect_layout(*slides, layout);
      }
    }
    if (variant == "mistral" || variant == "mixtral" || variant == "phi3" ||
        variant == "starcoder2") {
      // Mistral-7B-v0.1 slides over 4096 of its 32768 positions, v0.2 and later over none;
      // StarCoder2's every layer over 4096;
      // Phi-3-mini-4k over 2047 of 4096 (HF's sliding-window mask, as Mistral's), Phi-4 none.
      s.sliding_window = c.integer({"sliding_window"}, 0);  // null: none
    }
    if (s.rope_scaling.kind == ops::RopeScaling::Kind::kLongRope) {
      // Phi-3-*-128k and Phi-3.5-mini: the factors switch past original_max_position_embeddings
      // (Phi3Config's field, 4096 when absent), whose ratio to max_position_embeddings gives the
      // attention factor where rope_scaling has none.
      if (variant != "phi3")
        throw unsupported("rope_scaling type 'longrope' (keel runs it for Phi-3)");
      ops::RopeScaling& r = s.rope_scaling;
      r.original_max_position = c.integer({"original_max_position_embeddings"}, 4096);
      if (r.original_max_position < 2)
        throw Error(file + ": original_max_position_embeddings must be at least 2, got " +
                        std::to_string(r.original_max_position),
                    Error::kUsage);
      if (r.attention_factor == 0)
        r.attention_factor = longrope_attention_factor(s.max_seq_len, r.original_max_position);
    }
    // YaRN's original context: a top-level original_max_position_embeddings wins over
    // rope_scaling's, as transformers' standardize_rope_params gives it priority.
    if (s.rope_scaling.kind == ops::RopeScaling::Kind::kYarn &&
        c.find({"original_max_position_embeddings"})) {
      s.rope_scaling.original_max_position = c.integer({"original_max_position_embeddings"});
      if (s.rope_scaling.original_max_position < 1)
        throw Error(file + ": original_max_position_embeddings must be at least 1, got " +
                        std::to_string(s.rope_scaling.original_max_position),
                    Error::kUsage);
    }
    if (s.sandwich_norms() && s.gemma()) {
      // Gemma-2: every other layer slides, from the first (HF's Gemma2: layer_types' default, or
      // is_sliding = not layer_idx % 2). Gemma-3: five of every six (sliding_window_pattern 6),
      // the sliding ones rotating by rope_local_base_freq. Scores and logits soft-capped where
      // the file says; the attention scaled by query_pre_attn_scalar^-1/2.
      const bool gemma3 = variant == "gemma3_text";
      s.sliding_window = c.integer({"sliding_window"}, 4096);
      s.sliding_period = gemma3 ? c.integer({"sliding_window_pattern"}, 6) : 2;
      if (gemma3) s.rope_local_theta = c.number({"rope_local_base_freq"}, 10000.0);
      const std::string layout =
          "keel's " + variant + " slides " +
          (gemma3 ? "all layers but every Nth, \"sliding_attention\" N - 1 times, then "
                    "\"full_attention\""
                  : "every other layer from the first: \"sliding_attention\", "
                    "\"full_attention\", ...");
      if (listed_sliding_period(layout) && !gemma3 && s.sliding_period != 2)
        throw unsupported("layer_types " + c.find({"layer_types"})->dump() + " (" + layout + ")");
      if (gemma3 && (!(s.rope_local_theta > 0) || !std::isfinite(s.rope_local_theta)))
        throw Error(file + ": rope_local_base_freq must be a positive number, got " +
                        c.find({"rope_local_base_freq"})->dump(),
                    Error::kUsage);
      // Absent, Gemma2Config's caps (50 and 30); null, none (Gemma-3's).
      auto cap = [&](const char* field, double gemma2_default) {
        if (!j.contains(field)) return gemma3 ? 0.0 : gemma2_default;
        return c.number({field}, 0);
      };
      s.attn_softcap = cap("attn_logit_softcapping", 50);
      s.final_softcap = cap("final_logit_softcapping", 30);
      s.query_pre_attn_scalar = c.number({"query_pre_attn_scalar"}, 256);
      for (const char* field :
           {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"})
        if (const json* v = c.find({field}); v && !(v->get<double>() > 0))
          throw Error(
              file + ": " + field + " must be a positive number (or null: none), got " + v->dump(),
              Error::kUsage);
    }
    if (s.post_norms() && c.boolean("use_sinks", false))
      throw unsupported("use_sinks = true (attention sinks)");
    if (variant == "olmo3") {
      // OLMo-3: three of every four layers slide (Olmo3Config's layer_types default) over the
      // last sliding_window positions (4096), rotating without rope_scaling
      // (ModelSpec::unscaled_local_rope: as OLMo-core trained them). A null window is refused:
      // transformers' Olmo3 cannot run one (its sliding mask needs the size).
      if (j.contains("sliding_window") && j["sliding_window"].is_null())
        throw unsupported(
            "sliding_window = null (transformers' Olmo3 needs a window; an OLMo-3 whose layers "
            "all see every key is an OLMo-2: model_type \"olmo2\")");
      s.sliding_window = c.integer({"sliding_window"}, 4096);
      if (s.sliding_window < 1)
        throw Error(file + ": sliding_window must be at least 1, got 0", Error::kUsage);
      s.sliding_period = 4;
      const std::string layout =
          "keel's olmo3 slides all layers but every Nth: \"sliding_attention\" N - 1 times, then "
          "\"full_attention\", repeated, one entry a layer";
      listed_sliding_period(layout);
    }
    if (variant == "exaone4" || variant == "cohere2") {
      // EXAONE-4 (and Cohere2): the layers layer_types names "sliding_attention" slide over the
      // last sliding_window positions (Exaone4Config's 4096; null: none, every layer full and
      // rotating), the others see every key without RoPE (ModelSpec::layer_rotates). Without
      // layer_types every sliding_window_pattern-th layer is full: a number (4), or "L"s then a
      // "G" ("LLLG", the 32B's).
      const json* window = j.contains("sliding_window") ? &j["sliding_window"] : nullptr;
      s.sliding_window = window && window->is_null() ? 0 : c.integer({"sliding_window"}, 4096);
      if (s.sliding_window > 0) {
        const std::string layout =
            "keel's " + variant +
            " slides all layers but every Nth: \"sliding_attention\" N - 1 times, then "
            "\"full_attention\", repeated, one entry a layer";
        s.sliding_period = 4;
        const json* pattern = c.find({"sliding_window_pattern"});
        if (pattern && !c.find({"layer_types"})) {  // (layer_types, when given, is what HF reads)
          const std::string text = pattern->is_string() ? pattern->get<std::string>() : "";
          const bool letters =
              !text.empty() && text.back() == 'G' && text.find_first_not_of('L') == text.size() - 1;
          if (pattern->is_number_integer() && pattern->get<int64_t>() >= 1)
            s.sliding_period = pattern->get<int64_t>();
          else if (letters && s.n_layer % std::ssize(text) == 0)  // its last layer full too
            s.sliding_period = std::ssize(text);
          else
            throw unsupported("sliding_window_pattern " + pattern->dump() + " (" + layout +
                              ": a number N, or N - 1 \"L\"s then \"G\" dividing the layers)");
        }
        listed_sliding_period(layout);
      }
      // HF's Cohere2 rotates only the layers that slide: without a window none would rotate.
      if (variant == "cohere2" && s.sliding_window == 0)
        throw unsupported("sliding_window = null (HF's Cohere2 then turns no layer by RoPE)");
    }
    if (models::ModelSpec::is_moe_type(variant)) {
      // A mixture of experts (ModelSpec::moe): Qwen3-MoE's and OLMoE's num_experts,
      // Mixtral's num_local_experts, num_experts_per_tok a token (their configs' defaults where
      // absent). An expert's width: Qwen3-MoE's moe_intermediate_size (intermediate_size is its
      // dense layers'), OLMoE's and Mixtral's intermediate_size. Renormalized weights: Qwen3-MoE
      // and OLMoE as norm_topk_prob says, Mixtral always.
      // Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen3-MoE's fields (Qwen2MoeConfig's
      // defaults: 60 experts 1408 wide, 4 a token) and a shared expert
      // shared_expert_intermediate_size wide (5632).
      const bool qwen2 = variant == "qwen2_moe";
      const bool qwen = variant == "qwen3_moe" || qwen2, mixtral = variant == "mixtral";
      const char* count = mixtral ? "num_local_experts" : "num_experts";
      s.moe.experts = c.integer({count}, qwen2 ? 60 : qwen ? 128 : mixtral ? 8 : 64);
      s.moe.per_token = c.integer({"num_experts_per_tok"}, mixtral ? 2 : qwen2 ? 4 : 8);
      s.moe.ffn =
          qwen ? c.integer({"moe_intermediate_size"}, qwen2 ? 1408 : 768) : s.intermediate_size;
      s.moe.normalize = mixtral || c.boolean("norm_topk_prob", false);
      auto out_of = [&](const std::string& field, int64_t v, const std::string& range) {
        return Error(file + ": " + field + " = " + std::to_string(v) + " must be " + range,
                     Error::kUsage);
      };
      if (s.moe.experts < 1 || s.moe.experts > models::ModelSpec::kMaxExperts)
        throw out_of(count, s.moe.experts,
                     "from 1 to " + std::to_string(models::ModelSpec::kMaxExperts));
      if (s.moe.per_token < 1 || s.moe.per_token > s.moe.experts)
        throw out_of(
            "num_experts_per_tok", s.moe.per_token,
            std::string("from 1 to ") + count + " (" + std::to_string(s.moe.experts) + ")");
      if (s.moe.ffn < 1)
        throw out_of(qwen ? "moe_intermediate_size" : "intermediate_size", s.moe.ffn, ">= 1");
      if (qwen2) {
        s.moe.shared_ffn = c.integer({"shared_expert_intermediate_size"}, 5632);
        if (s.moe.shared_ffn < 1)
          throw out_of("shared_expert_intermediate_size", s.moe.shared_ffn, ">= 1");
      }
      if (qwen) {  // every decoder_sparse_step-th layer sparse, but mlp_only_layers
        s.moe.sparse_step = c.integer({"decoder_sparse_step"}, 1);
        if (s.moe.sparse_step < 1) throw out_of("decoder_sparse_step", s.moe.sparse_step, ">= 1");
        if (const json* dense = c.find({"mlp_only_layers"})) {
          if (!dense->is_array()) throw unsupported("mlp_only_layers " + dense->dump());
          for (const json& l : *dense) {
            if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= s.n_layer)
              throw Error(file + ": mlp_only_layers " + dense->dump() +
                              " must list layers from 0 to num_hidden_layers - 1 (" +
                              std::to_string(s.n_layer - 1) + ")",
                          Error::kUsage);
            s.moe.dense_layers.push_back(l.get<int64_t>());
          }
        }
      }
      // The load-balancing loss HF's training adds: router_aux_loss_coef times it, where
      // output_router_logits is set (their configs' default coefficients where absent). keel's
      // runs take model.router_aux_loss_coef instead, saying where they differ (train/run.cpp).
      if (c.boolean("output_router_logits", false)) {
        s.moe.aux_coef = c.number({"router_aux_loss_coef"}, variant == "olmoe" ? 0.01 : 0.001);
        if (!(std::isfinite(s.moe.aux_coef) && s.moe.aux_coef >= 0))
          throw Error(file +
                          ": router_aux_loss_coef = " + c.find({"router_aux_loss_coef"})->dump() +
                          " must be a weight >= 0 (0.001 in Qwen3-MoE's and Mixtral's configs)",
                      Error::kUsage);
      }
      // What keel's training does not add or apply: refused, not left out without a word.
      if (mixtral && c.number({"router_jitter_noise"}, 0.0) != 0)
        throw unsupported("router_jitter_noise = " + c.find({"router_jitter_noise"})->dump() +
                          " (noise on the router's input while training); set it to 0");
    } else if (const json* experts = c.find({"num_experts", "num_local_experts"});
               experts && !(experts->is_number_integer() && experts->get<int64_t>() == 0)) {
      throw unsupported(std::string(c.find({"num_experts"}) ? "num_experts" : "num_local_experts") +
                        " = " + experts->dump() +
                        " (experts in a model_type keel reads as dense; keel's mixtures of "
                        "experts are qwen3_moe, qwen2_moe, olmoe and mixtral)");
    }
    if (variant == "granite") {
      // Granite (GraniteConfig's defaults: 1 each; its files give all four).
      auto multiplier = [&](const char* field) {
        const double m = c.number({field}, 1.0);
        if (!(m > 0) || !std::isfinite(m))
          throw Error(
              file + ": " + field + " must be a positive number, got " + c.find({field})->dump(),
              Error::kUsage);
        return m;
      };
      s.embedding_multiplier = multiplier("embedding_multiplier");
      s.residual_multiplier = multiplier("residual_multiplier");
      s.attention_multiplier = multiplier("attention_multiplier");
      s.logits_scaling = multiplier("logits_scaling");
    }
    if (variant == "smollm3") {
      // SmolLM3: every no_rope_layer_interval-th layer without RoPE (4: layers 3, 7, ... of 36),
      // as its no_rope_layers lists them (1: rotates, 0: NoPE; at least one entry a layer). Its
      // use_sliding_window (a window on the NoPE layers) is not read.
      s.nope_period = c.integer({"no_rope_layer_interval"}, 4);
      if (s.nope_period < 1)
        throw Error(file + ": no_rope_layer_interval must be at least 1, got " +
                        std::to_string(s.nope_period),
                    Error::kUsage);
      const std::string layout =
          "keel's SmolLM3 leaves RoPE out of every Nth layer: N - 1 ones, then a 0, repeated, "
          "one entry a layer";
      if (const json* list = c.find({"no_rope_layers"})) {
        std::vector<bool> rotates;
        if (list->is_array())
          for (const json& v : *list)
            if (v.is_number_integer() && (v == 0 || v == 1)) rotates.push_back(v == 1);
        if (!list->is_array() || rotates.size() != list->size() || std::ssize(rotates) < s.n_layer)
          throw unsupported("no_rope_layers " + list->dump() + " (" + layout + ")");
        // The period of the list: its first NoPE layer's index + 1 (none: every layer rotates).
        const auto first = std::find(rotates.begin(), rotates.begin() + s.n_layer, false);
        s.nope_period = first == rotates.begin() + s.n_layer ? 0 : first - rotates.begin() + 1;
        for (int64_t i = 0; i < s.n_layer; ++i)
          if (rotates[static_cast<size_t>(i)] != s.layer_rotates(i))
            throw unsupported("no_rope_layers " + list->dump() + " (" + layout + ")");
      }
      if (c.boolean("use_sliding_window", false))
        throw unsupported("use_sliding_window = true (SmolLM3's window on its NoPE layers)");
      if (const auto slides = sliding_layers("keel's SmolLM3 slides no layer"))
        expect_layout(*slides, "keel's SmolLM3 slides no layer");
    }
    // The share of each head's channels RoPE turns: Phi-3's partial_rotary_factor (Phi-4-mini's
    // 0.75; 1 where absent), Phi's (PhiConfig's 0.5 where absent; Phi-2's 0.4), GPT-NeoX's
    // rotary_pct (0.25 where absent: Pythia's). Checked against the head once it is known.
    const bool partial = variant == "phi3" || s.phi() || s.gpt_neox() || s.stablelm() || s.glm();
    const char* rotary_key =
        s.gpt_neox() && c.find({"rotary_pct"}) ? "rotary_pct" : "partial_rotary_factor";
    if (!partial && c.number({"partial_rotary_factor"}, 1.0) != 1.0)
      throw unsupported("partial_rotary_factor = " + c.find({"partial_rotary_factor"})->dump() +
                        " (keel's " + s.architecture() + " turns every channel of a head)");
    if (partial) {
      s.partial_rotary_factor = c.number({rotary_key}, s.phi() || s.glm()             ? 0.5
                                                       : s.gpt_neox() || s.stablelm() ? 0.25
                                                                                      : 1.0);
      if (!(s.partial_rotary_factor > 0 && s.partial_rotary_factor <= 1))
        throw Error(file + ": " + rotary_key +
                        " must be a number in (0, 1] (the share of a head's channels RoPE "
                        "turns), got " +
                        c.find({rotary_key})->dump(),
                    Error::kUsage);
    }
    // A head width of its own (Qwen3-0.6B's and -4B's, Mistral-Nemo's), as HF's attention reads
    // it: getattr(config, "head_dim", hidden_size // num_attention_heads).
    // (GemmaConfig's default head_dim is 256, GlmConfig's 128, not hidden_size / heads)
    if (const int64_t hd = c.integer({"head_dim"}, s.gemma() ? 256
                                                   : s.glm() ? 128
                                                             : 0);
        hd > 0 && (s.n_head < 1 || s.n_embd % s.n_head != 0 || hd != s.n_embd / s.n_head)) {
      if (hd > models::ModelSpec::kMaxHeadWidth)
        throw Error(file + ": head_dim = " + std::to_string(hd) + " is wider than keel's heads (" +
                        std::to_string(models::ModelSpec::kMaxHeadWidth) +
                        " at most); fix head_dim",
                    Error::kUsage);
      s.head_width = hd;
    }
    if (s.gptj()) read_gptj_rotary_dim(c, s);
    if (s.n_head > 0 && s.partial_rotary_factor != 1 && (s.rotary_dim() < 2 || s.rotary_dim() % 2))
      throw Error(file + ": " + rotary_key + " = " + json(s.partial_rotary_factor).dump() +
                      " of a head of " + std::to_string(s.head_dim()) + " channels turns " +
                      std::to_string(s.rotary_dim()) + "; RoPE turns pairs: fix " + rotary_key +
                      " so that head_dim times it is an even number of 2 or more",
                  Error::kUsage);
    if (const ops::RopeScaling& r = s.rope_scaling;
        r.kind == ops::RopeScaling::Kind::kLongRope && s.n_head > 0 &&
        (std::ssize(r.short_factor) != s.rotary_dim() / 2 ||
         std::ssize(r.long_factor) != s.rotary_dim() / 2))
      throw Error(file + ": rope_scaling's short_factor and long_factor hold " +
                      std::to_string(r.short_factor.size()) + " and " +
                      std::to_string(r.long_factor.size()) + " values; a head that turns " +
                      std::to_string(s.rotary_dim()) + " channels needs " +
                      std::to_string(s.rotary_dim() / 2) + " each (one per rotated pair)",
                  Error::kUsage);
  }
  s.init_std = c.number({"initializer_range"}, 0.02);
  if (!(s.norm_eps > 0) || !std::isfinite(s.norm_eps))
    throw Error(file + ": field '" + (s.family == "gpt2" ? "layer_norm_epsilon" : "rms_norm_eps") +
                    "' must be a positive number, got " + std::to_string(s.norm_eps),
                Error::kUsage);
  if (!(s.rope_theta > 0) || !std::isfinite(s.rope_theta))
    throw Error(file + ": field 'rope_theta' must be a positive number, got " +
                    std::to_string(s.rope_theta),
                Error::kUsage);
  // transformers >= 4.56 writes "dtype"; earlier versions "torch_dtype".
  const std::string td = c.string("torch_dtype", c.string("dtype", "float32"));
  if (td == "bfloat16")
    out.dtype = DType::BF16;
  else if (td == "float16")
    out.dtype = DType::F16;
  else if (td == "float32")
    out.dtype = DType::F32;
  else
    throw Error(file + ": torch_dtype '" + td + "' is not one of float32, bfloat16, float16");
  try {
    s.validate();
  } catch (const Error& e) {
    throw Error(file + ": inconsistent sizes: " + e.what(), Error::kUsage);
  }
  // A keel checkpoint stores keel's layout (GPT-2 linears as [out, in]), not HF's: its own loader
  // checks every tensor.
  if (!is_keel_checkpoint(dir)) check_sizes_against_weights(dir, s);
  return out;
}

std::vector<int64_t> generation_eos_ids(const std::string& dir) {
  const std::string file = dir + "/generation_config.json";
  if (dir.empty() || !path_exists(file)) return {};
  nlohmann::json j;
  try {
    j = read_json(file);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (fix or remove it: it names the ids that end a reply)",
                Error::kUsage);
  }
  const auto eos = j.is_object() ? j.find("eos_token_id") : j.end();
  if (!j.is_object() || eos == j.end() || eos->is_null()) return {};
  std::vector<int64_t> ids;
  const nlohmann::json list = eos->is_array() ? *eos : nlohmann::json::array({*eos});
  for (const auto& v : list) {
    try {
      ids.push_back(data::token_id_from_json(v, file + ": eos_token_id"));
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + "; fix or remove it", Error::kUsage);
    }
  }
  return ids;
}

}  // namespace keel::io
