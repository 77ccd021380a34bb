// `keel export MODEL --out DIR`: a run's checkpoint (or an HF directory, with --adapter a PEFT
// adapter on it) as a Hugging Face model directory — config.json, model.safetensors in HF's names
// and layouts (GPT-2's Conv1D weights transposed back), sharded above --max-shard-size, the
// tokenizer files when the run's tokenizer has them — with the adapters merged, in --dtype; or,
// with --adapter-only, the PEFT adapter directory alone.
#include <cstdio>
#include <filesystem>

#include "apps/keel/commands.h"
#include "apps/keel/model_args.h"
#include "apps/keel/output_dir.h"
#include "keel/data/tokenizer_base.h"
#include "keel/io/atomic_file.h"
#include "keel/io/hf_model.h"
#include "keel/io/trained_model.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/numerics/text.h"

namespace keel::cli {

namespace fs = std::filesystem;

namespace {
struct ExportArgs {
  std::string model, adapter, base, out, dtype = "f32", max_shard = "0";
  bool adapter_only = false, allow_nonfinite_weights = false;
};

// "5GB", "500MB", "64KiB", "1000" (bytes); 0 = one file.
int64_t parse_size(const std::string& s) {
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
  }
  // Decimal only: stod also read "0x10" as 16 bytes and " 5" as 5.
  if (s.substr(0, used).find_first_not_of("0123456789.eE+-") != std::string::npos) v = -1;
  std::string unit = s.substr(used);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::pair<const char*, double> units[] = {
      {"", 1},     {"B", 1},      {"KB", 1e3},      {"MB", 1e6},
      {"GB", 1e9}, {"KIB", 1024}, {"MIB", 1048576}, {"GIB", 1073741824.0}};
  // Below 2^62 bytes: inf, 1e20 or 2^63 would overflow the conversion (undefined behaviour).
  constexpr double kMaxBytes = 0x1p62;
  for (auto& [name, mult] : units)
    if (v >= 0 && unit == name) {
      if (!(v * mult < kMaxBytes))
        throw Error("--max-shard-size " + s + ": larger than any file; give 0 for one file",
                    Error::kUsage);
      // Truncated to 0 bytes, 0.5 meant "one file", the opposite of what was asked.
      if (v > 0 && v * mult < 1)
        throw Error("--max-shard-size " + s +
                        ": below one byte; give a size such as 2GB, or 0 for one file",
                    Error::kUsage);
      return static_cast<int64_t>(v * mult);
    }
  throw Error("--max-shard-size " + s + ": give a size such as 2GB, 500MB or 1000000 (bytes)",
              Error::kUsage);
}

// The directory of a load_tokenizer spec's files ("" for "byte" or none).
std::string tokenizer_dir(const std::string& spec) {
  std::string path = spec;
  for (const char* prefix : {"gpt2:", "hf:"})
    if (path.rfind(prefix, 0) == 0) path = path.substr(std::string(prefix).size());
  if (spec.empty() || spec == "byte") return "";
  return fs::is_directory(path) ? path : fs::path(path).parent_path().string();
}

// The tokenizer files of a load_tokenizer spec, each with the name it gets in the export: an
// hf: spec naming a file (data.tokenizer = "hf:DIR/my_tok.json") becomes tokenizer.json, the name
// loaders look for (it was skipped: the export held tokenizer_config.json alone). OpenAI's GPT-2
// files (encoder.json, vocab.bpe) are transformers' vocab.json and merges.txt byte for byte under
// other names: copied as they were, the export's tokenizer did not load in transformers.
std::vector<std::pair<fs::path, std::string>> tokenizer_files(const std::string& spec) {
  const std::string dir = tokenizer_dir(spec);
  if (dir.empty()) return {};
  std::vector<std::pair<fs::path, std::string>> out;
  const std::string path = spec.rfind("hf:", 0) == 0 ? spec.substr(3) : "";
  if (!path.empty() && fs::is_regular_file(path)) out.emplace_back(path, "tokenizer.json");
  auto has = [&](const std::string& f) { return fs::is_regular_file(fs::path(dir) / f); };
  for (const std::string& f : kTokenizerFiles) {
    if (!has(f) || (f == "tokenizer.json" && !out.empty())) continue;
    const std::string hf_name = f == "encoder.json" ? "vocab.json"
                                : f == "vocab.bpe"  ? "merges.txt"
                                                    : f;
    if (hf_name != f && has(hf_name)) continue;  // the directory has transformers' own
    out.emplace_back(fs::path(dir) / f, hf_name);
  }
  return out;
}

int run_export(const ExportArgs& a) {
  if (a.dtype != "f32" && a.dtype != "bf16")
    throw Error("--dtype " + a.dtype + ": use f32 or bf16", Error::kUsage);
  const int64_t shard = parse_size(a.max_shard);
  // The merged model's options: with --adapter-only they were taken and ignored (an f32 adapter in
  // one file, whatever was asked).
  if (a.adapter_only && a.dtype != "f32")
    throw Error("--dtype " + a.dtype +
                    " applies to the merged model; --adapter-only writes the adapter's weights "
                    "in f32: drop --dtype (or --adapter-only)",
                Error::kUsage);
  if (a.adapter_only && shard != 0)
    throw Error("--max-shard-size " + a.max_shard +
                    " applies to the merged model; --adapter-only writes the adapter as one "
                    "file, adapter_model.safetensors: drop --max-shard-size (or --adapter-only)",
                Error::kUsage);
  std::vector<std::pair<std::string, std::string>> inputs = {
      {"MODEL", a.model}, {"the --adapter directory", a.adapter}, {"the --base directory", a.base}};
  const ModelDirKind writes = a.adapter_only ? ModelDirKind::kPeftAdapter : ModelDirKind::kModel;
  check_output_dir("--out", a.out, inputs, writes);  // before loading: a refusal costs nothing
  // A bf16 export of a run that held its base in bf16 merges into that base as held (each merged
  // weight rounded once, as the f32 merge's save would round it): an 8B base is not built in f32.
  // --adapter-only writes the adapters (and a grown embedding) as the run held them: the base
  // stays as the run held it too. It was converted to f32 for nothing: 4.9 GB of peak RSS to
  // write the seed's 61 MB 1B adapter over its 2.47 GB bf16 base.
  const bool hold_base = a.dtype == "bf16" || a.adapter_only;
  io::TrainedModel t;
  hold_weights_checked(
      a.model + " exported in " + a.dtype,
      [&] {
        t = io::attach_trained_model(a.model, a.adapter, DType::F32, ops::AttentionBackend::kEager,
                                     weight_check_of_flag(a.allow_nonfinite_weights), a.base);
        return io::bytes_to_hold(t, DType::F32, hold_base);
      },
      [&]() -> std::string {
        if (!hold_base && t.base_dtype == DType::BF16)
          return "--dtype bf16 merges into the base in bf16, as the run held it, without an f32 "
                 "copy of it";
        return "use a machine with more memory";
      },
      [&] { io::hold_parameters(t, DType::F32, hold_base); });
  // What MODEL turned out to hold: the weights' directory, a checkpoint's frozen base, the
  // tokenizer's files.
  inputs.insert(inputs.end(), {{"the model's weights", t.dir},
                               {"the model the run started from (its model.path)", t.base_model},
                               {"the tokenizer's files", tokenizer_dir(t.tokenizer)}});
  check_output_dir("--out", a.out, inputs, writes);
  // The base an adapter goes on: the run's model.path, or the directory --adapter was applied to
  // (a checkpoint it was trained on too: its PEFT export named the checkpoint's own base, on which
  // it is another model, and the checkpoint refused it as carrying adapters already).
  const std::string base_model = t.checkpoint && !t.merged_base ? t.base_model : t.dir;
  if (a.adapter_only) {
    if (!t.adapter)
      throw Error(a.model +
                      " has no adapters to export (--adapter-only needs a run trained with "
                      "model.adapter.kind, or --adapter DIR)",
                  Error::kUsage);
    // Staged and moved in like the merged model: save_peft_adapter alone replaces its directory
    // whole (a run's out_dir/adapter), which took every file of --out with it.
    // The run's precision, base dtype and tokenizer travel with it (a run's adapter used away from
    // its run computed under 32-true with an f32 base, whatever the run had).
    io::AdapterRunRecord record;
    record.precision = io::run_precision(a.model, a.adapter);
    if (!record.precision.empty()) {
      record.base_dtype = t.base_dtype.value_or(DType::F32);
      record.tokenizer = t.tokenizer;
    }
    write_model_dir("--out", a.out, [&](const std::string& dir) {
      io::save_peft_adapter(*t.model, *t.adapter, dir, base_model, record);
    });
    std::printf("wrote %s: PEFT %s adapter (r = %lld) for %s\n", a.out.c_str(),
                t.adapter->kind.c_str(), static_cast<long long>(t.adapter->r),
                base_model.empty() ? "(a base trained from sizes)" : base_model.c_str());
    return 0;
  }
  const int64_t merged = t.adapter ? nn::merge_adapters(*t.model) : 0;
  io::HfSaveOptions opt;
  opt.dtype = a.dtype == "bf16" ? DType::BF16 : DType::F32;
  opt.max_shard_bytes = shard;
  std::string tok_note = "no tokenizer known; copy its files beside the weights";
  if (!t.tokenizer.empty()) {
    const auto tok = data::load_tokenizer(t.tokenizer);
    for (auto [key, id] : {std::pair{"bos_token_id", tok->bos_id()},
                           {"eos_token_id", tok->eos_id()},
                           {"pad_token_id", tok->pad_id()}})
      if (id >= 0) opt.base_config[key] = id;
    tok_note = "tokenizer " + t.tokenizer;
  }
  auto files = tokenizer_files(t.tokenizer);
  const size_t tokenizer_file_count = files.size();
  // The base's generation_config.json (the ids that end a reply, sampling defaults), as
  // transformers' save_pretrained writes one beside the weights.
  for (const std::string& from : {t.dir, t.base_model})
    if (!from.empty() && fs::is_regular_file(fs::path(from) / "generation_config.json")) {
      files.emplace_back(fs::path(from) / "generation_config.json", "generation_config.json");
      break;
    }
  write_model_dir("--out", a.out, [&](const std::string& dir) {
    io::save_hf_model(*t.model, dir, opt);
    // Written as the weights are (fsynced before the directory is renamed into place): a copy
    // left to the page cache could be empty after a crash, beside complete weights.
    for (const auto& [from, name] : files)
      io::write_file_atomic((fs::path(dir) / name).string(), io::read_file(from.string()));
  });
  if (t.tokenizer == "byte")
    tok_note = "keel's byte tokenizer (no HF tokenizer files; in keel: --tokenizer byte)";
  else if (!t.tokenizer.empty())
    tok_note += " (" + count_of(static_cast<long long>(tokenizer_file_count), "file") + " copied)";
  // A run without adapters said "0 adapted modules merged", as if a merge had failed.
  const std::string merge_note =
      t.adapter ? count_of(merged, "adapted module") + " merged" : "no adapters to merge";
  std::printf("wrote %s: %s, %s, %s, %s\n", a.out.c_str(), t.model->spec().architecture().c_str(),
              merge_note.c_str(), a.dtype.c_str(), tok_note.c_str());
  return 0;
}
}  // namespace

Command add_export(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* sub = app.add_subcommand(
      "export", "Write a run's checkpoint as a Hugging Face directory (adapters merged)");
  sub->add_option("MODEL", a->model,
                  "checkpoint directory (OUT_DIR/checkpoints/last), OUT_DIR or HF directory")
      ->required();
  sub->add_option("--out", a->out, "the directory to write")->required();
  sub->add_option("--adapter", a->adapter, "a PEFT adapter directory to apply to MODEL first");
  sub->add_option("--base", a->base,
                  "where the frozen base of an adapter run's checkpoint is now, if it moved");
  sub->add_option("--dtype", a->dtype, "stored dtype: f32 | bf16")->capture_default_str();
  sub->add_option("--max-shard-size", a->max_shard,
                  "shards of at most this size with model.safetensors.index.json (0: one file)")
      ->capture_default_str();
  sub->add_flag("--allow-nonfinite-weights", a->allow_nonfinite_weights,
                "export weights that hold nan/inf (by default an error naming the tensor)");
  sub->add_flag("--adapter-only", a->adapter_only,
                "write only the PEFT adapter directory (adapter_config.json + weights)");
  return {sub, [a] { return run_export(*a); }};
}

}  // namespace keel::cli
