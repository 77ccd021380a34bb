// `keel eval MODEL --data FILE`: the loss and perplexity of a model (an HF directory, a run's
// checkpoint or out_dir, optionally with --adapter) on a text, JSONL or llm.c token file, weighted
// over the target tokens exactly as training weighs them (keel/train/eval_loss.h). For a run, the
// data options (seq_len, pack, pad, batch_size, tokenizer) default to those of its config.toml.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "apps/keel/commands.h"
#include "apps/keel/flags.h"
#include "apps/keel/model_args.h"
#include "apps/keel/output_dir.h"
#include "keel/data/dataset.h"
#include "keel/io/atomic_file.h"
#include "keel/io/json_fields.h"
#include "keel/log/console.h"
#include "keel/numerics/input_file.h"
#include "keel/numerics/text.h"
#include "keel/tensor/host_memory.h"
#include "keel/train/config.h"
#include "keel/train/eval_loss.h"
#include "keel/train/run.h"

namespace keel::cli {

namespace fs = std::filesystem;

namespace {
struct EvalArgs {
  ModelArgs m;
  std::string data, task, pad, per_example, chat_date;
  int64_t seq_len = 0, batch_size = 0;
  bool pack = false, json = false;
};

// The config.toml of the run that trained what is evaluated: the run whose OUT_DIR/adapter is
// --adapter (an HF base with it was evaluated in rows of the base's max_seq_len, up to 1024,
// unpacked, not the run's data.seq_len: another loss than the run's eval_loss), else the run a
// checkpoint directory belongs to (OUT_DIR/checkpoints/NAME); nullopt for an HF directory or a
// PEFT directory of no run (--seq-len and --pack say what it trained with).
std::optional<Config> run_config(const io::TrainedModel& t) {
  if (!t.adapter_run.empty()) return load_config(t.adapter_run + "/config.toml");
  if (!t.checkpoint) return std::nullopt;
  const fs::path file = fs::path(t.dir).parent_path().parent_path() / "config.toml";
  if (!fs::exists(file)) return std::nullopt;
  return load_config(file.string());
}

// Where a non-finite loss comes from: how many batches, and which examples of the first are
// non-finite alone (their file and line), or that none is alone.
std::string where_nonfinite(const LossTotal& r, models::CausalLM& model, const data::Dataset& set,
                            int64_t seq_len, int64_t pad, const ModelForUse& m) {
  const std::vector<int64_t> alone =
      nonfinite_examples(model, set, r.first_nonfinite_batch, seq_len, pad, m.policy, m.device);
  auto names = [&](const std::vector<int64_t>& ids) {
    std::string s;
    for (size_t i = 0; i < ids.size() && i < 5; ++i) s += (i ? ", " : "") + set.where(ids[i]);
    if (ids.size() > 5) s += " and " + std::to_string(ids.size() - 5) + " more";
    return s;
  };
  std::string w = std::to_string(r.nonfinite_batches) + " of " + std::to_string(r.batches) +
                  " batches are non-finite";
  if (!alone.empty() && alone.size() == r.first_nonfinite_batch.size())
    return w + "; every example of the first is non-finite alone (" + names(alone) +
           "): the model, not these examples";
  if (!alone.empty())
    return w + "; of the first's " + std::to_string(r.first_nonfinite_batch.size()) +
           " examples, " + std::to_string(alone.size()) +
           " are non-finite alone, the others finite: " + names(alone);
  return w + "; the first (" + names(r.first_nonfinite_batch) +
         ") is finite example by example: only batched together (padding to the longest)";
}

// Each example's loss as one JSON line, in the data's order, and the highest named: the examples
// the model finds hardest (a mislabeled line, text of another kind) first.
void write_per_example(const std::string& path, const LossTotal& r, const data::Dataset& set,
                       bool quiet) {
  std::string out;
  for (const ExampleLoss& e : r.per_example) {
    const nlohmann::ordered_json line = {
        {"example", e.id},
        {"where", set.where(e.id)},
        {"tokens", e.tokens},
        {"loss", e.tokens > 0 ? nlohmann::ordered_json(
                                    io::json_float(e.loss_sum / static_cast<double>(e.tokens)))
                              : nlohmann::ordered_json()},
        {"loss_sum", nlohmann::ordered_json(io::json_float(e.loss_sum))}};
    out += line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  }
  io::write_file_atomic(path, out);
  if (quiet) return;
  std::vector<const ExampleLoss*> scored;
  for (const ExampleLoss& e : r.per_example)
    if (e.tokens > 0) scored.push_back(&e);
  // Highest first; a non-finite loss above every number.
  auto mean = [](const ExampleLoss* e) {
    const double v = e->loss_sum / static_cast<double>(e->tokens);
    return std::isfinite(v) ? v : std::numeric_limits<double>::infinity();
  };
  std::stable_sort(scored.begin(), scored.end(),
                   [&](const ExampleLoss* x, const ExampleLoss* y) { return mean(x) > mean(y); });
  std::string worst;
  for (size_t i = 0; i < scored.size() && i < 3; ++i)
    worst += std::string(i ? ", " : "") + set.where(scored[i]->id) + " (" +
             log::format_number(scored[i]->loss_sum / static_cast<double>(scored[i]->tokens), 4) +
             ")";
  std::fprintf(stderr, "per-example losses of %s written to %s%s\n",
               count_of(static_cast<int64_t>(r.per_example.size()), "example").c_str(),
               path.c_str(), worst.empty() ? "" : ("; the highest: " + worst).c_str());
}

int run_eval(EvalArgs& a, bool pack_given, bool pad_given) {
  // --pad add|eos was accepted and changed nothing (the same loss to the last bit either way).
  // data.pad matters to training, where "add" grows the embeddings and the output layer by a row
  // (one more logit in every softmax); the model evaluated here holds its rows already, and which
  // id fills a padded position cannot move the loss: the position is masked from attention and
  // carries no label. Refused, not ignored, for the scripts that pass it.
  if (pad_given)
    throw Error(
        "--pad: keel eval takes no padding choice: padded positions are masked and carry no "
        "label, so the id that fills them cannot change the loss (data.pad = \"add\" matters "
        "when training, where it adds a row to the embeddings, and a checkpoint holds that row "
        "already); leave --pad out",
        Error::kUsage);
  // Before the model loads (minutes for a large one); the loader checks again (a pipe will do).
  check_input_file(a.data, "dataset file", "--data");
  // --per-example's file is written when the loss is known (minutes on): checked now.
  if (!a.per_example.empty())
    check_output_file("--per-example", a.per_example, "--data", a.data, "the data with its losses");
  ModelForUse m = load_model_for_use(a.m);
  const io::TrainedModel& t = m.trained;
  const std::optional<Config> run = run_config(t);
  const DataConfig dc = run ? run->data : DataConfig();
  const fs::path extension = fs::path(a.data).extension();
  // A file's extension says more than the task the run trained on. A .json file is JSON Lines,
  // as HF datasets' "json" loader reads it: it was scored as plain text without a word.
  if (a.task.empty())
    a.task = extension == ".bin"                             ? "tokens"
             : extension == ".jsonl" || extension == ".json" ? "jsonl"
             : run && dc.task != "arith"                     ? dc.task
                                                             : "text";
  if (a.task != "text" && a.task != "jsonl" && a.task != "tokens")
    throw Error("--task " + a.task + ": use text, jsonl or tokens (an llm.c token file)",
                Error::kUsage);
  // The row length: examples longer are cut to it (a batch is padded to its longest row only).
  // As HF's run_clm: at most 1024 by default, not a model's whole context (Llama-3's 131,072).
  // Where the row length came from, for the note on truncated examples.
  const std::string seq_len_from =
      a.seq_len != 0 ? "--seq-len"
      : run
          ? (t.adapter_run.empty() ? "the run's data.seq_len" : "the adapter's run's data.seq_len")
          : "the default, the model's max_seq_len up to 1024";
  if (a.seq_len == 0)
    a.seq_len = run ? dc.seq_len : std::min<int64_t>(t.model->spec().max_seq_len, 1024);
  if (a.batch_size == 0) a.batch_size = run ? run->train.batch_size : 8;
  if (a.chat_date.empty() && run) a.chat_date = dc.chat_date;  // conversations as trained
  // Flags that mean nothing for this data were taken without a word.
  if (pack_given && a.task == "tokens")
    throw Error("--pack applies to text and JSONL files; " + a.data +
                    " is read as tokens (a token file's rows are packed already)",
                Error::kUsage);
  // Packed JSONL rows score each example as it scores alone (its own positions and attention):
  // packing only batches them. A run's packing is kept where nothing needs one example a row.
  const bool one_a_row = !a.per_example.empty() || m.device.is_cuda();
  if (!pack_given)
    a.pack = run && dc.pack && dc.task == a.task && !(a.task == "jsonl" && one_a_row);
  if (pack_given && a.task == "jsonl" && one_a_row)
    throw Error(!a.per_example.empty()
                    ? "--pack with --per-example: one loss a line needs one example a row; leave "
                      "--pack out (packing changes the batches, not an example's loss)"
                    : "--pack with a JSONL file: packed examples attend only to themselves "
                      "through their positions, which keel's CUDA attention does not read yet; "
                      "evaluate with --device cpu, or without --pack",
                Error::kUsage);
  // A length the run trained with (a Llama model.path trains past its max_position_embeddings)
  // was reported as "--seq-len 512: ..." to a user who gave no --seq-len.
  if (a.seq_len < 2 || a.seq_len > t.model->spec().max_seq_len)
    throw Error(
        (seq_len_from == "--seq-len" ? "--seq-len " + std::to_string(a.seq_len) + ": use"
                                     : seq_len_from + " is " + std::to_string(a.seq_len) +
                                           ", longer than the model takes: give --seq-len from") +
            " 2 to the model's max_seq_len " + std::to_string(t.model->spec().max_seq_len),
        Error::kUsage);
  if (a.batch_size < 1) throw Error("--batch-size must be >= 1", Error::kUsage);
  const data::Tokenizer& tok = *m.tokenizer;
  const int64_t vocab = t.model->spec().vocab_size;
  // Padded positions are masked and carry no label: any id the model can embed will do when the
  // configured pad has no row (a model whose embeddings were not grown for it). The run's own
  // choice fills them, so that a batch is the one training built.
  int64_t pad = pad_fill_id(tok, dc.pad);
  if (pad >= vocab) pad = tok.eos_id() >= 0 ? tok.eos_id() : 0;
  // A JSONL prompt longer than the rows: the fix is eval's flag (it said "raise data.seq_len", a
  // key of no file here, and "raise" even at the model's max_seq_len).
  const int64_t max_seq_len = t.model->spec().max_seq_len;
  const std::string long_prompt_fix =
      a.seq_len < max_seq_len
          ? "raise --seq-len (now " + std::to_string(a.seq_len) +
                ", at most the model's max_seq_len " + std::to_string(max_seq_len) +
                ") or shorten the prompt"
          : "shorten the prompt (the model's max_seq_len is " + std::to_string(max_seq_len) + ")";
  data::JsonlOptions jsonl;
  jsonl.long_prompt_fix = long_prompt_fix;
  jsonl.chat_date = a.chat_date;
  const auto set = data::load_dataset(a.task, a.data, "--data", tok, a.seq_len, a.pack, jsonl);
  // Examples longer than a row are cut to it (the tokens past it are not scored): they were
  // evaluated cut without a word, and the loss read as the whole file's.
  const int64_t truncated = data::truncated_examples(*set, a.task, a.pack, a.seq_len);
  if (truncated > 0) {
    const std::string fix =
        a.seq_len < max_seq_len
            ? "--seq-len N scores up to N tokens of each (at most the model's max_seq_len, " +
                  std::to_string(max_seq_len) + ")"
            : "the model's max_seq_len is " + std::to_string(max_seq_len) +
                  ", so no --seq-len scores them whole";
    std::fprintf(stderr,
                 "note: %lld of %lld examples of %s are longer than %lld tokens (%s) and were "
                 "truncated to %lld: the tokens past it are not scored; %s\n",
                 static_cast<long long>(truncated), static_cast<long long>(set->size()),
                 a.data.c_str(), static_cast<long long>(a.seq_len), seq_len_from.c_str(),
                 static_cast<long long>(a.seq_len), fix.c_str());
  }
  if (set->left_out() > 0)
    std::fprintf(stderr,
                 "note: %lld conversation replies of %s start past %lld tokens (%s) in the text "
                 "that prompts them (each is a row of its own: the chat template renders earlier "
                 "turns otherwise once later ones follow) and are not scored\n",
                 static_cast<long long>(set->left_out()), a.data.c_str(),
                 static_cast<long long>(a.seq_len), seq_len_from.c_str());
  // The run's eval_loss was computed under its train.precision (eval's default); another
  // --precision moves the loss by rounding, which must not read as another checkpoint or data.
  // A copied adapter's run is not at hand, but its file records the precision.
  const std::string trained_under = run ? run->train.precision : m.run_precision;
  const std::string& recorded_in = m.run_precision_recorded_in;
  if (!trained_under.empty() && trained_under != m.policy.name())
    std::fprintf(stderr,
                 "note: the run trained and computed its eval_loss under %s%s; this evaluation "
                 "is under --precision %s, so its loss differs from the run's by rounding: "
                 "--precision %s evaluates as the run did\n",
                 trained_under.c_str(),
                 recorded_in.empty() ? "" : (" (recorded in " + recorded_in + ")").c_str(),
                 m.policy.name().c_str(), trained_under.c_str());
  LossTotal r;
  try {
    r = dataset_loss(*t.model, *set, a.batch_size, a.seq_len, pad, m.policy, m.device,
                     !a.per_example.empty());
  } catch (const host_memory::OutOfMemory& e) {  // its message names training's keys
    throw Error(
        "out of memory allocating a tensor of " + std::to_string(e.bytes) +
        " bytes while evaluating " + std::to_string(a.batch_size) + " rows of " +
        std::to_string(a.seq_len) +
        " tokens a batch (an example is cut to --seq-len, a batch padded to its longest): lower "
        "--batch-size or --seq-len");
  }
  if (!a.per_example.empty()) write_per_example(a.per_example, r, *set, a.json);
  if (a.json) {
    nlohmann::json j = {{"loss", io::json_float(r.loss())},
                        {"perplexity", io::json_float(r.perplexity())},
                        {"tokens", r.tokens},
                        {"examples", set->examples()},
                        {"rows", r.examples},
                        {"loss_sum", io::json_float(r.loss_sum)},
                        {"seq_len", a.seq_len},
                        {"truncated_examples", truncated},
                        {"batch_size", a.batch_size},
                        {"precision", m.policy.name()}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    const std::string rows =
        set->examples() == r.examples ? "" : " (packed into " + count_of(r.examples, "row") + ")";
    std::printf("loss %.4f | perplexity %.3f | %s in %s%s of %s\n", r.loss(), r.perplexity(),
                count_of(r.tokens, "target token").c_str(),
                count_of(set->examples(), "example").c_str(), rows.c_str(), a.data.c_str());
  }
  if (!std::isfinite(r.loss_sum))  // printed as it is, and an error: scripts test the exit code
    throw Error("the loss on " + a.data + " is " + log::format_number(r.loss(), 4) + ": " +
                where_nonfinite(r, *t.model, *set, a.seq_len, pad, m) + "; " +
                nonfinite_advice(a.m, m.policy));
  return 0;
}
}  // namespace

Command add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* sub = app.add_subcommand(
      "eval", "Loss and perplexity of a model (+ adapter) on a text, JSONL or token file");
  add_model_options(sub, a->m);
  sub->add_option("--data", a->data, "the text, JSONL or llm.c token (.bin) file")->required();
  sub->add_option("--task", a->task,
                  "text | jsonl | tokens (default: by extension, .jsonl/.json or .bin; else the "
                  "run's)");
  const FlagCheck positive = whole_check(1, INT64_MAX, " (leave the flag out for the default)");
  sub->add_option("--seq-len", a->seq_len,
                  "tokens per row (default: the run's data.seq_len, else the model's "
                  "max_seq_len up to 1024)")
      ->check(positive);  // 0 was taken as "the default" without a word
  sub->add_option("--batch-size", a->batch_size, "rows per batch (default: the run's, else 8)")
      ->check(positive);
  CLI::Option* pack = sub->add_flag("--pack", a->pack,
                                    "pack into full rows (data.pack): text as one stream, JSONL "
                                    "examples side by side, each attending to itself");
  // Hidden (group ""): taken only to say why it means nothing here (run_eval).
  CLI::Option* pad = sub->add_option("--pad", a->pad)->group("");
  sub->add_option("--per-example", a->per_example,
                  "also write each example's loss to this JSONL file (example, where, tokens, "
                  "loss), and name the highest");
  sub->add_option("--chat-date", a->chat_date,
                  "the day a chat template's strftime_now writes into conversations, YYYY-MM-DD "
                  "(data.chat_date; default: the run's, else none)")
      ->check(chat_date_check());
  sub->add_flag("--json", a->json, "print one JSON object");
  return {sub, [a, pack, pad] { return run_eval(*a, pack->count() > 0, pad->count() > 0); }};
}

}  // namespace keel::cli
