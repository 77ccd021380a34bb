#include "keel/train/run.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>

#include "keel/backend/cuda_api.h"
#include "keel/backend/monitor.h"
#include "keel/backend/parallel.h"
#include "keel/data/arith.h"
#include "keel/data/dataset.h"
#include "keel/data/loader.h"
#include "keel/data/tokenizer.h"
#include "keel/io/atomic_file.h"
#include "keel/io/hf_model.h"
#include "keel/io/hf_weights.h"
#include "keel/io/trained_model.h"
#include "keel/models/resize.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/nn/adapters/dora.h"
#include "keel/nn/layers.h"
#include "keel/numerics/utc_time.h"
#include "keel/optim/adamw.h"
#include "keel/optim/sgd.h"
#include "keel/tensor/host_memory.h"
#include "keel/tensor/random.h"
#include "keel/train/checkpoint_contents.h"

namespace keel {

namespace {

void say_or_print(const Say& say, const std::string& m) {
  if (say)
    say(m);
  else
    std::fprintf(stderr, "%s\n", m.c_str());
}

// The note for a key whose step numbers (1-based, as the console counts) lie past the run's last
// step `total`: `list` = the key holds a list (only its late entries are named); `what` says what
// therefore never happens.
void say_past_last_step(const Say& say, const std::string& key, const std::vector<int64_t>& steps,
                        bool list, int64_t total, const std::string& what) {
  std::string late;
  for (int64_t s : steps)
    if (s > total) late += (late.empty() ? "" : ", ") + std::to_string(s);
  if (late.empty()) return;
  const std::string last = std::to_string(total);
  say_or_print(say, "note: " + key + (list ? " holds " + late + ", " : " = " + late + " is ") +
                        "past the run's last step (" + last + "): " + what + "; set " +
                        (list ? "steps" : "it to a step") + " from 1 to " + last);
}

}  // namespace

Device run_device(const Config& cfg, const Say& say) {
  Device device = device_from_string(cfg.run.device);
  if (device.is_cuda() && !cuda::status().usable) {
    // One line, then the CPU: a config written for a GPU machine still runs anywhere.
    say_or_print(say, "keel: run.device = " + cfg.run.device + " but no usable CUDA device (" +
                          cuda::status().reason + "); training on the CPU");
    device = Device::cpu();
  }
  return device;
}

bool rows_are_packed(const DataConfig& data) {
  return data.task == "tokens" || (data.task == "text" && data.pack);
}

namespace {
// A packed run resumed from a checkpoint whose vocabulary holds data.pad = "add"'s row: keel
// before 2026-12-05 gave packed rows one too (287 -> 288 for GPT-2's tokenizer), and its tensors
// have it, so the resumed run keeps it (it failed: "'transformer.wte.weight' is [288, 64], the
// model expects [287, 64]").
bool resumes_with_a_pad_row(const Config& cfg, const data::Tokenizer& tok) {
  if (!cfg.run.resume || cfg.data.pad != "add" || cfg.run.out_dir.empty()) return false;
  const std::string last = cfg.run.out_dir + "/checkpoints/last";
  if (!std::filesystem::exists(last + "/config.json")) return false;
  try {
    const nlohmann::json j = nlohmann::json::parse(io::read_file(last + "/config.json"));
    return j.is_object() && j.value("vocab_size", int64_t{-1}) == tok.vocab_size() + 1;
  } catch (const std::exception&) {
    return false;  // a damaged checkpoint: loading it says so
  }
}

bool rows_get_no_pad_row(const Config& cfg, const data::Tokenizer& tok) {
  return rows_are_packed(cfg.data) && !resumes_with_a_pad_row(cfg, tok);
}
}  // namespace

int64_t pad_fill_id(const data::Tokenizer& tok, const std::string& mode, bool packed) {
  if (tok.pad_id() >= 0 && !data::pad_collides(tok, tok.pad_id())) return tok.pad_id();
  // Packed rows are cut from one stream: only the last row's tail is padded, and padding is
  // masked by position, never a label, so no id rule ever reads it. "add" grew the embeddings of
  // a token-file run (287 -> 288 rows for GPT-2's tokenizer) for an id no row held.
  if (packed) return tok.eos_id() >= 0 ? tok.eos_id() : 0;
  if (mode == "add") return tok.vocab_size();
  if (tok.eos_id() >= 0) return tok.eos_id();
  throw Error(
      "the tokenizer (data.tokenizer) has neither a pad nor an eos token to fill padded "
      "positions with; set data.pad = \"add\" or name one in the tokenizer_config.json beside "
      "tokenizer.json",
      Error::kUsage);
}

RunData build_data(const Config& cfg) {
  RunData d;
  d.tokenizer = data::load_tokenizer(cfg.data.tokenizer);
  d.pad_id = pad_fill_id(*d.tokenizer, cfg.data.pad, rows_get_no_pad_row(cfg, *d.tokenizer));
  const DataConfig& dc = cfg.data;
  if (dc.task == "arith") {
    const auto* byte_tok = dynamic_cast<const data::ByteTokenizer*>(d.tokenizer.get());
    if (!byte_tok)
      throw Error(
          "data.task = \"arith\" spells numbers byte by byte: it needs data.tokenizer = "
          "\"byte\", not \"" +
              dc.tokenizer + "\"",
          Error::kUsage);
    data::ArithOptions ao;
    ao.num_train = dc.num_examples;
    ao.num_eval = dc.eval_examples;
    ao.digits = dc.digits;
    ao.seed = cfg.run.seed;
    ao.reverse_answer = dc.arith_reverse;
    data::ArithTask task = data::make_arith_task(*byte_tok, ao);
    d.train = std::move(task.train);
    d.eval = std::move(task.eval);
    d.eval_prompts = std::move(task.eval_prompts);
    d.eval_answers = std::move(task.eval_answers);
    d.stop_token = task.stop_token;
    d.max_answer_tokens = task.max_answer_tokens;
  } else if (dc.task == "text" || dc.task == "jsonl" || dc.task == "tokens") {
    // JSONL examples are packed after the split: the validation part is the file's last examples,
    // not the rows best-fit packing fills last (its shortest examples).
    const bool pack_split =
        dc.task == "jsonl" && dc.pack && dc.eval_path.empty() && dc.eval_fraction > 0;
    data::JsonlOptions jsonl;
    jsonl.chat_date = dc.chat_date;
    d.train = data::load_dataset(dc.task, dc.path, "data.path", *d.tokenizer, dc.seq_len,
                                 dc.pack && !pack_split, jsonl);
    d.files.emplace_back("data.path", file_fingerprint(dc.path));
    if (!dc.eval_path.empty()) {
      d.eval = data::load_dataset(dc.task, dc.eval_path, "data.eval_path", *d.tokenizer, dc.seq_len,
                                  dc.pack, jsonl);
      d.files.emplace_back("data.eval_path", file_fingerprint(dc.eval_path));
    } else if (dc.eval_fraction > 0) {
      const auto n_eval = std::max<int64_t>(
          1, std::llround(dc.eval_fraction * static_cast<double>(d.train->size())));
      auto [train, eval] = data::split_dataset(std::move(d.train), n_eval, dc.path, pack_split);
      d.train = pack_split ? data::pack_dataset(std::move(train), dc.seq_len) : std::move(train);
      d.eval = pack_split ? data::pack_dataset(std::move(eval), dc.seq_len) : std::move(eval);
    }
  } else {
    throw Error("data.task = \"" + dc.task + "\": use arith, text or jsonl", Error::kUsage);
  }
  return d;
}

models::ModelSpec model_spec(const Config& cfg, int64_t tokenizer_vocab, DType param_dtype) {
  const ModelConfig& m = cfg.model;
  if (m.family == "gpt2" && !m.tie_embeddings)
    throw Error(
        "model.tie_embeddings = false with model.family = \"gpt2\": GPT-2's head is always the "
        "token embedding wte (HF's GPT2LMHeadModel ties them); remove the key, or use "
        "model.family = \"llama\" for an untied head",
        Error::kUsage);
  // Llama's keys under GPT-2 (learned positions, one key/value head per query head) built the
  // model without them, without a word; refused as tie_embeddings is above.
  if (m.family == "gpt2") {
    std::vector<std::string> llama_only = keys_off_default(cfg, {"model.rope_theta"});
    if (m.n_kv_head > 0 && m.n_kv_head != m.n_head)
      llama_only.push_back("model.n_kv_head = " + std::to_string(m.n_kv_head));
    if (m.head_dim > 0 && m.head_dim * m.n_head != m.n_embd)
      llama_only.push_back("model.head_dim = " + std::to_string(m.head_dim));
    if (!llama_only.empty()) {
      std::string keys;
      for (const std::string& k : llama_only) keys += (keys.empty() ? "" : " and ") + k;
      throw Error(keys +
                      " with model.family = \"gpt2\": GPT-2 has learned position embeddings "
                      "(no RoPE) and one key/value head per query head (no grouped-query "
                      "attention), each n_embd / n_head wide; remove " +
                      (llama_only.size() > 1 ? "them" : "it") + ", or use model.family = \"llama\"",
                  Error::kUsage);
    }
  }
  models::ModelSpec s;
  s.family = m.family;
  s.n_layer = m.n_layer;
  s.n_embd = m.n_embd;
  s.n_head = m.n_head;
  s.n_kv_head = m.n_kv_head;
  s.set_head_dim(m.head_dim);
  s.intermediate_size = m.intermediate_size;
  s.vocab_size = m.vocab_size > 0 ? m.vocab_size : tokenizer_vocab;
  // Left at its default, model.max_seq_len follows a longer data.seq_len; set shorter, it was
  // raised without a word. (By value, not by origin: a run's saved config.toml gives every key.)
  if (m.max_seq_len != ModelConfig{}.max_seq_len && m.max_seq_len < cfg.data.seq_len)
    throw Error("model.max_seq_len = " + std::to_string(m.max_seq_len) +
                    " is shorter than data.seq_len = " + std::to_string(cfg.data.seq_len) +
                    ": a row needs a position for each of its tokens; raise model.max_seq_len "
                    "(or remove it: it then follows data.seq_len) or lower data.seq_len",
                Error::kUsage);
  s.max_seq_len = std::max(m.max_seq_len, cfg.data.seq_len);
  s.tie_embeddings = m.tie_embeddings;
  s.rope_theta = m.rope_theta;
  s.norm_eps = m.norm_eps;
  s.init_std = m.init_std;
  s.dropout = m.dropout;
  s.attention_dropout = m.attention_dropout;
  s.attention = ops::attention_backend_from_name(m.attention);
  s.param_dtype = param_dtype;
  return s;
}

namespace {

// A random base for an adapter run stored in `base_dt` while the run's parameters are f32: built
// directly in base_dt (each draw is made in f32 and rounded, as the f32 model cast afterwards
// would be: the same bits), never as a whole f32 model. The tensors whose f32 values are used
// before that cast -- the embeddings when data.pad grows them (the new rows are their mean) -- are
// replayed in f32 (models::replay_init) for the time it takes.
std::unique_ptr<models::CausalLM> random_base(const models::ModelSpec& spec, uint64_t seed,
                                              DType base_dt, bool grow_embeddings) {
  models::ModelSpec s = spec;
  s.param_dtype = base_dt;
  auto m = models::make_causal_lm(s, seed);
  if (grow_embeddings) {
    models::replay_init(spec, seed, models::is_vocabulary_parameter,
                        [&](const std::string& name, const Tensor& f32) {
                          m->find_parameter(name).attach_storage(f32);
                        });
  }
  return m;
}

// DoRA's magnitude is ||W||_row of the base weight it starts from: f32 values in a run whose base
// was f32 before its cast. Where the base was drawn directly in a lower dtype (random_base), the
// magnitudes are computed again from the replayed f32 draws, one weight at a time.
void dora_magnitudes_from_f32_draws(models::CausalLM& m, const models::ModelSpec& spec,
                                    uint64_t seed) {
  std::map<std::string, nn::DoraAdapter*> dora;
  for (nn::Linear* lin : nn::adapted_linears(m))
    if (auto* d = dynamic_cast<nn::DoraAdapter*>(lin->adapter.get());
        d && lin->weight.dtype() != DType::F32)
      dora[lin->weight.name()] = d;
  if (dora.empty()) return;
  models::replay_init(
      spec, seed, [&](const std::string& n) { return dora.count(n) > 0; },
      [&](const std::string& name, const Tensor& f32) {
        nn::DoraAdapter* d = dora.at(name);
        d->magnitude.copy_from(nn::DoraAdapter::weight_norm(f32, d->delta_weight(), 1.0));
      });
}

// With model.path, config.json gives the model's shape and [model]'s shape keys are not read: a
// --set model.n_layer=7 trained the file's 2 layers without a word. A key left at its default (or
// a saved config.toml's) says nothing; one set to another value than the file's is refused.
void check_shape_keys_match(const ModelConfig& m, const models::ModelSpec& file_spec,
                            const std::string& path) {
  const ModelConfig d;
  auto refuse = [&](const std::string& key, const std::string& given, const std::string& in_file) {
    throw Error("model." + key + " = " + given + " but model.path (" + path +
                    "/config.json) gives " + in_file +
                    ": the file fixes the model's shape, and [model]'s shape keys are not read "
                    "with it; remove model." +
                    key + " (or use model.path's own value)",
                Error::kUsage);
  };
  auto integer = [&](const char* key, int64_t given, int64_t def, int64_t in_file) {
    if (given != def && given != in_file)
      refuse(key, std::to_string(given), std::to_string(in_file));
  };
  if (m.family != d.family && m.family != file_spec.family)
    refuse("family", "\"" + m.family + "\"", "\"" + file_spec.family + "\"");
  integer("n_layer", m.n_layer, d.n_layer, file_spec.n_layer);
  integer("n_embd", m.n_embd, d.n_embd, file_spec.n_embd);
  integer("n_head", m.n_head, d.n_head, file_spec.n_head);
  integer("n_kv_head", m.n_kv_head, d.n_kv_head, file_spec.kv_heads());
  integer("head_dim", m.head_dim, d.head_dim, file_spec.head_dim());
  integer("intermediate_size", m.intermediate_size, d.intermediate_size, file_spec.ffn_dim());
  integer("vocab_size", m.vocab_size, d.vocab_size, file_spec.vocab_size);
  integer("max_seq_len", m.max_seq_len, d.max_seq_len, file_spec.max_seq_len);
  if (m.tie_embeddings != d.tie_embeddings && m.tie_embeddings != file_spec.tie_embeddings)
    refuse("tie_embeddings", m.tie_embeddings ? "true" : "false",
           file_spec.tie_embeddings ? "true" : "false");
  auto shown = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.10g", v);
    return std::string(buf);
  };
  auto real = [&](const char* key, double given, double def, double in_file) {
    if (given != def && given != in_file) refuse(key, shown(given), shown(in_file));
  };
  real("rope_theta", m.rope_theta, d.rope_theta, file_spec.rope_theta);
  real("norm_eps", m.norm_eps, d.norm_eps, file_spec.norm_eps);
}

// HF trains with config.json's dropout probabilities (GPT-2's resid_pdrop, embd_pdrop and
// attn_pdrop, 0.1 each; Granite-3's attention_dropout 0.1); keel with its own keys, which the
// config decides: a difference is said, not hidden. Phi's, GPT-NeoX's and StableLM's sublayer
// dropout is model.dropout's (ModelSpec::branch_dropout_field); another residual or embedding
// dropout a Llama-family file names (a Phi-3's resid_pdrop, a Phi-2's embd_pdrop) is said as not
// applied.
void say_file_dropouts(const io::HfConfig& hf, const Config& cfg, const Say& say) {
  struct FileDropout {
    const char* file_key;
    const char* key;
    double value;
  };
  const FileDropout dropouts[] = {
      {"resid_pdrop", "model.dropout", cfg.model.dropout},
      {"embd_pdrop", "model.dropout", cfg.model.dropout},
      {"hidden_dropout", "model.dropout", cfg.model.dropout},    // (GPT-NeoX's, Falcon's)
      {"residual_dropout", "model.dropout", cfg.model.dropout},  // (StarCoder2's)
      {"embedding_dropout", "model.dropout", cfg.model.dropout},
      {"attn_pdrop", "model.attention_dropout", cfg.model.attention_dropout},
      {"attention_dropout", "model.attention_dropout", cfg.model.attention_dropout}};
  const std::string file = cfg.model.path + "/config.json";
  for (const FileDropout& d : dropouts) {
    const auto p = hf.json.find(d.file_key);
    if (p == hf.json.end() || !p->is_number() || p->get<double>() == d.value) continue;
    // (HF's parallel Falcon applies its attention_dropout nowhere: nothing to follow.)
    if (hf.spec.falcon() && hf.spec.parallel_block() &&
        d.file_key == std::string("attention_dropout"))
      continue;
    const std::string given = std::string(d.file_key) + " = " + p->dump();
    // The one file key model.dropout stands for beside GPT-2's (and GPT-J's embd_pdrop and
    // StarCoder2's embedding_dropout, which model.dropout applies to the embedding as GPT-2's).
    const char* own = hf.spec.branch_dropout_field();
    const bool embedding_too =
        (hf.spec.gptj() && d.file_key == std::string("embd_pdrop")) ||
        (hf.spec.starcoder2() && d.file_key == std::string("embedding_dropout"));
    if (hf.spec.family != "gpt2" && std::string(d.key) == "model.dropout" && !embedding_too &&
        !(own && d.file_key == std::string(own))) {
      if (p->get<double>() > 0)
        say_or_print(say, "note: " + file + "'s " + given + " is not applied: keel's " +
                              hf.spec.architecture() +
                              (own ? " drops its sublayers' outputs by model.dropout (" +
                                         std::string(own) + "'s), not its embedding"
                                   : std::string(" has no residual or embedding dropout")) +
                              " (HF's applies it while training)");
      continue;
    }
    say_or_print(say, "note: " + file + "'s " + given + " (HF trains with it) differs from " +
                          d.key + " = " + nlohmann::json(d.value).dump() +
                          (d.value == 0 ? " (no dropout)" : "") + "; set " + d.key + " = " +
                          p->dump() + " to train as HF does");
  }
}

// HF trains a mixture of experts with config.json's load-balancing loss (router_aux_loss_coef
// times it, where output_router_logits is set); keel with model.router_aux_loss_coef, which the
// config decides: a difference is said, as the dropouts' are. On a dense model the key is an error.
void take_router_loss(io::HfConfig& hf, const Config& cfg, const Say& say) {
  const double coef = cfg.model.router_aux_loss_coef;
  const std::string file = cfg.model.path + "/config.json";
  if (hf.spec.moe.experts == 0) {
    if (coef > 0)
      throw Error("model.router_aux_loss_coef = " + nlohmann::json(coef).dump() +
                      " weighs a mixture of experts' load-balancing loss, but " + file + " is " +
                      hf.spec.architecture() +
                      ", a dense model (no router); remove model.router_aux_loss_coef",
                  Error::kUsage);
    return;
  }
  if (hf.spec.moe.aux_coef != coef) {
    const std::string given = hf.spec.moe.aux_coef > 0
                                  ? "output_router_logits = true with router_aux_loss_coef = " +
                                        nlohmann::json(hf.spec.moe.aux_coef).dump()
                                  : std::string("output_router_logits = false");
    say_or_print(say, "note: " + file + "'s " + given + " (HF trains " +
                          (hf.spec.moe.aux_coef > 0 ? "with" : "without") +
                          " the router's load-balancing loss) differs from "
                          "model.router_aux_loss_coef = " +
                          nlohmann::json(coef).dump() + "; set model.router_aux_loss_coef = " +
                          nlohmann::json(hf.spec.moe.aux_coef).dump() + " to train as HF does");
  }
  hf.spec.moe.aux_coef = coef;
}

// MB = 10^6 bytes, as keel memory and keel doctor print theirs: the load note stands beside their
// figures (doctor prints both), and in MiB a 2.47 GB base read "2357 MB" against "2533.5 MB".
std::string mb(size_t bytes) { return std::to_string((bytes + 500000) / 1000000) + " MB"; }

}  // namespace

std::unique_ptr<models::CausalLM> build_model(const Config& cfg, const data::Tokenizer& tok,
                                              int64_t pad_id, DType param_dtype, const Say& say) {
  const bool adapted = cfg.model.adapter.kind != "none";
  // The frozen base's dtype under an adapter (model.base_dtype; f32 = the parameters' dtype).
  const DType base_dt = cfg.model.base_dtype == "bf16" ? DType::BF16 : param_dtype;
  std::unique_ptr<models::CausalLM> m;
  models::ModelSpec random_spec;  // set when the base was drawn by random_base
  int64_t attached = 0;           // base tensors attach_hf_weights took from the files
  const host_memory::ProcessMemory before = host_memory::process_memory();
  if (!cfg.model.path.empty()) {
    io::HfConfig hf = io::read_hf_config(cfg.model.path);
    check_shape_keys_match(cfg.model, hf.spec, cfg.model.path);
    hf.spec.param_dtype = param_dtype;
    hf.spec.attention = ops::attention_backend_from_name(cfg.model.attention);
    hf.spec.dropout = cfg.model.dropout;
    hf.spec.attention_dropout = cfg.model.attention_dropout;
    say_file_dropouts(hf, cfg, say);
    take_router_loss(hf, cfg, say);
    const io::WeightCheck check{cfg.model.allow_nonfinite_weights,
                                [&](const std::string& w) { say_or_print(say, w); }};
    if (adapted && !io::is_keel_checkpoint(cfg.model.path)) {
      // A frozen base: each parameter takes its file's tensor (a view of the mapping, or one
      // converted tensor), never a freshly initialized f32 model copied over.
      m = models::make_causal_lm_for_loading(hf.spec);
      const io::LoadedWeights w = io::attach_hf_weights(*m, cfg.model.path, check);
      attached = w.tensors;
    } else if (adapted) {
      // A keel checkpoint under a new adapter (a second stage): its model's merged tensors
      // themselves, its base held in bf16 when this run's is.
      m = models::make_causal_lm_for_loading(hf.spec);
      io::attach_checkpoint_weights(*m, cfg.model.path, check,
                                    base_dt == DType::BF16 && param_dtype == DType::F32);
    } else {
      // Full fine-tuning (an HF directory or a keel checkpoint): parameters of their own, copied
      // from the mapped files one tensor at a time.
      m = models::make_causal_lm(hf.spec, cfg.run.seed);
      io::load_hf_weights(*m, cfg.model.path, check);
    }
    if (hf.spec.family == "gpt2" && cfg.data.seq_len > hf.spec.max_seq_len)
      throw Error("data.seq_len = " + std::to_string(cfg.data.seq_len) + " exceeds " +
                      cfg.model.path + "/config.json's n_positions = " +
                      std::to_string(hf.spec.max_seq_len) + "; lower data.seq_len",
                  Error::kUsage);
    // Past its window a Mistral attends to the last sliding_window positions only, which keel's
    // CUDA attention does not do yet (the CPU's slides): the run would stop at its first step.
    if (hf.spec.sliding_window > 0 && cfg.data.seq_len > hf.spec.sliding_window &&
        cfg.run.device.rfind("cuda", 0) == 0)
      throw Error(
          "data.seq_len = " + std::to_string(cfg.data.seq_len) + " exceeds " + cfg.model.path +
              "/config.json's sliding_window = " + std::to_string(hf.spec.sliding_window) +
              ", and keel's CUDA attention does not slide yet (the CPU's does): lower "
              "data.seq_len to " +
              std::to_string(hf.spec.sliding_window) + " or less, or set run.device = \"cpu\"",
          Error::kUsage);
    // Gemma-2's capped attention scores: the CPU kernels cap them, CUDA's do not yet.
    if (hf.spec.attn_softcap > 0 && cfg.run.device.rfind("cuda", 0) == 0)
      throw Error(
          cfg.model.path + "/config.json's attn_logit_softcapping = " +
              [&] {
                char v[32];
                std::snprintf(v, sizeof v, "%g", hf.spec.attn_softcap);
                return std::string(v);
              }() +
              " caps the attention's scores, which keel's CUDA attention does not do yet "
              "(the CPU's does): set run.device = \"cpu\"",
          Error::kUsage);
    // A mixture of experts routes and combines on the CPU only (backend/moe.h): refused before
    // loading, not at the first step's forward (without a usable GPU the run falls back to the
    // CPU, where it runs).
    if (hf.spec.moe.experts > 0 && cfg.run.device.rfind("cuda", 0) == 0 && cuda::status().usable)
      throw Error(cfg.model.path + "/config.json is a mixture of experts (" +
                      hf.spec.architecture() + ", " + std::to_string(hf.spec.moe.experts) +
                      " experts a layer), whose routing keel runs on the CPU only (no CUDA "
                      "kernels for it yet): set run.device = \"cpu\"",
                  Error::kUsage);
    // RoPE has no table to run off, so a Llama trains past max_position_embeddings; its positions
    // beyond it were never trained (nor, without rope_scaling, meant to be used), and keel eval
    // and generate keep to it. Said once, so that a long data.seq_len is a choice.
    if (hf.spec.family == "llama" && cfg.data.seq_len > hf.spec.max_seq_len)
      say_or_print(say, "note: data.seq_len = " + std::to_string(cfg.data.seq_len) + " exceeds " +
                            cfg.model.path + "/config.json's max_position_embeddings = " +
                            std::to_string(hf.spec.max_seq_len) +
                            ": rows are trained at positions the model was not, and keel eval "
                            "and generate stop at " +
                            std::to_string(hf.spec.max_seq_len) +
                            "; lower data.seq_len to keep to the model's context, or raise "
                            "max_position_embeddings (with rope_scaling) in config.json to "
                            "extend it");
  } else {
    if (cfg.model.router_aux_loss_coef > 0)
      throw Error(
          "model.router_aux_loss_coef = " + nlohmann::json(cfg.model.router_aux_loss_coef).dump() +
              " weighs a mixture of experts' load-balancing loss, but a model built from "
              "the [model] sizes is dense; set model.path to a mixture's directory (keel "
              "init-model --family qwen3_moe, olmoe or mixtral writes one), or remove "
              "model.router_aux_loss_coef",
          Error::kUsage);
    const models::ModelSpec spec = model_spec(cfg, tok.vocab_size(), param_dtype);
    if (adapted && param_dtype == DType::F32 && base_dt != DType::F32) {
      random_spec = spec;
      m = random_base(spec, cfg.run.seed, base_dt, pad_id >= spec.vocab_size);
    } else {
      m = models::make_causal_lm(spec, cfg.run.seed);
    }
  }
  const int64_t V = m->spec().vocab_size;
  if (tok.vocab_size() > V)
    throw Error("the tokenizer (" + cfg.data.tokenizer + ") has " +
                    std::to_string(tok.vocab_size()) + " ids but the model's vocabulary has " +
                    std::to_string(V) + " rows; use the model's own tokenizer" +
                    (cfg.model.path.empty() ? " or raise model.vocab_size" : ""),
                Error::kUsage);
  if (pad_id >= V) {
    // The new rows are rounded into the embedding's dtype: f32, or the base dtype itself, as they
    // would be by the f32 model's cast. A mapped f16 embedding is widened first.
    for (auto& [name, p] : m->named_parameters())
      if (models::is_vocabulary_parameter(name) && p.dtype() != param_dtype && p.dtype() != base_dt)
        Tensor(p).attach_storage(p.to_dtype(param_dtype));
    models::resize_token_embeddings(*m, pad_id + 1);
    say_or_print(say,
                 "data.pad = \"add\": the tokenizer has no usable pad token; padding uses "
                 "the new id " +
                     std::to_string(pad_id) + " (embeddings resized from " + std::to_string(V) +
                     " to " + std::to_string(pad_id + 1) +
                     " rows, the new row the mean of the others)");
  }
  if (adapted) {
    nn::AdapterOptions adapter = cfg.model.adapter;
    adapter.seed = cfg.run.seed;
    nn::apply_adapters(*m, adapter);
    if (random_spec.vocab_size > 0) dora_magnitudes_from_f32_draws(*m, random_spec, cfg.run.seed);
    // Tensor by tensor: a mapped tensor of another dtype is converted and its pages dropped; a
    // mapped tensor already in base_dt stays a view of the file.
    nn::cast_frozen_parameters(*m, base_dt);
    if (cfg.model.base_dtype == "bf16") {
      // The f32 blocks freed by the cast (a base from a keel checkpoint, the replayed embeddings)
      // are not asked for again by a training step: unmap them instead of keeping them cached.
      host_memory::empty_cache();
    }
  }
  if (attached > 0) {
    // What the frozen base is now: views of the files, or tensors of its own (converted into
    // base_dt, transposed, misaligned, grown).
    int64_t mapped = 0;
    size_t mapped_bytes = 0, own_bytes = 0;
    for (auto& [name, p] : m->named_parameters()) {
      if (p.requires_grad()) continue;
      (p.is_external() ? mapped_bytes : own_bytes) += p.nbytes();
      mapped += p.is_external();
    }
    const host_memory::ProcessMemory after = host_memory::process_memory();
    say_or_print(say, "model.path: " + std::to_string(mapped) + " of " + std::to_string(attached) +
                          " base tensors used from the file mapping without a copy (" +
                          mb(mapped_bytes) + "), " + mb(own_bytes) + " converted or copied into " +
                          dtype_name(base_dt) + "; peak resident memory while loading +" +
                          mb(after.peak_rss > before.rss ? after.peak_rss - before.rss : 0));
  }
  m->set_activation_checkpointing(activation_checkpointing_blocks(cfg.train));
  return m;
}

std::unique_ptr<optim::Optimizer> build_optimizer(
    const Config& cfg, const std::vector<std::pair<std::string, Tensor>>& trainable) {
  auto groups = optim::make_param_groups(trainable, cfg.optim.weight_decay);
  if (cfg.optim.name == "adamw") {
    optim::AdamWOptions o = cfg.optim.adamw;
    o.stochastic_rounding = cfg.optim.stochastic_rounding;
    o.seed = cfg.run.seed;
    return std::make_unique<optim::AdamW>(std::move(groups), o);
  }
  if (cfg.optim.name == "sgd") {
    optim::SGDOptions o = cfg.optim.sgd;
    o.stochastic_rounding = cfg.optim.stochastic_rounding;
    o.seed = cfg.run.seed;
    return std::make_unique<optim::SGD>(std::move(groups), o);
  }
  throw Error("optim.name = \"" + cfg.optim.name + "\": use adamw or sgd", Error::kUsage);
}

std::unique_ptr<GradScaler> build_scaler(const Config& cfg, const PrecisionPolicy& policy) {
  if (!policy.scaler || !cfg.scaler.enabled) return nullptr;
  return std::make_unique<GradScaler>(cfg.scaler);
}

std::vector<std::string> weights_beyond_compute_format(models::CausalLM& model,
                                                       const PrecisionPolicy& policy,
                                                       const std::string& weights_dir) {
  if (policy.compute_dtype != DType::F16 || policy.kind == Precision::k32True) return {};
  constexpr double kOverflow = 65520;  // halfway to 2^16: rounds to inf, ties to even
  std::vector<Tensor> cast;            // handles: named_parameters() returns a temporary list
  for (nn::Module* m : model.modules())
    if (auto* lin = dynamic_cast<nn::Linear*>(m)) cast.push_back(lin->weight);
  if (model.spec().tie_embeddings)
    for (auto& [name, p] : model.named_parameters())
      if (name == "transformer.wte.weight" || name == "model.embed_tokens.weight")
        cast.push_back(p);
  std::vector<std::string> out;
  for (const Tensor& w : cast) {
    if (!w.defined() || w.numel() == 0 || !dtype_is_floating(w.dtype())) continue;
    const TensorStats st =
        monitor_kernels(w.device()).stats(w.data(), w.dtype(), w.numel(), w.dtype());
    if (st.nan + st.inf == 0 && st.abs_max < kOverflow) continue;
    // Rare: find the first such value on a CPU copy, for its index.
    const Tensor host = w.to(Device::cpu()).to_dtype(DType::F32);
    const float* v = static_cast<const float*>(host.data());
    int64_t first = 0, count = 0;
    for (int64_t i = 0; i < host.numel(); ++i)
      if (!(std::fabs(v[i]) < kOverflow) && !std::isnan(v[i]) && count++ == 0) first = i;
    if (count == 0) continue;  // NaN only: loaded under model.allow_nonfinite_weights, said there
    // The user knows the weight as the file holds it: its layout (GPT-2's Conv1D weights are
    // [in, out] in an HF file, [out, in] here) and its value (a bf16 base holds 1e5 as 99840).
    const Shape index = shape_index(w.shape(), first);
    std::optional<io::FileElement> in_file;
    if (!weights_dir.empty())
      in_file = io::file_element(model.spec(), weights_dir, w.name(), index);
    char value[32];
    std::snprintf(value, sizeof value, "%.6g", in_file ? in_file->value : double{v[first]});
    const bool stored_f16 = w.dtype() == DType::F16;
    const std::string where =
        !in_file ? shape_str(index)
                 : shape_str(in_file->index) +
                       (in_file->tensor == w.name() ? "" : " of " + in_file->tensor) + " in " +
                       in_file->file;
    out.push_back(
        w.name() + " holds " + std::to_string(count) + " value" + (count == 1 ? "" : "s") +
        " beyond f16's largest finite 65504 (" +
        // keel's first of several transposed values need not be the file's first
        (in_file && in_file->index != index && count > 1 ? "one of them " : "the first ") +
        (stored_f16 && !in_file                 ? std::string("already inf in its f16 copy")
         : !in_file && w.dtype() == DType::BF16 ? std::string(value) + " as its bf16 copy holds it"
                                                : std::string(value)) +
        " at " + where + "): train.precision = " + policy.name() + " computes its " +
        "matmuls in f16, where " + (stored_f16 ? "it is" : "it becomes") +
        " inf, so the first step is non-finite; switch train.precision to bf16-mixed (f32's " +
        "range) or 32-true, or correct the weight");
  }
  return out;
}

Run build_run(const Config& cfg, const RunOptions& o) {
  Run r;
  r.cfg = cfg;
  if (cfg.run.threads > 0) {
    std::string capped;
    omp_set_num_threads(capped_threads(cfg.run.threads, "run.threads", &capped));
    if (!capped.empty()) say_or_print(o.say, "keel: " + capped);
  }
  r.device = run_device(cfg, o.say);
  r.policy = resolve_precision(cfg.train.precision, r.device, cfg.train.allow_cpu_bf16);
  r.out_dir = cfg.run.out_dir.empty() ? "out/" + utc_time(kUtcDirName) : cfg.run.out_dir;

  try {
    r.data = build_data(cfg);
  } catch (const Error& e) {
    if (!o.data_optional || cfg.data.task == "arith") throw;
    // The model needs the tokenizer (its vocabulary and pad id), not the training file.
    // Either file may be the missing one: the note names both (e.what() says which).
    r.not_rebuilt.push_back(
        "the training data (data.path = " + cfg.data.path +
        (cfg.data.eval_path.empty() ? "" : ", data.eval_path = " + cfg.data.eval_path) +
        "): " + e.what());
    r.data = RunData{};
    r.data.tokenizer = data::load_tokenizer(cfg.data.tokenizer);
    r.data.pad_id =
        pad_fill_id(*r.data.tokenizer, cfg.data.pad, rows_get_no_pad_row(cfg, *r.data.tokenizer));
  }
  // Validation on the training file itself (another spelling of its path too) measures how well
  // the run memorized it, not how it generalizes: said, as HF Trainer users expect a warning, not
  // refused (a smoke test may do it on purpose).
  std::error_code same_ec;
  if (r.data.train && r.data.eval && !cfg.data.eval_path.empty() &&
      std::filesystem::equivalent(cfg.data.path, cfg.data.eval_path, same_ec))
    say_or_print(o.say, "note: data.eval_path = " + cfg.data.eval_path +
                            " is the training file data.path = " + cfg.data.path +
                            ": the eval loss is measured on the data the run trains on and says "
                            "nothing about generalization; give a held-out file, or "
                            "data.eval_fraction to hold out part of data.path");
  if (r.data.train) {
    r.loader = std::make_unique<data::DataLoader>(*r.data.train, cfg.train.batch_size,
                                                  cfg.data.seq_len, r.data.pad_id, cfg.data.shuffle,
                                                  cfg.run.seed, cfg.data.padding == "longest");
    // A step's global window: grad_accum micro-batches per rank (rank_micro_batches).
    const int64_t global_window = cfg.train.grad_accum * o.world_size;
    r.steps_per_epoch = (r.loader->batches_per_epoch() + global_window - 1) / global_window;
  }
  r.total_steps =
      cfg.train.max_steps > 0 ? cfg.train.max_steps : r.steps_per_epoch * cfg.train.epochs;

  // Parameters in the policy's dtype (f32 masters in the mixed policies), then padding and
  // adapters (only they train: the frozen base is excluded here).
  r.model = build_model(cfg, *r.data.tokenizer, r.data.pad_id, r.policy.param_dtype, o.say);
  for (const std::string& w : weights_beyond_compute_format(*r.model, r.policy, cfg.model.path))
    say_or_print(o.say, "warning: " + w);
  r.base_ref = saved_base_reference(*r.model, cfg);
  if (r.device.is_cuda()) nn::move_to_device(*r.model, r.device);
  r.trainable = r.model->named_parameters(/*trainable_only=*/true);
  r.optimizer = build_optimizer(cfg, r.trainable);
  r.optimizer->use_flat_grads();  // every gradient a view of one buffer (optim/optimizer.h)
  r.schedule =
      optim::make_lr_schedule(cfg.sched.name, cfg.optim.lr, r.total_steps, cfg.sched.warmup_steps,
                              cfg.sched.warmup_ratio, cfg.sched.min_lr_ratio);
  // [model.adapter]'s keys do nothing without a kind: a run with r = 32 and kind = "none" (the
  // default) was a full fine-tune without a word. Said, not refused: switching kind off for a
  // baseline with the section left as it was is a fair thing to do.
  if (const nn::AdapterOptions& a = cfg.model.adapter, d{}; a.kind == "none") {
    std::vector<std::string> set;
    if (a.r != d.r) set.push_back("r");
    if (a.alpha != d.alpha) set.push_back("alpha");
    if (a.dropout != d.dropout) set.push_back("dropout");
    if (a.target_modules != d.target_modules) set.push_back("target_modules");
    std::string keys;
    for (const std::string& k : set) keys += (keys.empty() ? " " : ", ") + k;
    if (!set.empty())
      say_or_print(o.say, "note: [model.adapter]" + keys +
                              " set, but model.adapter.kind = \"none\": this run trains every "
                              "parameter, with no adapter; set model.adapter.kind (lora, dora or "
                              "lokr) to train one");
  }
  // Keys that the run's other choices leave unread: each trained as without it, without a word.
  // Said, as the adapter keys are: a precision, task or adapter switched for a comparison with the
  // sections left as they were is fair.
  const std::vector<std::string> scaler_keys = {"scaler.init_scale",
                                                "scaler.growth_factor",
                                                "scaler.backoff_factor",
                                                "scaler.growth_interval",
                                                "scaler.min_scale",
                                                "scaler.max_scale",
                                                "scaler.hysteresis",
                                                "scaler.consecutive_hysteresis",
                                                "scaler.max_consecutive_skips"};
  const std::string& inject_module = cfg.debug.inject.module;
  const data::Tokenizer& tok = *r.data.tokenizer;
  const bool own_pad = tok.pad_id() >= 0 && !data::pad_collides(tok, tok.pad_id());
  const struct {
    bool unread;
    std::vector<std::string> keys;
    std::string why;
  } unread[] = {
      {r.policy.kind != Precision::k16Mixed, scaler_keys,
       "this run's precision, " + r.policy.name() +
           ", has no loss scaler (16-mixed alone has one), so [scaler] does nothing"},
      {r.policy.kind == Precision::k16Mixed && !cfg.scaler.enabled, scaler_keys,
       "scaler.enabled = false turns the loss scaler off, so the rest of [scaler] does nothing"},
      {cfg.data.task != "arith",
       {"data.num_examples", "data.eval_examples", "data.digits", "data.arith_reverse"},
       "data.task = \"" + cfg.data.task +
           "\": these keys shape the built-in arith task only (this task's validation split is "
           "data.eval_path or data.eval_fraction)"},
      {cfg.model.adapter.kind == "none",
       {"model.base_dtype"},
       "model.adapter.kind = \"none\": it stores a base frozen under an adapter; every "
       "parameter of this run trains in " +
           std::string(dtype_name(r.policy.param_dtype))},
      {cfg.train.precision != "auto",
       {"train.allow_cpu_bf16"},
       "train.precision = \"" + cfg.train.precision +
           "\": it lets precision = \"auto\" alone pick bf16-mixed"},
      {inject_module.empty(),
       {"debug.inject.step", "debug.inject.kind", "debug.inject.factor", "debug.inject.only_rank"},
       "debug.inject.module = \"\": nothing is injected; name the module whose output to "
       "corrupt"},
      // abort_after_batch_num = 3 without the tracer ran to the end, as HF's would have stopped.
      {!cfg.debug.underflow_overflow.enabled,
       {"debug.underflow_overflow.max_frames_to_save", "debug.underflow_overflow.trace_batch_nums",
        "debug.underflow_overflow.abort_after_batch_num"},
       "debug.underflow_overflow.enabled = false: the tracer is off, so it neither traces nor "
       "stops the run; set debug.underflow_overflow.enabled = true"},
      // model.init_std = 0.5 over model.path trained the file's weights as loaded.
      {!cfg.model.path.empty(),
       {"model.init_std"},
       "model.path's weights are loaded, not drawn: it scales a random init only"},
      // data.pad = "eos" beside a tokenizer with a pad token of its own padded with that token.
      {own_pad,
       {"data.pad"},
       "the tokenizer has a pad token of its own (id " + std::to_string(tok.pad_id()) +
           "), which padding uses; data.pad decides only for one without"},
      // run.resume_force = true alone started from scratch: it only loosens a resume's checks.
      {!cfg.run.resume,
       {"run.resume_force"},
       "run.resume = false: nothing is resumed, so there is no checkpoint to force; set "
       "run.resume = true to continue the run in run.out_dir"},
      {cfg.train.max_steps > 0,
       {"train.epochs"},
       "train.max_steps = " + std::to_string(cfg.train.max_steps) +
           " sets the run's length: train.epochs counts only when train.max_steps is 0"},
      {!inject_module.empty() && cfg.debug.inject.kind != "scale",
       {"debug.inject.factor"},
       "debug.inject.kind = \"" + cfg.debug.inject.kind +
           "\": the factor multiplies the output under kind = \"scale\" only"},
  };
  for (const auto& u : unread) {
    if (!u.unread) continue;
    const std::vector<std::string> set = keys_off_default(cfg, u.keys);
    std::string keys;
    for (const std::string& k : set) keys += (keys.empty() ? "" : ", ") + k;
    if (!set.empty()) say_or_print(o.say, "note: " + keys + " set, but " + u.why);
  }
  // log.keep_checkpoints prunes the step-N directories of log.checkpoint_every: with none written,
  // a run that set it to bound its disk use did nothing about it without a word. Said, as the
  // adapter keys are: turning checkpoint_every off for a short run is fair.
  if (cfg.log.keep_checkpoints > 0 && cfg.log.checkpoint_every == 0)
    say_or_print(o.say, "note: log.keep_checkpoints = " + std::to_string(cfg.log.keep_checkpoints) +
                            " keeps the newest checkpoints/step-N directories, but "
                            "log.checkpoint_every = 0 writes none (only checkpoints/last, at the "
                            "end); set log.checkpoint_every to save every N steps");
  // A step-numbered debug key past the run's last step never acts: debug.inject.step = 100 in a
  // 2-step run trained clean, and a tracer's abort_after_batch_num or trace_batch_nums past the end
  // neither stopped nor traced, each without a word, and the run looked like a failed
  // reproduction. Said, with what did not happen.
  if (r.total_steps > 0) {
    if (!inject_module.empty())
      say_past_last_step(o.say, "debug.inject.step", {cfg.debug.inject.step}, false, r.total_steps,
                         "nothing is injected");
    const auto& uo = cfg.debug.underflow_overflow;
    if (uo.enabled) {
      if (uo.abort_after_batch_num >= 0)
        say_past_last_step(o.say, "debug.underflow_overflow.abort_after_batch_num",
                           {uo.abort_after_batch_num}, false, r.total_steps,
                           "the run ends at its last step without the tracer's stop");
      say_past_last_step(o.say, "debug.underflow_overflow.trace_batch_nums", uo.trace_batch_nums,
                         true, r.total_steps, "those batches are never traced");
    }
  }
  // A warmup as long as the run never reaches optim.lr: said, with the rate the run peaks at.
  if (r.schedule.warmup_steps > 0 && r.total_steps > 0 &&
      r.schedule.warmup_steps >= r.total_steps) {
    char peak[32];
    std::snprintf(peak, sizeof peak, "%.3g", r.schedule.lr(r.total_steps - 1));
    say_or_print(o.say,
                 "note: the warmup (" + std::to_string(r.schedule.warmup_steps) +
                     " steps, sched.warmup_steps / sched.warmup_ratio) is not shorter than " +
                     "the run (" + std::to_string(r.total_steps) +
                     " steps): the learning rate peaks at " + peak +
                     ", below optim.lr, and never decays; shorten the warmup or train longer");
  }
  r.scaler = build_scaler(cfg, r.policy);
  return r;
}

}  // namespace keel
