// `keel memory [--model DIR | --config FILE] [--set section.key=value ...] [--params N]
// [--precision P --optimizer O --batch B --seq T --grad-accum K --layers L --hidden H --heads N
// --kv-heads N --head-dim D --ffn F --vocab V --tie-embeddings B --family F --attention A
// --adapter KIND --r R --targets a,b --adapter-dropout P --base-dtype D
// --checkpointing none|blocks|N] [--json]`:
// weights, gradients, optimizer state, low-precision copies and activations of a training step.
// A model directory gives the sizes of its config.json (and its weight files); a config gives
// everything `keel train` would run (the same estimate as its check before loading and as
// `keel doctor`); the flags override either, except the model's sizes and family, which a model
// directory gives (a flag that contradicts it is refused). keel/monitor/memory_estimate.h has the
// model.
#include <cmath>
#include <cstdio>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "apps/keel/commands.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/numerics/error.h"

namespace keel::cli {

namespace {
struct MemoryArgs {
  std::string params, model, config, checkpointing;
  std::vector<std::string> sets;
  monitor::MemoryQuery q;  // the flags' values (applied over the model/config when given)
  bool json = false;
  // Every flag that sets a query field, with how it sets it: applied when given.
  std::vector<std::pair<CLI::Option*, std::function<void(monitor::MemoryQuery&)>>> fields;
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
  // Decimal only: stod also read "0x10" as 16.
  if (num.find_first_not_of("0123456789.eE+-") != std::string::npos) used = 0;
  if (used == 0 || used != num.size() || !(v * mult >= 1) || !std::isfinite(v))
    throw Error("memory --params " + s + ": give a positive count such as 124000000, 100M or 1.5B",
                Error::kUsage);
  if (v * mult > 1e15)  // llround beyond int64 is unspecified: 1e30 became a negative count
    throw Error("memory --params " + s + ": at most 1e15 parameters (1000000B)", Error::kUsage);
  return static_cast<int64_t>(std::llround(v * mult));
}

template <class T>
void field(MemoryArgs& a, CLI::App* sub, const std::string& flag, T monitor::MemoryQuery::*m,
           const std::string& help, FlagCheck check = nullptr) {
  CLI::Option* o = sub->add_option(flag, a.q.*m, help);
  if (check) o->check(check);
  a.fields.push_back({o, [&a, m](monitor::MemoryQuery& q) { q.*m = a.q.*m; }});
}

template <class T>
void adapter_field(MemoryArgs& a, CLI::App* sub, const std::string& flag, T nn::AdapterOptions::*m,
                   const std::string& help, FlagCheck check = nullptr) {
  CLI::Option* o = sub->add_option(flag, a.q.adapter.*m, help);
  if (check) o->check(check);
  a.fields.push_back({o, [&a, m](monitor::MemoryQuery& q) { q.adapter.*m = a.q.adapter.*m; }});
}
}  // namespace

Command add_memory(CLI::App& app) {
  auto a = std::make_shared<MemoryArgs>();
  CLI::App* sub = app.add_subcommand(
      "memory", "Estimate weights, grads, optimizer state and activations of a training step");
  sub->add_option("--model", a->model, "HF model directory: the sizes of its config.json");
  sub->add_option("--config", a->config, "run config (TOML): the run keel train would start");
  sub->add_option("--set", a->sets, "override a config key: section.key=value (repeatable)")
      ->allow_extra_args(false);
  CLI::Option* params = sub->add_option("--params", a->params,
                                        "parameter count (100M, 1.5B, ...); default: from sizes");
  MemoryArgs& r = *a;
  field(r, sub, "--precision", &monitor::MemoryQuery::precision,
        "32-true | bf16-mixed | 16-mixed | bf16-true | 16-true (default 32-true)");
  field(r, sub, "--optimizer", &monitor::MemoryQuery::optimizer, "adamw | sgd (default adamw)");
  field(r, sub, "--batch", &monitor::MemoryQuery::batch, "micro-batch size B",
        config_check("train.batch_size", true));
  field(r, sub, "--seq", &monitor::MemoryQuery::seq, "sequence length T",
        config_check("data.seq_len", true));
  field(r, sub, "--grad-accum", &monitor::MemoryQuery::grad_accum,
        "micro-batches per optimizer step (default 1)", config_check("train.grad_accum", true));
  field(r, sub, "--layers", &monitor::MemoryQuery::layers, "transformer layers L",
        config_check("model.n_layer", true));
  field(r, sub, "--hidden", &monitor::MemoryQuery::hidden, "hidden size H",
        config_check("model.n_embd", true));
  field(r, sub, "--heads", &monitor::MemoryQuery::heads, "attention heads (default hidden/64)",
        config_check("model.n_head", true));
  field(r, sub, "--kv-heads", &monitor::MemoryQuery::kv_heads,
        "llama: key/value heads (GQA; default: --heads)", config_check("model.n_kv_head", true));
  field(r, sub, "--head-dim", &monitor::MemoryQuery::head_dim,
        "llama: a head's channels (default: --hidden / --heads)",
        config_check("model.head_dim", true));
  field(r, sub, "--tie-embeddings", &monitor::MemoryQuery::tie_embeddings,
        "llama: lm_head shares the embedding (true | false; gpt2 always ties; default true)",
        [](const std::string& v) {  // CLI11 took 5 as true, -1, "" and 0x1 as false
          return v == "true" || v == "false" ? std::string()
                                             : (v.empty() ? "\"\"" : v) + ": use true or false";
        });
  field(r, sub, "--ffn", &monitor::MemoryQuery::ffn, "MLP width (default: the family's rule)",
        config_check("model.intermediate_size", true));
  field(r, sub, "--vocab", &monitor::MemoryQuery::vocab,
        "vocabulary size (default 259, the byte tokenizer)",
        config_check("model.vocab_size", true));
  field(r, sub, "--family", &monitor::MemoryQuery::family, "gpt2 | llama (default gpt2)");
  field(r, sub, "--attention", &monitor::MemoryQuery::attention,
        "eager | math | flash (default eager)");
  field(r, sub, "--base-dtype", &monitor::MemoryQuery::base_dtype,
        "storage of the frozen base under an adapter: f32 | bf16");
  adapter_field(r, sub, "--adapter", &nn::AdapterOptions::kind, "none | lora | dora | lokr");
  adapter_field(r, sub, "--r", &nn::AdapterOptions::r, "adapter rank (default 8)",
                config_check("model.adapter.r", true));
  adapter_field(r, sub, "--adapter-dropout", &nn::AdapterOptions::dropout,
                "LoRA/DoRA input dropout (default 0)",
                config_check("model.adapter.dropout", false));
  CLI::Option* targets = sub->add_option("--targets", a->q.adapter.target_modules,
                                         "adapted modules, e.g. q_proj,v_proj (default)")
                             ->delimiter(',');
  a->fields.push_back({targets, [&r](monitor::MemoryQuery& q) {
                         q.adapter.target_modules = r.q.adapter.target_modules;
                       }});
  CLI::Option* ckpt = sub->add_option("--checkpointing", a->checkpointing,
                                      "activation checkpointing: none | blocks | N (every N "
                                      "blocks; default none)");
  a->fields.push_back({ckpt, [&r](monitor::MemoryQuery& q) {
                         q.checkpoint_every = monitor::parse_checkpointing(
                             r.checkpointing, "memory --checkpointing");
                       }});
  sub->add_flag("--json", a->json, "print one JSON object (bytes)");
  return {sub, [a, sub, params] {
            monitor::MemoryQuery q;
            std::string model_dir;  // --model, or the config's model.path
            if (!a->config.empty() || !a->model.empty() || !a->sets.empty()) {
              Config cfg = load_config(a->config, a->sets);
              if (!a->model.empty()) cfg.model.path = a->model;
              model_dir = cfg.model.path;
              q = monitor::memory_query_from_config(cfg);
            }
            const monitor::MemoryQuery dir_q = q;
            for (auto& [opt, apply] : a->fields)
              if (opt->count() > 0) apply(q);
            // By its count: `--params ""` was taken as "not given".
            if (params->count() > 0) q.params = parse_count(a->params);
            auto given = [&](const char* flag) { return sub->get_option(flag)->count() > 0; };
            // The query's 0 is "not given": --batch 0 or --seq 0 left the activations out and
            // printed an estimate, where keel train refuses those values.
            for (auto [flag, key, v] : {std::tuple{"--batch", "train.batch_size", q.batch},
                                        std::tuple{"--seq", "data.seq_len", q.seq}})
              if (given(flag) && v == 0)
                check_config_number(key, 0, "0", std::string("memory: ") + flag + " 0");
            // A model directory's sizes are its own: --family llama over a GPT-2 directory
            // estimated a Llama of GPT-2's sizes, and named neither. A flag that says the same
            // as the directory does no harm; --params overrides the count its sizes give.
            if (!model_dir.empty()) {
              const std::vector<std::pair<const char*, bool>> shape = {
                  {"--family", q.family == dir_q.family},
                  {"--layers", q.layers == dir_q.layers},
                  {"--hidden", q.hidden == dir_q.hidden},
                  {"--heads", q.heads == dir_q.heads},
                  {"--kv-heads", q.kv_heads == dir_q.kv_heads},
                  {"--head-dim", q.head_dim == dir_q.head_dim ||
                                     (dir_q.head_dim == 0 && q.head_dim * q.heads == q.hidden)},
                  {"--ffn", q.ffn == dir_q.ffn},
                  {"--vocab", q.vocab == dir_q.vocab},
                  {"--tie-embeddings", q.tie_embeddings == dir_q.tie_embeddings},
                  {"--params", params->count() == 0}};
              for (const auto& [flag, same] : shape)
                if (given(flag) && !same)
                  throw Error(std::string("memory ") + flag + " " +
                                  sub->get_option(flag)->as<std::string>() +
                                  ": contradicts the model directory " + model_dir + " (" +
                                  dir_q.source + " gives the model's sizes and family); drop " +
                                  flag +
                                  ", or drop the directory to estimate a model of other sizes",
                              Error::kUsage);
            }
            // The targets' fix is the flag unless a config set them (the default q_proj, v_proj
            // on a GPT-2 model was said to need model.adapter.target_modules, a key of no file).
            if (given("--targets") || (a->config.empty() && a->sets.empty()))
              q.targets_key = "--targets";
            // Flags that do not apply to the step estimated were taken and ignored (gpt2 with
            // --tie-embeddings false, --r 64 without an adapter: the same estimate, exit 0).
            if (q.family == "gpt2")
              for (const char* flag : {"--tie-embeddings", "--kv-heads", "--head-dim"})
                if (given(flag))
                  throw Error(std::string("memory ") + flag +
                                  ": applies to llama; GPT-2 ties lm_head to wte and has no "
                                  "grouped key/value heads, each hidden / heads wide: drop " +
                                  flag + " (or give --family llama)",
                              Error::kUsage);
            if (q.adapter.kind == "none")
              for (const char* flag : {"--r", "--adapter-dropout", "--targets", "--base-dtype"})
                if (given(flag))
                  throw Error(std::string("memory ") + flag +
                                  ": applies to an adapter, and the step has none: give "
                                  "--adapter lora | dora | lokr, or drop " +
                                  flag,
                              Error::kUsage);
            const monitor::MemoryEstimate e = monitor::estimate_memory(q);
            if (a->json)
              std::printf("%s\n", monitor::memory_to_json(e).dump().c_str());
            else
              std::fputs(monitor::format_memory(e).c_str(), stdout);
            return 0;
          }};
}

}  // namespace keel::cli
