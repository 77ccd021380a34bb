// `keel generate` end to end: from an HF directory, a run's checkpoint (or its out_dir) and a base
// plus a PEFT adapter directory, the CLI's tokens are the library's (io::load_trained_model +
// models::generate), streamed text equals the --json text, stop strings and eos stop it, the
// cache changes nothing, `model.path` accepts a checkpoint (adapters merged), and every bad input
// is a usage error naming the path or flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "keel/data/tokenizer_base.h"
#include "keel/io/trained_model.h"
#include "keel/models/generate.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// A tiny Llama (GQA) with peaked logits, vocab 259 (the byte tokenizer), once per binary.
const std::string& base_dir() {
  static const std::string dir = [] {
    const std::string d = test::temp_dir("gen-base") + "/llama";
    const test::KeelRun r = test::run_keel(
        {"init-model", "--family", "llama", "--out", d, "--n-layer", "2", "--n-embd", "32",
         "--n-head", "4", "--n-kv-head", "2", "--max-seq-len", "48", "--init-std", "0.3"});
    EXPECT_EQ(r.code, 0) << r.output;
    return d;
  }();
  return dir;
}

// A LoRA fine-tune of base_dir() (10 steps of the built-in task), once per binary.
const std::string& lora_run() {
  static const std::string out = [] {
    const std::string dir = test::temp_dir("gen-lora");
    std::ofstream(dir + "/c.toml")
        << "[run]\nout_dir = \"" << dir << "/out\"\nthreads = 1\n[model]\npath = \"" << base_dir()
        << "\"\n[model.adapter]\nkind = \"lora\"\nr = 4\ntarget_modules = [\"q_proj\", "
           "\"v_proj\"]\n[data]\nnum_examples = 64\neval_examples = 4\nseq_len = 24\n"
           "[train]\nbatch_size = 8\nmax_steps = 10\n[optim]\nlr = 5e-2\n"
           "[log]\ntensorboard = false\n";
    const test::KeelRun r = test::run_keel({"train", dir + "/c.toml"}, {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    return dir + "/out";
  }();
  return out;
}

// The tiny GPT-2 and Llama-style tokenizers (290 ids) of the tokenizer parity tests.
const std::string kTinyTokenizers =
    std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";

// A one-layer Llama with their 290 ids, in a temp directory named after `name`; "" on failure.
std::string wide_model(const std::string& name) {
  const std::string d = test::temp_dir(name) + "/llama";
  const test::KeelRun r =
      test::run_keel({"init-model", "--family", "llama", "--out", d, "--n-layer", "1", "--n-embd",
                      "16", "--n-head", "2", "--vocab-size", "290"});
  EXPECT_EQ(r.code, 0) << r.output;
  return r.code == 0 ? d : "";
}

json generate_json(std::vector<std::string> args) {
  args.insert(args.begin(), "generate");
  args.push_back("--json");
  const test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 0) << r.output;
  return r.code == 0 ? json::parse(r.out) : json::object();
}

std::vector<int32_t> library_tokens(const std::string& model, const std::string& adapter,
                                    const std::string& prompt, int64_t n,
                                    models::GenerateOptions o = {}) {
  io::TrainedModel t = io::load_trained_model(model, adapter);
  const auto tok = data::load_tokenizer("byte");
  o.max_new_tokens = n;
  o.eos_ids = {tok->eos_id()};
  return models::generate(*t.model, tok->encode(prompt), o).tokens;
}

// Weights whose f16 activations overflow (initialized with std 20): greedy decoding over NaN
// logits printed bytes with exit 0. Now generation stops there, exit 1, naming the wider
// precision, which is finite.
TEST(CliGenerate, NonFiniteLogitsStopWithAnErrorNamingTheWiderPrecision) {
  const std::string d = test::temp_dir("gen-wide") + "/gpt2";
  ASSERT_EQ(test::run_keel({"init-model", "--family", "gpt2", "--out", d, "--n-layer", "2",
                            "--n-embd", "64", "--n-head", "2", "--init-std", "20"})
                .code,
            0);
  const std::vector<std::string> gen = {"generate",         d,   "hello", "--tokenizer", "byte",
                                        "--max-new-tokens", "4", "--json"};
  std::vector<std::string> f16 = gen;
  f16.insert(f16.end(), {"--precision", "16-true"});
  test::KeelRun r = test::run_keel(f16, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 1) << r.output;
  const json j = json::parse(r.out);
  EXPECT_EQ(j.at("stop"), "nonfinite");
  EXPECT_TRUE(j.at("tokens").empty());
  EXPECT_CONTAINS(r.err, "generation stopped before new token 1: ");
  EXPECT_CONTAINS(r.err, "of its 259 logits are NaN or inf");
  EXPECT_CONTAINS(r.err, "under --precision 16-true: try --precision bf16-mixed or 32-true");
  r = test::run_keel(gen, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(json::parse(r.out).at("tokens").size(), 4u);
}

TEST(CliGenerate, HfDirectoryGreedyEqualsTheLibraryAndStreamsTheSameText) {
  const json j =
      generate_json({base_dir(), "The cat", "--tokenizer", "byte", "--max-new-tokens", "12"});
  const auto want = library_tokens(base_dir(), "", "The cat", 12);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), want);
  EXPECT_EQ(j["prompt_tokens"], 7);
  // The streamed text (stdout, without --json) is the text of the same tokens; without the cache
  // too. (--json's text replaces bytes that are not UTF-8; stdout has them as they are.)
  const std::string text = data::load_tokenizer("byte")->decode(want);
  for (const char* cache : {"", "--no-cache"}) {
    std::vector<std::string> args = {"generate", base_dir(),         "The cat", "--tokenizer",
                                     "byte",     "--max-new-tokens", "12"};
    if (*cache) args.push_back(cache);
    const test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.out, text + "\n") << cache;
    EXPECT_CONTAINS(r.err, "tokens after a 7-token prompt");
  }
}

// Standard output that cannot be written: > /dev/full, or a pipe whose reader is gone (`| head`,
// here `| true`, which has exited before keel starts). Generation went on to --max-new-tokens for
// no reader and exited 0 (or keel died of SIGPIPE); now it stops at the first failed write with
// exit 1 and says why.
TEST(CliGenerate, AFullDiskOrAClosedPipeOnStdoutStopsWithAnError) {
  const std::string gen = test::keel_binary() + " generate '" + base_dir() +
                          "' 'The cat' --tokenizer byte --max-new-tokens 40";
  test::KeelRun r = test::run_command({"/bin/sh", "-c", gen + " > /dev/full"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "cannot write standard output: No space left on device");
  EXPECT_CONTAINS(r.err, "generation stopped after 1 new token");
  r = test::run_command(
      {"/bin/sh", "-c", "{ sleep 0.3; " + gen + "; echo \"exit $?\" >&2; } | true"});
  EXPECT_CONTAINS(r.err, "exit 1");
  EXPECT_CONTAINS(r.err, "the pipe was closed");
  EXPECT_EQ(r.err.find("tokens after a"), std::string::npos) << r.err;  // no summary of success
}

// The status line gave "5 tokens ... in 0.142 s (2051.9 tokens/s)": the seconds held the prompt's
// pass, the rate did not. Now each figure is over its own part.
TEST(CliGenerate, TheStatusLineTimesThePromptPassAndTheDecodeApart) {
  const test::KeelRun r = test::run_keel(
      {"generate", base_dir(), "The cat", "--tokenizer", "byte", "--max-new-tokens", "5"},
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "keel: 5 tokens after a 7-token prompt: prompt pass ");
  EXPECT_CONTAINS(r.err, " s, the next 4 tokens in ");
  EXPECT_CONTAINS(r.err, " tokens/s); stopped: max_new_tokens");
  const json one =
      generate_json({base_dir(), "The cat", "--tokenizer", "byte", "--max-new-tokens", "1"});
  EXPECT_GT(one["prompt_seconds"].get<double>(), 0);
  EXPECT_EQ(one["decode_tokens_per_s"], 0);
  const test::KeelRun single = test::run_keel(
      {"generate", base_dir(), "The cat", "--tokenizer", "byte", "--max-new-tokens", "1"});
  EXPECT_CONTAINS(single.err, "keel: 1 token after a 7-token prompt: prompt pass ");
  EXPECT_NOT_CONTAINS(single.err, "the next");
}

// `echo "ab" | keel generate` prompted "ab\n": the line's newline became the prompt's last token.
// One trailing newline of stdin or --prompt-file is dropped; the argument is taken as it is.
TEST(CliGenerate, OneTrailingNewlineOfStdinOrAPromptFileIsNotPartOfThePrompt) {
  const std::string dir = test::temp_dir("generate-newline");
  const std::vector<std::string> flags = {"--tokenizer", "byte", "--max-new-tokens", "4"};
  auto tokens_of = [&](std::vector<std::string> args) {
    args.insert(args.begin(), base_dir());
    args.insert(args.end(), flags.begin(), flags.end());
    return generate_json(args);
  };
  const json plain = tokens_of({"ab"});
  for (const char* text : {"ab\n", "ab\r\n", "ab"}) {
    std::ofstream(dir + "/p.txt", std::ios::binary) << text;
    const json file = tokens_of({"--prompt-file", dir + "/p.txt"});
    EXPECT_EQ(file["prompt_tokens"], 2) << text;
    EXPECT_EQ(file["tokens"], plain["tokens"]) << text;
    const test::KeelRun piped =
        test::run_keel_sh("generate " + base_dir() +
                          " --tokenizer byte --max-new-tokens 4 --json < " + dir + "/p.txt");
    ASSERT_EQ(piped.code, 0) << piped.output;
    EXPECT_EQ(json::parse(piped.out)["prompt_tokens"], 2) << text;
  }
  // Only one: a blank line the file ends with is the user's.
  std::ofstream(dir + "/p.txt", std::ios::binary) << "ab\n\n";
  EXPECT_EQ(tokens_of({"--prompt-file", dir + "/p.txt"})["prompt_tokens"], 3);
  EXPECT_EQ(tokens_of({"ab\n"})["prompt_tokens"], 3);  // the argument keeps its newline
  const test::KeelRun help = test::run_keel({"generate", "--help"});
  EXPECT_CONTAINS(help.out, "less one trailing newline");
}

TEST(CliGenerate, CheckpointOutDirAndAdapterDirectoryGiveTheSameTokens) {
  const std::string out = lora_run();
  const std::string prompt = "12+34=";
  const auto want = library_tokens(out + "/checkpoints/last", "", prompt, 8);
  for (const std::string& model : {out, out + "/checkpoints/last"}) {
    const json j = generate_json({model, prompt, "--max-new-tokens", "8"});  // the run's tokenizer
    EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), want) << model;
    EXPECT_EQ(j["tokenizer"], "byte");
  }
  // The base with the run's PEFT adapter directory is the same model.
  const json a = generate_json({base_dir(), prompt, "--adapter", out + "/adapter", "--tokenizer",
                                "byte", "--max-new-tokens", "8"});
  EXPECT_EQ(a["tokens"].get<std::vector<int32_t>>(), want);
  // The adapter changed the model: the base alone decodes differently.
  EXPECT_NE(library_tokens(base_dir(), "", prompt, 8), want);
}

TEST(CliGenerate, StopStringsSamplingAndPrecisions) {
  const auto tok = data::load_tokenizer("byte");
  const std::string text = tok->decode(library_tokens(base_dir(), "", "ab", 16));
  ASSERT_GE(text.size(), 4u);
  // Stop at the text's 3rd byte: what comes out is the text before it.
  const std::string stop = text.substr(2, 2);
  const json s = generate_json(
      {base_dir(), "ab", "--tokenizer", "byte", "--max-new-tokens", "16", "--stop", stop});
  EXPECT_EQ(s["stop"], "stop_string");
  const test::KeelRun r = test::run_keel({"generate", base_dir(), "ab", "--tokenizer", "byte",
                                          "--max-new-tokens", "16", "--stop", stop});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.out, text.substr(0, text.find(stop)) + "\n");
  // --stop takes one string: the prompt after it stays the prompt (it became a second stop
  // string, and the prompt was read from stdin: "the prompt is empty").
  const test::KeelRun before = test::run_keel({"generate", base_dir(), "--tokenizer", "byte",
                                               "--max-new-tokens", "16", "--stop", stop, "ab"});
  ASSERT_EQ(before.code, 0) << before.output;
  EXPECT_EQ(before.out, r.out);
  const test::KeelRun empty =
      test::run_keel({"generate", base_dir(), "ab", "--tokenizer", "byte", "--stop", ""});
  EXPECT_EQ(empty.code, 2) << empty.output;
  EXPECT_CONTAINS(empty.err, "--stop: \"\": an empty string would never stop");
  // A stop string that begins in the prompt ("b") and ends in the first new byte stops there,
  // before any text: only the new text was searched, and it never fired.
  const std::string across = "b" + text.substr(0, 1);
  ASSERT_NE(text.substr(0, 2), across);
  const json a = generate_json(
      {base_dir(), "ab", "--tokenizer", "byte", "--max-new-tokens", "16", "--stop", across});
  EXPECT_EQ(a["stop"], "stop_string");
  EXPECT_EQ(a["text"], "");
  EXPECT_EQ(a["tokens"].size(), 1u);
  EXPECT_NOT_CONTAINS(empty.err, "--stop: --stop");
  // Seeded sampling is reproducible; the seed matters.
  auto sample = [&](const char* seed) {
    return generate_json({base_dir(), "ab", "--tokenizer", "byte", "--max-new-tokens", "16",
                          "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed",
                          seed})["tokens"];
  };
  EXPECT_EQ(sample("1"), sample("1"));
  EXPECT_NE(sample("1"), sample("2"));
  // HF's repetition_penalty and min_p: the library's decode with the same options.
  models::GenerateOptions penalized;
  penalized.max_new_tokens = 16;
  penalized.sampling.repetition_penalty = 1.8;
  penalized.sampling.temperature = 0.9;
  penalized.sampling.min_p = 0.05;
  penalized.seed = 3;
  const json p = generate_json({base_dir(), "ab", "--tokenizer", "byte", "--max-new-tokens", "16",
                                "--repetition-penalty", "1.8", "--temperature", "0.9", "--min-p",
                                "0.05", "--seed", "3"});
  EXPECT_EQ(p["tokens"].get<std::vector<int32_t>>(),
            library_tokens(base_dir(), "", "ab", 16, penalized));
  // Other policies and backends run and decode as many tokens.
  const json b = generate_json({base_dir(), "ab", "--tokenizer", "byte", "--max-new-tokens", "16",
                                "--precision", "bf16-mixed", "--attention", "flash"});
  EXPECT_EQ(b["precision"], "bf16-mixed");
  EXPECT_EQ(b["tokens"].size(), 16u);
}

TEST(CliGenerate, ModelPathAcceptsACheckpointWithItsAdaptersMerged) {
  const std::string out = lora_run();
  const std::string dir = test::temp_dir("gen-from-ckpt");
  // Train on from the checkpoint with lr 1e-30 (no weight moves): its weights are the merged
  // adapted model.
  const test::KeelRun r = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + dir + "/out", "run.threads=1",
                                  "model.path=" + out + "/checkpoints/last", "optim.lr=1e-30",
                                  "train.max_steps=1", "data.seq_len=24", "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto want = library_tokens(out, "", "12+34=", 8);
  EXPECT_EQ(generate_json({dir + "/out", "12+34=", "--max-new-tokens", "8"})["tokens"]
                .get<std::vector<int32_t>>(),
            want);
}

TEST(CliGenerate, BadInputIsAUsageErrorNamingThePathOrFlag) {
  auto err = [](std::vector<std::string> args, int code = 2) {
    args.insert(args.begin(), "generate");
    const test::KeelRun r = test::run_keel(args);
    EXPECT_EQ(r.code, code) << r.output;
    return r.err;
  };
  EXPECT_CONTAINS(err({"/no/such/model", "x"}), "/no/such/model: no such directory");
  const std::string empty = test::temp_dir("gen-empty");
  EXPECT_CONTAINS(err({empty, "x"}), "neither a model directory");
  EXPECT_CONTAINS(err({base_dir(), "x"}), "give --tokenizer");
  // An empty prompt says where it was read and that --bos starts without one.
  EXPECT_CONTAINS(err({base_dir(), "", "--tokenizer", "byte"}),
                  "the prompt is empty (the PROMPT argument held no text): give a prompt, or "
                  "--bos to start from the tokenizer's bos token");
  // A directory with tokenizer files keel cannot use says which: Llama-2's SentencePiece
  // tokenizer.model, or GPT-2's vocab.json without its merges, read as "no tokenizer.json".
  const std::string partial = test::temp_dir("gen-partial-tok") + "/m";
  fs::copy(base_dir(), partial);
  std::ofstream(partial + "/vocab.json") << "{}";
  EXPECT_CONTAINS(err({partial, "x"}), "it holds vocab.json but not the BPE merges");
  std::ofstream(partial + "/tokenizer.model") << "sp";
  EXPECT_CONTAINS(err({partial, "x"}), "its tokenizer.model is a SentencePiece model");
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "/no/tok"}), "/no/tok");
  EXPECT_CONTAINS(err({base_dir(), std::string(60, 'a'), "--tokenizer", "byte"}),
                  "the prompt has 60 tokens but the model's max_seq_len is 48");
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--top-p", "1.5"}), "--top-p");
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--min-p", "1"}), "--min-p");
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--repetition-penalty", "0"}),
                  "--repetition-penalty");
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--min-p", "0.1"}),
                  "--min-p 0.1 cuts the tokens sampled from, but --temperature 0 decodes greedily");
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--max-new-tokens", "-1"}),
                  "--max-new-tokens: -1: use a whole number from 0 to 9223372036854775807 (0: the "
                  "prompt alone)");
  for (const char* seed : {"-1", "18446744073709551616", "99999999999999999999999"})
    EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--seed", seed}),
                    std::string("--seed: ") + seed + ": use a whole number from 0 to");
  // A seed under greedy decoding was accepted and ignored.
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--seed", "7"}),
                  "--seed 7 seeds the sampling, but --temperature 0 decodes greedily");
  EXPECT_CONTAINS(err({base_dir(), "x", "--tokenizer", "byte", "--adapter", "/no/adapter"}),
                  "--adapter /no/adapter");
  EXPECT_CONTAINS(err({lora_run(), "x", "--adapter", lora_run() + "/adapter"}),
                  "already carries the lora adapters");
  EXPECT_CONTAINS(err({base_dir(), "--tokenizer", "byte", "--prompt-file", "/no/prompt.txt"}),
                  "--prompt-file /no/prompt.txt");
  const std::string dir_prompt = test::temp_dir("gen-prompt-dir");  // was basic_filebuf's message
  EXPECT_CONTAINS(err({base_dir(), "--tokenizer", "byte", "--prompt-file", dir_prompt}),
                  "--prompt-file " + dir_prompt + ": is a directory; give a text file");
  // --bos with a tokenizer that has none was dropped without a word (GPT-2's files name no bos).
  const std::string wide = wide_model("gen-wide");
  ASSERT_FALSE(wide.empty());
  const std::string gpt2 = "gpt2:" + kTinyTokenizers;
  EXPECT_CONTAINS(err({wide, "x", "--tokenizer", gpt2, "--bos"}),
                  "--bos: the tokenizer (" + gpt2 + ") has no bos token");
  // An adapter on another base than its own: the shape error blamed the adapter ("the adapter
  // expects [4, 16]"); it now names the base the adapter was trained on.
  EXPECT_CONTAINS(err({wide, "x", "--tokenizer", "byte", "--adapter", lora_run() + "/adapter"}, 1),
                  "/adapter_config.json names base_model_name_or_path \"" + base_dir() +
                      "\", not " + wide + ": an adapter loads on the model it was trained on");
  // A checkpoint of an older keel (no config.json) says how to get one.
  const std::string old = test::temp_dir("gen-old") + "/last";
  fs::copy(lora_run() + "/checkpoints/last", old);
  fs::remove(old + "/config.json");
  EXPECT_CONTAINS(err({old, "x"}), "has no config.json describing its model");
}

// A prompt starts as the tokenizer's convention starts every text (Llama-3's <|begin_of_text|>,
// here the tiny Llama-style tokenizer's template token), as keel's datasets trained the model and
// as transformers and llama.cpp start it; a prompt written with it gets no second one, --no-bos
// leaves it out.
TEST(CliGenerate, APromptStartsWithTheTokenTheTokenizerPutsBeforeEveryText) {
  const std::string model = wide_model("gen-prefix");
  ASSERT_FALSE(model.empty());
  const std::string hf = "hf:" + kTinyTokenizers + "/llama_style";
  const auto tok = data::load_tokenizer(hf);
  ASSERT_GE(tok->prefix_id(), 0);
  const auto plain = static_cast<int64_t>(tok->encode("the there").size());
  auto prompt_tokens = [&](std::vector<std::string> more) {
    std::vector<std::string> args = {model, "the there",        "--tokenizer",
                                     hf,    "--max-new-tokens", "1"};
    args.insert(args.end(), more.begin(), more.end());
    return generate_json(args).at("prompt_tokens").get<int64_t>();
  };
  EXPECT_EQ(prompt_tokens({}), plain + 1);
  EXPECT_EQ(prompt_tokens({"--no-bos"}), plain);
  const std::string tagged = tok->id_to_token(tok->prefix_id()) + "the there";
  EXPECT_EQ(generate_json({model, tagged, "--tokenizer", hf, "--max-new-tokens", "1"})
                .at("prompt_tokens")
                .get<int64_t>(),
            plain + 1);
  const test::KeelRun both = test::run_keel(
      {"generate", model, "x", "--tokenizer", hf, "--bos", "--no-bos"}, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(both.code, 2) << both.output;
  EXPECT_CONTAINS(both.err, "--bos and --no-bos contradict each other");
  // GPT-2's tokenizer puts nothing first.
  const std::string gpt2 = "gpt2:" + kTinyTokenizers;
  EXPECT_EQ(generate_json({model, "the there", "--tokenizer", gpt2, "--max-new-tokens", "1"})
                .at("prompt_tokens")
                .get<int64_t>(),
            static_cast<int64_t>(data::load_tokenizer(gpt2)->encode("the there").size()));
}

// generation_config.json's eos_token_id ends a reply as the tokenizer's eos does
// (Llama-3.1-Instruct ends a turn with <|eot_id|>, not its tokenizer's <|end_of_text|>), and export
// copies the file.
TEST(CliGenerate, GenerationConfigEosIdsStopTheReplyAndTravelWithAnExport) {
  const std::string model = test::temp_dir("gen-config") + "/llama";
  fs::copy(base_dir(), model);
  const json free = generate_json({model, "12+", "--tokenizer", "byte", "--max-new-tokens", "6"});
  const auto tokens = free.at("tokens").get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 6u);
  // The first token that does not occur before it ends the reply there.
  size_t at = 1;
  while (at < tokens.size() &&
         std::find(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(at), tokens[at]) !=
             tokens.begin() + static_cast<std::ptrdiff_t>(at))
    ++at;
  ASSERT_LT(at, tokens.size()) << "greedy decoding repeated one token";
  std::ofstream(model + "/generation_config.json")
      << json({{"eos_token_id", json::array({100000, tokens[at]})}}).dump();
  const json stopped =
      generate_json({model, "12+", "--tokenizer", "byte", "--max-new-tokens", "6"});
  EXPECT_EQ(stopped.at("stop"), "eos");
  EXPECT_EQ(stopped.at("tokens").get<std::vector<int32_t>>(),
            std::vector<int32_t>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(at)));
  const test::KeelRun e =
      test::run_keel({"export", model, "--out", model + "-hf"}, {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_EQ(test::slurp(model + "-hf/generation_config.json"),
            test::slurp(model + "/generation_config.json"));
  std::ofstream(model + "/generation_config.json") << R"({"eos_token_id": "</s>"})";
  const test::KeelRun bad =
      test::run_keel({"generate", model, "12+", "--tokenizer", "byte"}, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_CONTAINS(bad.err, model + "/generation_config.json: eos_token_id");
}

// A checkpoint whose adapter files are damaged names the file that is: a missing
// adapter_config.json read as if the checkpoint were a --adapter directory ("expected a PEFT
// adapter directory, e.g. a run's out_dir/adapter"), and an edited r blamed config.json.
TEST(CliGenerate, ACheckpointWithDamagedAdapterFilesNamesTheFile) {
  const std::string ck = test::temp_dir("gen-damaged") + "/last";
  fs::copy(lora_run() + "/checkpoints/last", ck);
  json cfg = json::parse(test::slurp(ck + "/adapter_config.json"));
  cfg["r"] = 2;
  std::ofstream(ck + "/adapter_config.json") << cfg.dump();
  test::KeelRun r = test::run_keel({"generate", ck, "x"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "is [4, 32], " + ck + "/adapter_config.json implies [2, 32]");
  EXPECT_CONTAINS(r.err, "the checkpoint is damaged");
  fs::remove(ck + "/adapter_config.json");
  r = test::run_keel({"generate", ck, "x"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, ck + "/adapter_config.json is missing, though " + ck +
                             "/config.json says the checkpoint holds adapters");
  EXPECT_NOT_CONTAINS(r.err, "PEFT adapter directory");
}

}  // namespace
}  // namespace keel
