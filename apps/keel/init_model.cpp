// `keel init-model --family llama --out DIR [sizes]`: writes a randomly initialized model as a
// Hugging Face directory (config.json + model.safetensors, or shards with --shard-bytes), the
// layout `model.path` reads. Examples and tests use it to get a small "pretrained" checkpoint
// without downloading one.
#include <cstdio>
#include <sstream>

#include "apps/keel/commands.h"
#include "apps/keel/output_dir.h"
#include "keel/io/hf_model.h"
#include "keel/io/weight_check.h"
#include "keel/log/console.h"
#include "keel/models/param_shapes.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/numerics/text.h"
#include "keel/train/config.h"

namespace keel::cli {

namespace {
struct InitModelArgs {
  std::string out, family = "llama", dtype = "f32";
  int64_t n_layer = 2, n_embd = 64, n_head = 4, n_kv_head = 0, head_dim = 0, intermediate_size = 0;
  int64_t vocab_size = 259, max_seq_len = 128, shard_bytes = 0;
  int64_t num_experts = 4, experts_per_token = 2, expert_size = 0;  // qwen3_moe, olmoe, mixtral
  int64_t shared_expert_size = 0;                                   // qwen2_moe
  bool untied = false;
  bool qk_layernorm = false;  // cohere (Command-R+'s use_qk_norm), stablelm, phi
  double rope_theta = 10000.0, norm_eps = 1e-5, init_std = 0.02;
  uint64_t seed = 0;
};

// Each size and constant within the bounds of the config key it becomes (model.n_layer, ...):
// --n-layer 1000000000 used to run for minutes building modules, --norm-eps -1 or --rope-theta 0
// to write a model whose first forward is NaN.
void check_flags(const InitModelArgs& a) {
  auto check = [](const char* key, const char* flag, double v, const std::string& shown) {
    check_config_number(key, v, shown, std::string("init-model ") + flag + " " + shown);
  };
  auto sized = [&](const char* key, const char* flag, int64_t v) {
    check(key, flag, static_cast<double>(v), std::to_string(v));
  };
  auto real = [&](const char* key, const char* flag, double v) {
    std::ostringstream shown;
    shown << v;  // as typed for usual values: 1e-05, -1, nan, inf
    check(key, flag, v, shown.str());
  };
  sized("model.n_layer", "--n-layer", a.n_layer);
  sized("model.n_embd", "--n-embd", a.n_embd);
  sized("model.n_head", "--n-head", a.n_head);
  sized("model.n_kv_head", "--n-kv-head", a.n_kv_head);
  sized("model.head_dim", "--head-dim", a.head_dim);
  sized("model.intermediate_size", "--intermediate-size", a.intermediate_size);
  sized("model.vocab_size", "--vocab-size", a.vocab_size);
  sized("model.max_seq_len", "--max-seq-len", a.max_seq_len);
  real("model.rope_theta", "--rope-theta", a.rope_theta);
  real("model.norm_eps", "--norm-eps", a.norm_eps);
  real("model.init_std", "--init-std", a.init_std);
  // model.vocab_size's 0 means "the tokenizer's", and init-model has no tokenizer; a one-token
  // vocabulary has nothing to predict (its softmax is 1 and the loss 0, whatever the weights).
  if (a.vocab_size < 2)
    throw Error("init-model --vocab-size " + std::to_string(a.vocab_size) +
                    ": a model needs at least 2 tokens to predict; give its tokenizer's "
                    "vocabulary (259 for keel's byte tokenizer, 50257 for GPT-2's)",
                Error::kUsage);
  if (a.shard_bytes < 0)
    throw Error("init-model --shard-bytes " + std::to_string(a.shard_bytes) +
                    ": use 0 (one file) or a positive number of bytes",
                Error::kUsage);
}

int run_init_model(const InitModelArgs& a) {
  check_flags(a);
  models::ModelSpec s;
  // Gemma, Gemma-2, Gemma-3, Phi-3, Qwen2, Qwen3 and SmolLM3 are Llama's layers
  // (models/causal_lm.h), written back as their own architectures.
  // (GPT-BigCode is GPT-2's blocks: the gpt2 family.)
  const bool bigcode = a.family == "gpt_bigcode";
  const bool llama_layers = a.family != "gpt2" && a.family != "llama" && !bigcode;
  s.family = llama_layers ? "llama" : bigcode ? "gpt2" : a.family;
  s.hf_model_type = bigcode                ? "gpt_bigcode"
                    : !llama_layers        ? ""
                    : a.family == "gemma3" ? "gemma3_text"
                                           : a.family;
  if (a.family == "gemma2") {  // Gemma2Config's defaults; the scale of head_dim
    s.sliding_window = 4096;
    s.sliding_period = 2;
    s.attn_softcap = 50;
    s.final_softcap = 30;
  }
  if (a.family == "smollm3") s.nope_period = 4;        // SmolLM3Config's no_rope_layer_interval
  if (a.family == "olmo3" || a.family == "exaone4") {  // Olmo3Config's, Exaone4Config's defaults
    s.sliding_window = 4096;
    s.sliding_period = 4;
  }
  if (a.shared_expert_size != 0 && a.family != "qwen2_moe")
    throw Error(
        "init-model --shared-expert-size is Qwen2-MoE's shared expert (--family "
        "qwen2_moe); drop it for " +
            a.family,
        Error::kUsage);
  if (models::ModelSpec::is_moe_type(a.family)) {  // every layer sparse
    if (a.experts_per_token > a.num_experts)
      throw Error("init-model --experts-per-token " + std::to_string(a.experts_per_token) +
                      " exceeds --num-experts " + std::to_string(a.num_experts) +
                      ": a token is routed to some of its layer's experts",
                  Error::kUsage);
    s.moe.experts = a.num_experts;
    s.moe.per_token = a.experts_per_token;
    // Qwen3-MoE's published files, Mixtral's always; OLMoE's and Qwen1.5-MoE's not
    s.moe.normalize = a.family != "olmoe" && a.family != "qwen2_moe";
  } else if (a.num_experts != InitModelArgs{}.num_experts ||
             a.experts_per_token != InitModelArgs{}.experts_per_token || a.expert_size != 0) {
    throw Error(
        "init-model: --num-experts, --experts-per-token and --expert-size are for the "
        "mixtures of experts (--family qwen3_moe, qwen2_moe, olmoe or mixtral); drop them for " +
            a.family,
        Error::kUsage);
  }
  if (a.family == "gemma3") {  // Gemma3TextConfig's defaults; the scale of head_dim
    s.sliding_window = 4096;
    s.sliding_period = 6;
    s.rope_local_theta = 10000;
  }
  s.n_layer = a.n_layer;
  s.n_embd = a.n_embd;
  s.n_head = a.n_head;
  s.n_kv_head = a.n_kv_head;
  s.set_head_dim(a.head_dim);
  s.intermediate_size = a.intermediate_size;
  if (s.moe.experts > 0) {  // an expert's width: --expert-size, else the dense MLP's
    s.moe.ffn = a.expert_size > 0 ? a.expert_size : s.ffn_dim();
    if (a.family != "qwen3_moe" && a.family != "qwen2_moe")
      s.intermediate_size = s.moe.ffn;  // (their one width)
    // Qwen2-MoE's shared expert: --shared-expert-size, else 4 experts wide (Qwen1.5-MoE's 5632
    // beside its 1408).
    if (a.family == "qwen2_moe")
      s.moe.shared_ffn = a.shared_expert_size > 0 ? a.shared_expert_size : 4 * s.moe.ffn;
  }
  s.vocab_size = a.vocab_size;
  s.max_seq_len = a.max_seq_len;
  s.tie_embeddings = s.family == "gpt2" || !a.untied;
  if (a.family == "gemma2" || a.family == "gemma3")
    s.query_pre_attn_scalar = static_cast<double>(s.head_dim());
  if (a.family == "granite") {  // Granite-3's multipliers, its attention's scale 1 / head_dim
    s.embedding_multiplier = 12;
    s.residual_multiplier = 0.22;
    s.attention_multiplier = 1.0 / static_cast<double>(s.head_dim());
    s.logits_scaling = 8;
  }
  if (a.family == "cohere" || a.family == "cohere2")  // CohereConfig's (Command-R's)
    s.logit_scale = 0.0625;
  if (a.family == "cohere2") {  // Cohere2Config's: 3 of 4 layers sliding over 4096 positions
    s.sliding_window = 4096;
    s.sliding_period = 4;
  }
  // PhiConfig's and GPTNeoXConfig's defaults: RoPE on half (a quarter) of each head, gelu_new
  // (the exact gelu), an untied head.
  // GlmConfig's: RoPE on adjacent pairs of half of each head, q/k/v biases.
  if (a.family == "glm" || a.family == "glm4") {
    s.partial_rotary_factor = 0.5;
    s.attention_bias = true;
  }
  // StableLM-2-1.6B's: RoPE on a quarter of each head, q/k/v biases, the branches in sequence.
  if (a.family == "stablelm") {
    s.partial_rotary_factor = 0.25;
    s.attention_bias = true;
    s.parallel_residual = false;
  }
  if (a.family == "phi" || a.family == "gpt_neox") {
    s.partial_rotary_factor = a.family == "phi" ? 0.5 : 0.25;
    s.mlp_gelu = a.family == "phi" ? ops::GeluApprox::Tanh : ops::GeluApprox::None;
    s.tie_embeddings = false;
  }
  // FalconConfig's: the exact gelu, the head tied; one key/value head (Falcon-7B's multi_query)
  // or one a query head in the older layout, any other count new_decoder_architecture's with a
  // norm for each branch (Falcon-40B's).
  if (a.family == "falcon") {
    s.mlp_gelu = ops::GeluApprox::None;
    s.new_decoder_architecture = s.kv_heads() != 1 && s.kv_heads() != s.n_head;
    s.norm_per_branch = s.new_decoder_architecture;
  }
  // GPTJConfig's and CodeGenConfig's: RoPE on a quarter of each head (GPT-J-6B's 64 of 256),
  // gelu_new, an untied head.
  // Starcoder2Config's: biases (use_bias), the tanh gelu.
  if (a.family == "starcoder2") {
    s.attention_bias = true;
    s.mlp_gelu = ops::GeluApprox::Tanh;
  }
  if (a.family == "gptj" || a.family == "codegen") {
    s.partial_rotary_factor = 0.25;
    s.mlp_gelu = ops::GeluApprox::Tanh;
    s.tie_embeddings = false;
  }
  if (a.qk_layernorm && a.family != "cohere" && a.family != "stablelm" && a.family != "phi")
    throw Error(
        "init-model --qk-layernorm is Command-R+'s, StableLM-2-12B's and Phi's (--family "
        "cohere, stablelm or phi); drop it for " +
            a.family,
        Error::kUsage);
  s.qk_layernorm = a.qk_layernorm;
  s.rope_theta = a.rope_theta;
  s.norm_eps = a.norm_eps;
  s.init_std = a.init_std;
  if (s.family == "gpt2" && a.untied)
    throw Error("init-model: GPT-2 always ties lm_head to wte; drop --untied", Error::kUsage);
  // Llama's options, which GPT-2 has not (they were dropped silently, the summary line still
  // printing "(2 kv)").
  if (s.family == "gpt2" && a.n_kv_head != 0 && a.n_kv_head != a.n_head &&
      !(bigcode && a.n_kv_head == 1))
    throw Error("init-model: GPT-2 has no grouped key/value heads; drop --n-kv-head",
                Error::kUsage);
  if (s.family == "gpt2" && s.head_width > 0)
    throw Error("init-model: GPT-2's heads are --n-embd / --n-head wide; drop --head-dim",
                Error::kUsage);
  if (s.family == "gpt2" && a.rope_theta != InitModelArgs{}.rope_theta)
    throw Error("init-model: GPT-2 has learned positions, no RoPE; drop --rope-theta",
                Error::kUsage);
  auto dt = dtype_from_name(a.dtype);
  if (!dt || !dtype_is_floating(*dt))
    throw Error("init-model --dtype " + a.dtype + ": use f32, bf16 or f16", Error::kUsage);
  // Built in the stored dtype: each draw is made in f32 and rounded once, the bits an f32 model
  // saved in that dtype gets, without ever holding the f32 model.
  s.param_dtype = *dt;
  // Sizes that do not fit together, named by their flags (the model's own check names its fields:
  // "model: llama needs an even head dim for RoPE, got 9").
  if (a.head_dim == 0 && a.n_embd % a.n_head != 0)
    throw Error("init-model --n-embd " + std::to_string(a.n_embd) +
                    " is not divisible by --n-head " + std::to_string(a.n_head) +
                    "; each head gets n-embd / n-head channels (or give --head-dim)",
                Error::kUsage);
  if (s.family == "llama" && a.head_dim > 0 && a.head_dim % 2 != 0)
    throw Error("init-model --head-dim " + std::to_string(a.head_dim) + " is odd; " + a.family +
                    "'s rotary embedding (RoPE) turns pairs of channels, so a head needs an "
                    "even number",
                Error::kUsage);
  if (s.family == "llama" && a.head_dim == 0 && (a.n_embd / a.n_head) % 2 != 0)
    throw Error("init-model --n-embd " + std::to_string(a.n_embd) + " / --n-head " +
                    std::to_string(a.n_head) + " gives heads of " +
                    std::to_string(a.n_embd / a.n_head) + " channels; " + a.family +
                    "'s rotary embedding (RoPE) turns pairs of channels, so a "
                    "head needs an even number: change --n-embd or --n-head",
                Error::kUsage);
  if (a.n_kv_head > 0 && a.n_head % a.n_kv_head != 0)
    throw Error("init-model --n-head " + std::to_string(a.n_head) +
                    " is not a multiple of --n-kv-head " + std::to_string(a.n_kv_head) +
                    " (each key/value head serves a group of query heads)",
                Error::kUsage);
  s.validate();  // usage errors naming the inconsistent sizes
  check_output_dir("--out", a.out, {});
  // The model is held whole before it is written: refused before allocating when it cannot fit.
  const int64_t params = models::parameter_count(s);
  const int64_t bytes = params * static_cast<int64_t>(dtype_size(*dt));
  const int64_t avail = monitor::available_memory_bytes();
  if (avail > 0 && bytes > avail)
    throw Error("init-model: " + std::to_string(params) + " parameters need " +
                    monitor::format_bytes(bytes) + " in " + dtype_name(*dt) + ", but only " +
                    monitor::format_bytes(avail) +
                    " of memory is available; lower --n-layer, --n-embd, --intermediate-size or "
                    "--vocab-size, or store --dtype bf16",
                Error::kUsage);
  auto model = models::make_causal_lm(s, a.seed);
  // Draws that the stored dtype cannot hold (--init-std 1e6 in f16: 95% of the embedding inf)
  // would make a model no loader accepts.
  for (auto& [name, p] : model->named_parameters())
    if (const io::NonfiniteWeights bad = io::find_nonfinite_weights(p.data(), p.dtype(), p.shape());
        bad.count > 0)
      throw Error("init-model --init-std " + log::format_number(a.init_std, 6) + ": " +
                      std::to_string(bad.count) + " values of " + name + " overflow " +
                      dtype_name(*dt) + "; lower --init-std or store a wider --dtype",
                  Error::kUsage);
  io::HfSaveOptions opt;
  opt.dtype = *dt;
  opt.max_shard_bytes = a.shard_bytes;
  write_model_dir("--out", a.out,
                  [&](const std::string& dir) { io::save_hf_model(*model, dir, opt); });
  std::printf("wrote %s: %s, %s, %lld wide, %s (%lld kv), vocab %lld, %.2fM params, %s\n",
              a.out.c_str(), a.family.c_str(), count_of(s.n_layer, "layer").c_str(),
              static_cast<long long>(s.n_embd), count_of(s.n_head, "head").c_str(),
              static_cast<long long>(s.kv_heads()), static_cast<long long>(s.vocab_size),
              model->num_parameters() / 1e6, dtype_name(*dt));
  return 0;
}
}  // namespace

Command add_init_model(CLI::App& app) {
  auto a = std::make_shared<InitModelArgs>();
  CLI::App* sub = app.add_subcommand(
      "init-model",
      "Write a randomly initialized GPT-2, Llama, Gemma, Gemma-2, Gemma-3, Granite, OLMo-2, "
      "OLMo-3, EXAONE-4, Phi-3, Qwen2, Qwen3, SmolLM3, or a Qwen3-MoE, OLMoE or Mixtral mixture "
      "of experts as a Hugging Face directory");
  sub->add_option("--out", a->out, "output directory (config.json + model.safetensors)")
      ->required();
  sub->add_option(
         "--family", a->family,
         "gpt2 | llama | gemma (Llama with 1 + w norms, GeGLU, a scaled embedding) | "
         "gemma2 (and sandwich norms, soft caps, every other layer sliding) | gemma3 "
         "(Gemma-2's layers with q/k norms, 5 of 6 sliding with their own RoPE base) | "
         "phi3 (with fused qkv and gate_up) | qwen2 (with q/k/v biases) | qwen3 (with q/k "
         "norms) | smollm3 (every 4th layer without RoPE) | granite (with Granite-3's "
         "multipliers) | olmo2 (norms after the attention and the MLP, q/k norms) | "
         "olmo3 (OLMo-2's layers, 3 of 4 sliding) | exaone4 (OLMo-2's norms, q/k norms per "
         "head, 3 of 4 layers sliding, the 4th without RoPE) | qwen3_moe (Qwen3's layers, each "
         "MLP a mixture of experts, weights renormalized) | olmoe (OLMo-2's q/k norms, Llama's "
         "norms, experts, weights not renormalized) | mixtral (Mistral's layers with experts) | "
         "cohere (attention and MLP side by side, LayerNorms, RoPE on adjacent pairs, logits "
         "times 0.0625) | cohere2 (Cohere's layers, 3 of 4 sliding, the 4th without RoPE) | "
         "qwen2_moe (Qwen2's layers, each MLP experts and a gated shared expert) | phi (Phi-2's: "
         "attention and a gelu MLP side by side on one LayerNorm, biases, RoPE on half of each "
         "head) | gpt_neox (Pythia's: Phi's layers with a norm for each branch, q/k/v fused head "
         "by head, RoPE on a quarter of each head) | stablelm (StableLM-2's: Llama's layers with "
         "biased LayerNorms and q/k/v biases, RoPE on a quarter of each head) | olmo (OLMo's: "
         "Llama's layers with LayerNorms without parameters) | glm (GLM-4's: q/k/v biases, "
         "gate_up_proj, RoPE on adjacent pairs of half of each head) | glm4 (GLM-4-0414's: and a "
         "norm after the attention and after the MLP) | falcon (Falcon-7B's: GPT-NeoX's "
         "layers without biases on one LayerNorm, q/k/v fused a key/value group at a time; "
         "--n-kv-head 1 its multi-query, another count than 1 or --n-head Falcon-40B's layout "
         "with a norm for each branch) | gptj (GPT-J-6B's: Phi's block under GPT-2's names, "
         "q/k/v and out_proj without biases, RoPE on adjacent pairs of a quarter of each head) | "
         "codegen (CodeGen's: GPT-J's with q, v and k one qkv_proj in 4 blocks of heads) | "
         "starcoder2 (StarCoder2's: Llama's layers with biased LayerNorms and projections and a "
         "gelu MLP, c_fc and c_proj) | gpt_bigcode (StarCoder-1's, SantaCoder's: GPT-2's blocks "
         "with nn.Linear weights; --n-kv-head 1 its multi_query)")
      ->check(CLI::IsMember({"gpt2",     "llama",    "gemma",   "gemma2",     "gemma3",
                             "granite",  "olmo2",    "olmo3",   "exaone4",    "phi3",
                             "qwen2",    "qwen3",    "smollm3", "qwen3_moe",  "qwen2_moe",
                             "olmoe",    "mixtral",  "cohere",  "cohere2",    "phi",
                             "gpt_neox", "stablelm", "olmo",    "glm",        "glm4",
                             "falcon",   "gptj",     "codegen", "starcoder2", "gpt_bigcode"}))
      ->capture_default_str();
  // A size or value flag checked as its config key is (range and message from the key table).
  auto config_option = [sub](const char* flag, auto& value, const char* help, const char* key,
                             bool whole) {
    sub->add_option(flag, value, help)->check(config_check(key, whole))->capture_default_str();
  };
  config_option("--n-layer", a->n_layer, "decoder layers", "model.n_layer", true);
  config_option("--n-embd", a->n_embd, "hidden size", "model.n_embd", true);
  config_option("--n-head", a->n_head, "attention heads", "model.n_head", true);
  config_option("--n-kv-head", a->n_kv_head, "llama: key/value heads (0 = n-head)",
                "model.n_kv_head", true);
  config_option("--head-dim", a->head_dim,
                "llama: a head's channels, Qwen3-0.6B's 128 beside 1024 / 16 (0 = n-embd / n-head)",
                "model.head_dim", true);
  config_option("--intermediate-size", a->intermediate_size,
                "MLP width (0: 4 x n-embd for gpt2, Llama's 8/3 rule)", "model.intermediate_size",
                true);
  config_option("--vocab-size", a->vocab_size, "vocabulary (259 = keel's byte tokenizer)",
                "model.vocab_size", true);
  config_option("--max-seq-len", a->max_seq_len, "n_positions / max_position_embeddings",
                "model.max_seq_len", true);
  sub->add_option("--num-experts", a->num_experts,
                  "qwen3_moe, olmoe, mixtral: experts in each layer's mixture")
      ->check(whole_check(1, models::ModelSpec::kMaxExperts))
      ->capture_default_str();
  sub->add_option("--experts-per-token", a->experts_per_token,
                  "qwen3_moe, olmoe, mixtral: experts each token is routed to (at most "
                  "--num-experts)")
      ->check(whole_check(1, models::ModelSpec::kMaxExperts))
      ->capture_default_str();
  sub->add_option("--expert-size", a->expert_size,
                  "qwen3_moe, olmoe, mixtral: an expert's MLP width (0: --intermediate-size's)")
      ->check(config_check("model.intermediate_size", true))
      ->capture_default_str();
  sub->add_option("--shared-expert-size", a->shared_expert_size,
                  "qwen2_moe: its shared expert's MLP width (0: 4 x --expert-size)")
      ->check(config_check("model.intermediate_size", true))
      ->capture_default_str();
  sub->add_flag("--untied", a->untied, "llama: a separate lm_head (default: tied to embed_tokens)");
  sub->add_flag("--qk-layernorm", a->qk_layernorm,
                "cohere, stablelm, phi: LayerNorms over each head's query and key (Command-R+'s "
                "use_qk_norm, StableLM-2-12B's and Phi's qk_layernorm)");
  config_option("--rope-theta", a->rope_theta, "llama: RoPE base", "model.rope_theta", false);
  config_option("--norm-eps", a->norm_eps, "layer/RMS norm epsilon", "model.norm_eps", false);
  config_option("--init-std", a->init_std, "initializer_range", "model.init_std", false);
  // The seed run.seed would be, bounded as the config bounds it (TOML integers are signed).
  sub->add_option("--seed", a->seed, "initialization seed")
      ->check(whole_check(0, INT64_MAX, " (as run.seed)"))
      ->capture_default_str();
  sub->add_option("--dtype", a->dtype, "stored dtype: f32 | bf16 | f16")->capture_default_str();
  sub->add_option("--shard-bytes", a->shard_bytes,
                  "> 0: shards of at most this many bytes with model.safetensors.index.json")
      ->check(spelled_check(true, "0 (one file) or a positive number of bytes"))
      ->capture_default_str();
  return {sub, [a] { return run_init_model(*a); }};
}

}  // namespace keel::cli
