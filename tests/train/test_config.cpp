#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "keel/numerics/error.h"
#include "keel/train/config.h"
#include "tests/support/check.h"

namespace keel {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// The message of the kUsage Error that `fn` throws ("" and a test failure when it does not).
template <class F>
std::string usage_error(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected a keel::Error";
  return "";
}

std::string load_error(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  const std::string path = write_file(test::temp_dir("config"), "config.toml", toml);
  return usage_error([&] { load_config(path, overrides); });
}

std::string set_error(const std::string& override_) {
  return usage_error([&] { load_config("", {override_}); });
}

TEST(Config, DefaultsWithoutAFile) {
  Config c = load_config("");
  EXPECT_EQ(config_to_toml(c), config_to_toml(Config{}));
  EXPECT_EQ(c.source, "");
  EXPECT_EQ(c.train.precision, "32-true");
  EXPECT_EQ(c.train.batch_size, 32);
  EXPECT_EQ(c.model.adapter.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
}

TEST(Config, ReadsEverySectionIncludingSubtablesDottedKeysAndInlineTables) {
  const std::string dir = test::temp_dir("config");
  const std::string path = write_file(dir, "run.toml", R"(
# a comment
dist.backend = "mpi"        # a dotted key at the top level

[run]
out_dir = "out/x"
seed = 42
resume = true
device = "cuda:1"
threads = 2

[model]
family = "llama"
n_layer = 4
n_embd = 96
n_head = 6
n_kv_head = 2
rope_theta = 500000
attention = "flash"
base_dtype = "bf16"
adapter = { kind = "lora", r = 16, alpha = 32.5, target_modules = ["q_proj", "k_proj", "o_proj"] }

[data]
task = "text"
path = "corpus.txt"
seq_len = 64
pack = true

[train]
precision = "bf16"
batch_size = 8
grad_accum = 4
max_grad_norm = 0.5
on_nonfinite = "skip"
epochs = 3

[optim]
name = "sgd"
lr = 1
momentum = 0.8

[sched]
name = "linear"
warmup_ratio = 0.1

[scaler]
init_scale = 1024.0
hysteresis = 2
min_scale = 1.0
max_scale = 16777216.0

[log]
every = 1
tensorboard = false

[debug]
nan_capture = false

[debug.underflow_overflow]
enabled = true
trace_batch_nums = [1, 3]
abort_after_batch_num = 3

[debug.inject]
module = "h.0.attn"
step = 5
kind = "scale"
factor = 1e4
)");
  Config c = load_config(path);
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.run.out_dir, "out/x");
  EXPECT_EQ(c.run.seed, 42u);
  EXPECT_TRUE(c.run.resume);
  EXPECT_EQ(c.run.device, "cuda:1");
  EXPECT_EQ(c.run.threads, 2);
  EXPECT_EQ(c.model.family, "llama");
  EXPECT_EQ(c.model.n_layer, 4);
  EXPECT_EQ(c.model.n_kv_head, 2);
  EXPECT_EQ(c.model.rope_theta, 500000.0);
  EXPECT_EQ(c.model.attention, "flash");
  EXPECT_EQ(c.model.base_dtype, "bf16");
  EXPECT_EQ(c.model.adapter.kind, "lora");
  EXPECT_EQ(c.model.adapter.r, 16);
  EXPECT_EQ(c.model.adapter.alpha, 32.5);
  EXPECT_EQ(c.model.adapter.target_modules,
            (std::vector<std::string>{"q_proj", "k_proj", "o_proj"}));
  EXPECT_EQ(c.data.task, "text");
  EXPECT_EQ(c.data.path, "corpus.txt");
  EXPECT_EQ(c.data.seq_len, 64);
  EXPECT_TRUE(c.data.pack);
  EXPECT_EQ(c.train.precision, "bf16-mixed");  // alias normalized
  EXPECT_EQ(c.train.batch_size, 8);
  EXPECT_EQ(c.train.grad_accum, 4);
  EXPECT_EQ(c.train.epochs, 3);
  EXPECT_EQ(c.train.max_grad_norm, 0.5);
  EXPECT_EQ(c.train.on_nonfinite, "skip");
  EXPECT_EQ(c.optim.name, "sgd");
  EXPECT_EQ(c.optim.lr, 1.0);  // integer accepted for a float key
  EXPECT_EQ(c.optim.sgd.momentum, 0.8);
  EXPECT_EQ(c.sched.name, "linear");
  EXPECT_EQ(c.sched.warmup_ratio, 0.1);
  EXPECT_EQ(c.scaler.init_scale, 1024.0);
  EXPECT_EQ(c.scaler.hysteresis, 2);
  EXPECT_EQ(c.scaler.max_scale, 16777216.0);
  EXPECT_EQ(c.log.every, 1);
  EXPECT_FALSE(c.log.tensorboard);
  EXPECT_FALSE(c.debug.nan_capture);
  EXPECT_TRUE(c.debug.underflow_overflow.enabled);
  EXPECT_EQ(c.debug.underflow_overflow.trace_batch_nums, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(c.debug.underflow_overflow.abort_after_batch_num, 3);
  EXPECT_EQ(c.debug.inject.module, "h.0.attn");
  EXPECT_EQ(c.debug.inject.step, 5);
  EXPECT_EQ(c.debug.inject.kind, "scale");
  EXPECT_EQ(c.debug.inject.factor, 1e4);
  EXPECT_EQ(c.dist.backend, "mpi");
  // Untouched keys keep their defaults.
  EXPECT_EQ(c.optim.adamw.beta2, 0.999);
  EXPECT_EQ(c.scaler.growth_interval, 2000);

  // The effective config round-trips exactly.
  const std::string text = config_to_toml(c);
  Config back = load_config(write_file(dir, "effective.toml", text));
  back.source = c.source;
  EXPECT_EQ(config_to_toml(back), text);
}

TEST(Config, RoundTripsAwkwardValuesExactly) {
  Config c;
  c.run.out_dir = "dir with \"quotes\", \\backslash\\, tab\t, newline\n and unicode \xc3\xa9";
  c.run.seed = 9223372036854775807ull;
  c.optim.lr = 0.1 + 0.2;  // not representable in few digits
  c.optim.adamw.eps = 1e-300;
  c.scaler.init_scale = 1e38 / 3;  // (a scale is an f32: at most 3.4e38)
  c.model.init_std = 1.0 / 3.0;
  c.model.adapter.target_modules = {};
  c.debug.underflow_overflow.trace_batch_nums = {1, 7, 123456789012};
  c.debug.inject.factor = -2.5;
  c.debug.inject.module = "";
  const std::string dir = test::temp_dir("config");
  const std::string text = config_to_toml(c);
  Config back = load_config(write_file(dir, "c.toml", text));
  EXPECT_EQ(back.run.out_dir, c.run.out_dir);
  EXPECT_EQ(back.run.seed, c.run.seed);
  EXPECT_EQ(back.optim.lr, c.optim.lr);
  EXPECT_EQ(back.optim.adamw.eps, c.optim.adamw.eps);
  EXPECT_EQ(back.scaler.init_scale, c.scaler.init_scale);
  EXPECT_EQ(back.model.init_std, c.model.init_std);
  EXPECT_TRUE(back.model.adapter.target_modules.empty());
  EXPECT_EQ(back.debug.underflow_overflow.trace_batch_nums,
            c.debug.underflow_overflow.trace_batch_nums);
  EXPECT_EQ(back.debug.inject.factor, -2.5);
  // Every line of the effective config except the "read from" comment is identical.
  back.source = "";
  EXPECT_EQ(config_to_toml(back), text);
}

TEST(Config, WritesEveryKeyUnderItsSection) {
  const std::string text = config_to_toml(Config{});
  std::string section;
  std::set<std::string> written;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') {
      section = line.substr(1, line.size() - 2);
      continue;
    }
    written.insert(section + "." + line.substr(0, line.find(" = ")));
  }
  std::set<std::string> known;
  for (const ConfigKeyInfo& k : config_keys()) known.insert(k.key);
  EXPECT_EQ(written, known);
  EXPECT_EQ(known.size(), config_keys().size());  // no key listed twice
  EXPECT_EQ(known.size(), 103u);  // every field of config.h (update with config.h and the docs)
}

TEST(Config, TypeErrorsNameFileLineKeyAndExpectedType) {
  const std::string dir = test::temp_dir("config");
  const std::string path =
      write_file(dir, "config.toml", "[run]\nseed = 1\n\n[train]\nbatch_size = \"big\"\n");
  EXPECT_EQ(usage_error([&] { load_config(path); }),
            path + ":5: train.batch_size must be an integer, got string \"big\"");

  struct Case {
    std::string toml, expected;
  };
  const std::vector<Case> cases = {
      {"[train]\nbatch_size = 8.0", ":2: train.batch_size must be an integer, got float 8.0"},
      {"[optim]\nlr = \"fast\"", ":2: optim.lr must be a number, got string \"fast\""},
      {"[run]\nresume = \"yes\"", ":2: run.resume must be a boolean (true or false), got string"},
      {"[run]\nresume = 1", ":2: run.resume must be a boolean (true or false), got integer 1"},
      {"[model]\nfamily = 2", ":2: model.family must be a string, got integer 2"},
      {"[model.adapter]\ntarget_modules = \"q_proj\"",
       ":2: model.adapter.target_modules must be an array of strings, got string \"q_proj\""},
      {"[model.adapter]\ntarget_modules = [\"q\", 1]",
       ":2: model.adapter.target_modules must be an array of strings, got array [string \"q\", "
       "integer 1]"},
      {"[debug.underflow_overflow]\ntrace_batch_nums = [1.5]",
       ":2: debug.underflow_overflow.trace_batch_nums must be an array of integers"},
      {"[run]\nthreads = 10000000000",
       ":2: run.threads = 10000000000 is out of range for an integer"},
      {"[run]\nseed = -1", ":2: run.seed = -1 is out of range for an integer from 0 to 2^63-1"},
      {"[data]\nseq_len = 1979-05-27", ":2: data.seq_len must be an integer, got date 1979-05-27"},
      {"[train]\nprecision = 8", ":2: train.precision must be one of 32-true, bf16-mixed"},
      {"train = 3", ":1: [train] must be a table (a section), got integer 3"},
      {"[model]\nadapter = \"lora\"", ":2: [model.adapter] must be a table (a section)"},
      {"[log]\nevery = { n = 1 }", ":2: log.every must be an integer, got table"},
  };
  for (const Case& c : cases) {
    const std::string p = write_file(dir, "config.toml", c.toml);
    const std::string msg = usage_error([&] { load_config(p); });
    EXPECT_NE(msg.find(p + c.expected), std::string::npos)
        << "toml: " << c.toml << "\nmessage: " << msg << "\nexpected: " << c.expected;
  }
}

TEST(Config, UnknownKeysAndSectionsNameTheNearestValidOne) {
  const std::string dir = test::temp_dir("config");
  struct Case {
    std::string toml, expected;  // expected: text after the path
  };
  const std::vector<Case> cases = {
      // A key in the wrong section: found across sections.
      {"[run]\nseed = 1\n\n[train]\n\nlr = 1e-3\n",
       "unknown key train.lr (@:6); did you mean optim.lr?"},
      {"[train]\nbatchsize = 8",
       "unknown key train.batchsize (@:2); did you mean train.batch_size?"},
      {"[model.adapter]\nrank = 8",
       "unknown key model.adapter.rank (@:2); did you mean model.adapter.r?"},
      {"[model.adapter]\ntarget_module = [\"q\"]",
       "unknown key model.adapter.target_module (@:2); did you mean model.adapter.target_modules?"},
      {"lr = 0.1", "unknown key lr (@:1); did you mean optim.lr?"},
      {"[debug.inject]\nfactr = 2.0",
       "unknown key debug.inject.factr (@:2); did you mean debug.inject.factor?"},
      {"[optimizer]\nlr = 0.1", "unknown section [optimizer] (@:1); did you mean [optim]?"},
      {"[model.adaptor]\nr = 4",
       "unknown section [model.adaptor] (@:1); did you mean [model.adapter]?"},
      {"[debug.underflow]\nenabled = true",
       "unknown section [debug.underflow] (@:1); did you mean [debug.underflow_overflow]?"},
      // Nothing close: no guess (`x` is one edit from model.adapter.r, which it named), but what
      // the place holds.
      {"x = 1",
       "unknown key x (@:1); every key belongs to a section (e.g. train.max_steps); the sections "
       "are run, model, data, train, optim, sched, scaler, log, debug, dist"},
      {"a = 1", "unknown key a (@:1); every key belongs to a section"},  // not arith_reverse
      {"trian = 1", "unknown key trian (@:1); did you mean the section [train]?"},
      // Another system's name for a key: by spelling `steps` was nearest to debug.inject.step.
      {"steps = 1", "unknown key steps (@:1); did you mean train.max_steps?"},
      {"[train]\nlearning_rate = 1e-3",
       "unknown key train.learning_rate (@:2); did you mean optim.lr?"},
      {"[data]\nkind = \"text\"", "unknown key data.kind (@:2); did you mean data.task?"},
      {"[train]\nbf16 = true",
       "unknown key train.bf16 (@:2); did you mean train.precision = \"bf16-mixed\"?"},
      {"gradient_accumulation_steps = 4",
       "unknown key gradient_accumulation_steps (@:1); did you mean train.grad_accum?"},
      {"[data]\npacking = true", "unknown key data.packing (@:2); did you mean data.pack?"},
      {"padding_free = true", "unknown key padding_free (@:1); did you mean data.pack?"},
      {"[train]\nq = 1", "unknown key train.q (@:2); the keys of [train] are "},
      {"[data]\nt = 1", "unknown key data.t (@:2); the keys of [data] are "},
      {"[zz]\nr = 4", "unknown section [zz] (@:1); the sections are run, model, model.adapter, "},
  };
  for (const Case& c : cases) {
    const std::string p = write_file(dir, "config.toml", c.toml);
    std::string expected = c.expected;
    expected.replace(expected.find('@'), 1, p);
    const std::string msg = usage_error([&] { load_config(p); });
    EXPECT_NE(msg.find(expected), std::string::npos)
        << "message: " << msg << "\nexpected: " << expected;
  }
}

// Every name of another system leads to a key that exists, and none is a key of keel's own (it
// would never be looked up).
TEST(Config, OtherSystemsNamesLeadToKeysThatExist) {
  std::set<std::string> known;
  for (const ConfigKeyInfo& k : config_keys()) known.insert(k.key);
  ASSERT_FALSE(peer_key_names().empty());
  for (const auto& [name, key] : peer_key_names()) {
    EXPECT_EQ(known.count(key.substr(0, key.find(' '))), 1u) << name << " -> " << key;
    EXPECT_EQ(known.count(name), 0u) << name;
  }
}

TEST(Config, EnumerationsListTheirValidValues) {
  struct Case {
    std::string key, value, valid;
  };
  const std::vector<Case> cases = {
      {"train.precision", "bf32",
       "32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 32, bf16, 16, auto"},
      {"train.on_nonfinite", "ignore", "capture, skip, abort"},
      {"model.attention", "sdpa", "eager, math, flash"},
      {"model.family", "gpt3", "gpt2, llama"},
      {"model.base_dtype", "f16", "f32, bf16"},
      {"model.adapter.kind", "ia3", "none, lora, dora, lokr"},
      {"optim.name", "adam", "adamw, sgd"},
      {"sched.name", "step", "constant, linear, cosine"},
      {"dist.backend", "gloo", "auto, single, mpi, nccl"},
      {"data.task", "images", "arith, text, jsonl, tokens"},
      {"debug.inject.kind", "zero", "nan, inf, scale"},
  };
  for (const Case& c : cases) {
    const std::string msg = set_error(c.key + "=" + c.value);
    EXPECT_EQ(msg, "--set " + c.key + "=" + c.value + ": " + c.key + " must be one of " + c.valid +
                       "; got \"" + c.value + "\"");
  }
  // The same error from a file names the file and line.
  const std::string msg = load_error("\n[model]\nattention = \"fast\"\n");
  EXPECT_NE(
      msg.find("config.toml:3: model.attention must be one of eager, math, flash; got \"fast\""),
      std::string::npos)
      << msg;
  // Devices.
  for (const char* ok : {"cpu", "cuda", "cuda:0", "cuda:12"})
    EXPECT_EQ(load_config("", {std::string("run.device=") + ok}).run.device, ok);
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "CPU", "cuda:-1"})
    EXPECT_NE(
        set_error(std::string("run.device=") + bad).find("run.device must be cpu, cuda or cuda:N"),
        std::string::npos);
}

TEST(Config, PrecisionAliasesAreNormalized) {
  const std::map<std::string, std::string> expect = {
      {"32", "32-true"},      {"16", "16-mixed"},
      {"bf16", "bf16-mixed"}, {"\"32\"", "32-true"},
      {"auto", "auto"},       {"bf16-true", "bf16-true"},
      {"16-true", "16-true"}, {"16-mixed", "16-mixed"},
      {"32-true", "32-true"}, {"\"bf16-mixed\"", "bf16-mixed"},
  };
  for (auto& [given, canonical] : expect)
    EXPECT_EQ(load_config("", {"train.precision=" + given}).train.precision, canonical) << given;
  // Integers in a file, as Lightning accepts them.
  const std::string dir = test::temp_dir("config");
  EXPECT_EQ(load_config(write_file(dir, "a.toml", "[train]\nprecision = 16")).train.precision,
            "16-mixed");
  EXPECT_EQ(load_config(write_file(dir, "b.toml", "[train]\nprecision = 32")).train.precision,
            "32-true");
}

TEST(Config, RangesAreCheckedAndNameTheValidRange) {
  struct Case {
    std::string set, expected;
  };
  const std::vector<Case> cases = {
      {"train.batch_size=0", "train.batch_size must be in [1, 65536], got 0"},
      {"train.grad_accum=-2", "train.grad_accum must be in [1, 65536], got -2"},
      {"train.epochs=0", "train.epochs must be in [1, 1000000], got 0"},
      {"train.max_steps=-1", "train.max_steps must be in [0, 1000000000000], got -1"},
      {"train.max_grad_norm=-1.0", "train.max_grad_norm must be >= 0, got -1"},
      {"optim.lr=0", "optim.lr must be > 0, got 0"},
      {"optim.lr=-1e-3", "optim.lr must be > 0, got -0.001"},
      {"optim.lr=nan", "optim.lr must be a finite number, got nan (valid: > 0)"},
      {"optim.lr=inf", "optim.lr must be a finite number, got inf (valid: > 0)"},
      {"optim.beta1=1.0", "optim.beta1 must be in [0, 1), got 1"},
      {"optim.beta2=-0.1", "optim.beta2 must be in [0, 1), got -0.1"},
      {"data.seq_len=1", "data.seq_len must be in [2, 1048576], got 1"},
      {"data.digits=19", "data.digits must be in [1, 18], got 19"},
      {"model.dropout=1", "model.dropout must be in [0, 1), got 1"},
      {"model.dropout=-0.5", "model.dropout must be in [0, 1), got -0.5"},
      {"model.adapter.dropout=1.5", "model.adapter.dropout must be in [0, 1), got 1.5"},
      {"model.adapter.r=0", "model.adapter.r must be in [1, 65536], got 0"},
      {"model.n_layer=0", "model.n_layer must be in [1, 1024], got 0"},
      {"model.norm_eps=0", "model.norm_eps must be > 0, got 0"},
      {"sched.warmup_ratio=1", "sched.warmup_ratio must be in [0, 1), got 1"},
      {"sched.min_lr_ratio=1.5", "sched.min_lr_ratio must be in [0, 1], got 1.5"},
      {"scaler.growth_factor=1.0", "scaler.growth_factor must be > 1, got 1"},
      {"scaler.backoff_factor=1", "scaler.backoff_factor must be in (0, 1), got 1"},
      {"scaler.backoff_factor=0", "scaler.backoff_factor must be in (0, 1), got 0"},
      {"scaler.init_scale=0", "scaler.init_scale must be > 0, got 0"},
      {"scaler.growth_interval=0", "scaler.growth_interval must be >= 1, got 0"},
      {"scaler.hysteresis=0", "scaler.hysteresis must be >= 1, got 0"},
      {"log.every=0", "log.every must be >= 1, got 0"},
      {"run.threads=-1", "run.threads must be in [0, 4096], got -1"},
      {"debug.underflow_overflow.trace_batch_nums=[2, -1]",
       "debug.underflow_overflow.trace_batch_nums must be >= 1, got -1 in the list"},
      {"debug.underflow_overflow.abort_after_batch_num=-2",
       "debug.underflow_overflow.abort_after_batch_num must be >= 1 (or -1), got -2"},
      {"debug.inject.factor=inf", "debug.inject.factor must be a finite number, got inf"},
  };
  for (const Case& c : cases) EXPECT_EQ(set_error(c.set), "--set " + c.set + ": " + c.expected);
  // Boundary values that are valid.
  Config ok = load_config("", {"train.batch_size=1", "optim.beta1=0", "model.dropout=0.999",
                               "data.seq_len=2", "sched.min_lr_ratio=1", "data.digits=18",
                               "debug.underflow_overflow.abort_after_batch_num=-1"});
  EXPECT_EQ(ok.train.batch_size, 1);
  EXPECT_EQ(ok.model.dropout, 0.999);
  // A day: written YYYY-MM-DD, and on the calendar.
  for (const char* bad : {"2024-02-30", "2024-2-3", "04.12.2024", "today"}) {
    const std::string m = set_error(std::string("data.chat_date=") + bad);
    EXPECT_NE(m.find("--set data.chat_date=" + std::string(bad) + ": data.chat_date = \"" + bad +
                     "\" is not a day written YYYY-MM-DD"),
              std::string::npos)
        << m;
  }
  EXPECT_EQ(load_config("", {"data.chat_date=2024-02-29"}).data.chat_date, "2024-02-29");
  // A range error from a file names the file and the line.
  const std::string msg = load_error("[train]\nbatch_size = 0\n");
  EXPECT_NE(msg.find("config.toml:2: train.batch_size must be in [1, 65536], got 0"),
            std::string::npos)
      << msg;
}

// Every size key has an upper bound (docs/config.md), so that sizes and their products stay inside
// int64: 2^63 - 1 used to segfault (vocab_size, max_seq_len) or overflow (batch_size, grad_accum,
// intermediate_size).
TEST(Config, SizeKeysHaveUpperBounds) {
  const std::string huge = "9223372036854775807";
  for (const char* key :
       {"model.vocab_size", "model.max_seq_len", "model.n_layer", "model.n_embd", "model.n_head",
        "model.n_kv_head", "model.intermediate_size", "model.adapter.r", "data.seq_len",
        "data.num_examples", "data.eval_examples", "train.batch_size", "train.grad_accum",
        "train.max_steps", "train.epochs", "debug.underflow_overflow.max_frames_to_save"}) {
    const std::string msg = set_error(std::string(key) + "=" + huge);
    EXPECT_CONTAINS(msg, std::string(key) + " must be in [");
    EXPECT_CONTAINS(msg, "got " + huge);
  }
  EXPECT_EQ(set_error("run.threads=100000"),
            "--set run.threads=100000: run.threads must be in [0, 4096], got 100000");
  // The bounds themselves are valid.
  Config ok = load_config("", {"model.vocab_size=16777216", "train.batch_size=65536",
                               "model.n_layer=1024", "run.threads=4096"});
  EXPECT_EQ(ok.model.vocab_size, 16777216);
}

// A NUL byte in a string (TOML's \u0000 escape) cut the path short at the C library:
// data.path = "/etc/hostname\u0000zzz" trained on /etc/hostname, and run.out_dir = "out\u0000x"
// created out/ and failed with "cannot open out".
TEST(Config, StringsHoldingANulByteAreRefused) {
  std::string msg = load_error("[data]\ntask = \"text\"\npath = \"a.txt\\u0000b\"\n");
  EXPECT_NE(msg.find("config.toml:3: data.path = \"a.txt\\u0000b\" holds a NUL byte"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("remove it"), std::string::npos) << msg;
  msg = load_error("[model.adapter]\ntarget_modules = [\"q_proj\", \"v\\u0000\"]\n");
  EXPECT_NE(msg.find("config.toml:2: model.adapter.target_modules = \"v\\u0000\" holds a NUL"),
            std::string::npos)
      << msg;
  msg = set_error("run.out_dir=\"out\\u0000x\"");
  EXPECT_EQ(msg,
            "--set run.out_dir=\"out\\u0000x\": run.out_dir = \"out\\u0000x\" holds a NUL "
            "byte (\\u0000), which no path or name can hold; remove it");
  // Other control bytes are legal in a Linux path and stay accepted.
  EXPECT_EQ(load_config("", {"run.out_dir=\"out\\tx\""}).run.out_dir, "out\tx");
}

TEST(Config, RulesAcrossKeysNameBothKeysAndWhereTheyCameFrom) {
  std::string msg = set_error("model.n_head=5");
  EXPECT_NE(msg.find("model.n_embd = 64 (default) must be divisible by model.n_head = 5 (--set "
                     "model.n_head=5)"),
            std::string::npos)
      << msg;
  // Sizes come from the HF config when model.path is set.
  EXPECT_NO_THROW(load_config("", {"model.n_head=5", "model.path=/models/gpt2"}));
  // Llama's RoPE needs an even head dim: the model's own check named no key ("model: llama needs
  // an even head dim for RoPE, got 9").
  msg = usage_error([] { load_config("", {"model.family=llama", "model.n_embd=36"}); });
  EXPECT_NE(msg.find("model.n_embd = 36 (--set model.n_embd=36) / model.n_head = 4 (default) "
                     "gives heads of 9 channels"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("change model.n_embd or model.n_head"), std::string::npos) << msg;
  EXPECT_NO_THROW(load_config("", {"model.family=gpt2", "model.n_embd=36"}));  // no RoPE
  // A head width of its own need not divide n_embd, and must be even under RoPE.
  EXPECT_NO_THROW(load_config("", {"model.family=llama", "model.n_embd=36", "model.head_dim=8"}));
  msg = usage_error([] { load_config("", {"model.family=llama", "model.head_dim=7"}); });
  EXPECT_CONTAINS(msg, "model.head_dim = 7 (--set model.head_dim=7) is odd");
  msg = set_error("model.n_kv_head=3");
  EXPECT_NE(msg.find("model.n_head = 4 (default) must be divisible by model.n_kv_head = 3"),
            std::string::npos)
      << msg;
  msg = usage_error([] {
    load_config("", {"model.adapter.kind=lora", "model.adapter.target_modules=[]"});
  });
  EXPECT_NE(
      msg.find("model.adapter.target_modules (--set model.adapter.target_modules=[]) is empty"),
      std::string::npos)
      << msg;
  EXPECT_NO_THROW(load_config("", {"model.adapter.target_modules=[]"}));  // kind = none
  msg = set_error("data.task=jsonl");
  EXPECT_NE(msg.find("data.task = \"jsonl\" (--set data.task=jsonl) needs data.path"),
            std::string::npos)
      << msg;
  // data.pack with a task it does not apply to was ignored without a word.
  msg = usage_error([] {
    load_config("", {"data.task=tokens", "data.path=a.bin", "data.pack=true"});
  });
  EXPECT_NE(msg.find("data.pack = true (--set data.pack=true) packs a text or JSONL file into "
                     "rows; data.task = \"tokens\" (--set data.task=tokens) is trained packed "
                     "already; remove data.pack"),
            std::string::npos)
      << msg;
  EXPECT_NE(set_error("data.pack=true").find("makes one problem a row"), std::string::npos);
  EXPECT_NO_THROW(load_config("", {"data.task=text", "data.path=a.txt", "data.pack=true"}));
  EXPECT_NO_THROW(load_config("", {"data.task=jsonl", "data.path=a.jsonl", "data.pack=true"}));
  // Packed JSONL examples keep apart by their positions, which CUDA's attention does not read:
  // refused before the model loads, not at the first step.
  msg = usage_error([] {
    load_config("", {"data.task=jsonl", "data.path=a.jsonl", "data.pack=true", "run.device=cuda"});
  });
  EXPECT_NE(msg.find("data.pack = true (--set data.pack=true) with data.task = \"jsonl\" and "
                     "run.device = \"cuda\" (--set run.device=cuda): packed examples attend only "
                     "to themselves"),
            std::string::npos)
      << msg;
  msg = usage_error([] { load_config("", {"scaler.min_scale=4", "scaler.max_scale=2"}); });
  EXPECT_NE(
      msg.find("scaler.min_scale = 4 (--set scaler.min_scale=4) is above scaler.max_scale = 2"),
      std::string::npos)
      << msg;
  // A start outside the bounds: under min_scale, the first overflow "backed off" up to min_scale
  // and stopped as an overflow at the floor; over max_scale, the scale stayed above it.
  msg = usage_error([] { load_config("", {"scaler.init_scale=1e10", "scaler.min_scale=1e20"}); });
  EXPECT_CONTAINS(msg,
                  "scaler.init_scale = 1e+10 (--set scaler.init_scale=1e10) is below "
                  "scaler.min_scale = 1e+20 (--set scaler.min_scale=1e20)");
  EXPECT_CONTAINS(msg, "set scaler.init_scale to at least scaler.min_scale");
  msg = usage_error([] { load_config("", {"scaler.init_scale=65536", "scaler.max_scale=4096"}); });
  EXPECT_CONTAINS(msg, "scaler.init_scale = 65536 (--set scaler.init_scale=65536)");
  EXPECT_CONTAINS(msg, "is above scaler.max_scale = 4096 (--set scaler.max_scale=4096)");
  EXPECT_NO_THROW(load_config("", {"scaler.min_scale=65536", "scaler.max_scale=65536"}));
  // Left at its default, the start follows the bound that was set (max_scale = 4096 alone was an
  // error asking for init_scale too), and the saved config gives it back as it ran.
  const Config capped = load_config("", {"scaler.max_scale=4096"});
  EXPECT_EQ(capped.scaler.init_scale, 4096.0);
  EXPECT_EQ(load_config_text(config_to_toml(capped), "saved").scaler.init_scale, 4096.0);
  EXPECT_EQ(load_config("", {"scaler.min_scale=1e6"}).scaler.init_scale, 1e6);
  // A scale is an f32 (docs/config.md): 1e39 and 1e-40 loaded, and the GradScaler refused them at
  // the first 16-mixed run, naming no file or line.
  msg = set_error("scaler.init_scale=1e39");
  EXPECT_CONTAINS(msg,
                  "scaler.init_scale = 1e+39 (--set scaler.init_scale=1e39) is outside f32's "
                  "range: a loss scale is an f32 value from 1.2e-38 (f32's smallest normal) to "
                  "3.4e38");
  EXPECT_CONTAINS(set_error("scaler.init_scale=1e-40"), "scaler.init_scale = 1e-40 (");
  EXPECT_CONTAINS(load_error("[scaler]\nmax_scale = 1e39\n"), "scaler.max_scale = 1e+39 (");
  EXPECT_CONTAINS(set_error("scaler.min_scale=1e-39"), ", or 0 for no bound");
  EXPECT_NO_THROW(load_config("", {"scaler.init_scale=3e38", "scaler.min_scale=1.2e-38"}));
  // SGD's own check named no key ("SGD: Nesterov momentum requires a momentum and zero
  // dampening").
  msg = usage_error([] { load_config("", {"optim.name=sgd", "optim.nesterov=true"}); });
  EXPECT_CONTAINS(msg,
                  "optim.nesterov = true (--set optim.nesterov=true) needs optim.momentum > 0 "
                  "and optim.dampening = 0 (as PyTorch's SGD); got optim.momentum = 0 (default), "
                  "optim.dampening = 0 (default)");
  EXPECT_NO_THROW(load_config("", {"optim.name=sgd", "optim.nesterov=true", "optim.momentum=0.9"}));
}

// A list key given one bare value said "must be an array of strings, got string", not how to write
// one; "hf:" with no path reached the tokenizer loader as "HF tokenizer file  does not exist".
TEST(Config, AListKeyGivenOneValueAndATokenizerPrefixAloneSayTheFix) {
  EXPECT_EQ(set_error("model.adapter.target_modules=q_proj"),
            "--set model.adapter.target_modules=q_proj: model.adapter.target_modules takes a list; "
            "write it in brackets, each entry quoted, in single quotes that keep the shell from "
            "removing the double ones (--set 'model.adapter.target_modules=[\"q_proj\"]')");
  EXPECT_EQ(set_error("model.adapter.target_modules=\"q_proj\""),
            "--set model.adapter.target_modules=\"q_proj\": model.adapter.target_modules takes a "
            "list; write it in brackets, each entry quoted, in single quotes that keep the shell "
            "from removing the double ones (--set 'model.adapter.target_modules=[\"q_proj\"]')");
  EXPECT_EQ(set_error("debug.underflow_overflow.trace_batch_nums=3"),
            "--set debug.underflow_overflow.trace_batch_nums=3: "
            "debug.underflow_overflow.trace_batch_nums takes a list; write it in brackets (--set "
            "'debug.underflow_overflow.trace_batch_nums=[3]')");
  EXPECT_EQ(load_config("", {"debug.underflow_overflow.trace_batch_nums=[3]"})
                .debug.underflow_overflow.trace_batch_nums,
            (std::vector<int64_t>{3}));
  EXPECT_EQ(set_error("data.tokenizer=hf:"),
            "--set data.tokenizer=hf:: data.tokenizer = \"hf:\": give the path after hf: (e.g. "
            "hf:tokenizer.json, or its directory)");
  EXPECT_EQ(set_error("data.tokenizer=gpt2:"),
            "--set data.tokenizer=gpt2:: data.tokenizer = \"gpt2:\": give the path after gpt2: "
            "(e.g. gpt2:gpt2-tokenizer-dir, GPT-2's vocabulary directory)");
}

TEST(Config, OverridesParseTomlValuesAndBareStrings) {
  const std::string dir = test::temp_dir("config");
  const std::string path =
      write_file(dir, "c.toml", "[train]\nbatch_size = 4\n[optim]\nlr = 0.1\n");
  Config c = load_config(
      path, {"train.batch_size=8", "optim.lr=1e-3", "train.precision=bf16-mixed",
             "model.adapter.target_modules=[\"q_proj\",\"v_proj\",\"o_proj\"]",
             "run.out_dir=2024-01-01", "data.tokenizer = gpt2 ", "log.tensorboard=false",
             "debug.inject.module=\"h.1.mlp\"", "debug.underflow_overflow.trace_batch_nums=[1, 2]",
             "scaler.init_scale=128", "run.seed=7", "train.max_grad_norm=0"});
  EXPECT_EQ(c.train.batch_size, 8);  // the override wins over the file
  EXPECT_EQ(c.optim.lr, 1e-3);
  EXPECT_EQ(c.train.precision, "bf16-mixed");
  EXPECT_EQ(c.model.adapter.target_modules,
            (std::vector<std::string>{"q_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(c.run.out_dir, "2024-01-01");  // a TOML date, taken as the bare string it is
  EXPECT_EQ(c.data.tokenizer, "gpt2");
  EXPECT_FALSE(c.log.tensorboard);
  EXPECT_EQ(c.debug.inject.module, "h.1.mlp");
  EXPECT_EQ(c.debug.underflow_overflow.trace_batch_nums, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(c.scaler.init_scale, 128.0);
  EXPECT_EQ(c.run.seed, 7u);
  EXPECT_EQ(c.train.max_grad_norm, 0.0);
  // Later overrides win.
  EXPECT_EQ(load_config("", {"train.batch_size=2", "train.batch_size=3"}).train.batch_size, 3);
  // A value with '=' in it keeps everything after the first '='.
  EXPECT_EQ(load_config("", {"run.out_dir=a=b"}).run.out_dir, "a=b");

  // Errors name the override.
  EXPECT_EQ(set_error("train.batch_size=big"),
            "--set train.batch_size=big: train.batch_size must be an integer, got string \"big\"");
  EXPECT_EQ(set_error("train.lr=1e-3"),
            "--set train.lr=1e-3: unknown key train.lr; did you mean optim.lr?");
  EXPECT_EQ(set_error("x=1"),
            "--set x=1: unknown key x; every key belongs to a section (e.g. train.max_steps); the "
            "sections are run, model, data, train, optim, sched, scaler, log, debug, dist");
  EXPECT_EQ(set_error("train.batch_size"),
            "--set train.batch_size: expected section.key=value (e.g. --set train.batch_size=8)");
  EXPECT_NE(set_error("optim.lr=1e400").find("optim.lr = 1e400 is not a number TOML can hold ("),
            std::string::npos);
  EXPECT_NE(set_error("log.every=99999999999999999999")
                .find("log.every = 99999999999999999999 is not a number TOML can hold"),
            std::string::npos);
  EXPECT_EQ(set_error("=5"),
            "--set =5: no key before '='; expected section.key=value (e.g. --set "
            "train.batch_size=8)");
  EXPECT_NE(set_error("train=3").find("--set train=3: train is a section, not a key"),
            std::string::npos);
  EXPECT_NE(set_error("model.adapter.target_modules=q_proj").find("takes a list"),
            std::string::npos);
  EXPECT_EQ(set_error("log.console=yes"),
            "--set log.console=yes: log.console must be a boolean (true or false), got string "
            "\"yes\"");
  // The shell removes the double quotes of an unquoted --set target_modules=["q_proj"]: keel sees
  // [q_proj], and the message says how to type it.
  EXPECT_EQ(set_error("model.adapter.target_modules=[q_proj, v_proj]"),
            "--set model.adapter.target_modules=[q_proj, v_proj]: model.adapter.target_modules = "
            "[q_proj, v_proj] is not a TOML array of strings: quote each entry, in single quotes "
            "that keep the shell from removing the double ones (--set "
            "'model.adapter.target_modules=[\"q_proj\", \"v_proj\"]')");
}

// `keel train <(sed s/8/16/ cfg.toml)`: a pipe is read like a file (devices are refused).
TEST(Config, AConfigFromAPipeIsRead) {
  const std::string fifo = test::temp_dir("config-fifo") + "/cfg.toml";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::thread writer([&] { std::ofstream(fifo) << "[train]\nmax_steps = 7\n"; });
  EXPECT_EQ(load_config(fifo).train.max_steps, 7);
  writer.join();
}

TEST(Config, FileErrorsNameTheFile) {
  const std::string dir = test::temp_dir("config");
  std::string msg = usage_error([&] { load_config(dir + "/missing.toml"); });
  EXPECT_NE(msg.find("cannot read config file " + dir + "/missing.toml"), std::string::npos) << msg;
  EXPECT_EQ(usage_error([&] { load_config("/dev/zero"); }),
            "cannot read config file /dev/zero: it is a character device, not a file (check "
            "the path; pass \"\" for defaults)");
  const std::string p = write_file(dir, "bad.toml", "[train]\nbatch_size = 8\nlr = = 3\n");
  msg = usage_error([&] { load_config(p); });
  EXPECT_NE(msg.find(p + ":3:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("TOML syntax error"), std::string::npos) << msg;
  // A key set twice is a TOML error, not a silent choice.
  const std::string dup = write_file(dir, "dup.toml", "[train]\nbatch_size = 8\nbatch_size = 9\n");
  msg = usage_error([&] { load_config(dup); });
  EXPECT_NE(msg.find(dup + ":3:"), std::string::npos) << msg;
}

// Everything wrong between a config.md text and the loader: undocumented keys, documented keys the
// loader does not know, wrong types, and defaults that do not load to the code's defaults.
std::vector<std::string> docs_problems(const std::string& markdown) {
  std::vector<std::string> problems;
  const std::regex heading(R"(^#+ \[([a-z_.]+)\]\s*$)");
  const std::regex row(R"(^\| `([a-z_0-9]+)` \| ([a-z\[\]]+) \| `([^`]*)` \|)");
  std::string section;
  std::map<std::string, std::pair<std::string, std::string>> documented;  // key -> (type, default)
  std::istringstream in(markdown);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, heading)) {
      section = m[1];
    } else if (std::regex_search(line, m, row)) {
      const std::string key = section + "." + std::string(m[1]);
      if (section.empty()) problems.push_back("row before any [section] heading: " + line);
      if (documented.count(key)) problems.push_back(key + " is documented twice");
      documented[key] = {m[2], m[3]};
    }
  }
  const std::string dir = test::temp_dir("config-docs");
  for (const ConfigKeyInfo& k : config_keys()) {
    auto it = documented.find(k.key);
    if (it == documented.end()) {
      problems.push_back(k.key + " is not documented (default " + k.default_toml + ")");
      continue;
    }
    const auto [type, default_toml] = it->second;
    documented.erase(it);
    if (type != k.type)
      problems.push_back(k.key + " is documented as " + type + " but is " + k.type);
    // The documented default, read by the loader, must give exactly the code's default config.
    const size_t dot = k.key.rfind('.');
    const std::string one = write_file(
        dir, "one.toml",
        "[" + k.key.substr(0, dot) + "]\n" + k.key.substr(dot + 1) + " = " + default_toml + "\n");
    try {
      Config c = load_config(one);
      c.source = "";
      if (config_to_toml(c) != config_to_toml(Config{}))
        problems.push_back(k.key + " is documented with default " + default_toml +
                           " but the code's default is " + k.default_toml);
    } catch (const Error& e) {
      problems.push_back(k.key + ": documented default " + default_toml +
                         " does not load: " + e.what());
    }
  }
  for (auto& [key, v] : documented)
    problems.push_back(key + " is documented but the loader does not know it");
  return problems;
}

std::string read_docs() {
  std::ifstream in(std::string(KEEL_SOURCE_DIR) + "/docs/config.md");
  EXPECT_TRUE(in) << "docs/config.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Config, DocsDocumentEveryKeyWithTheCodesTypeAndDefault) {
  const std::string docs = read_docs();
  for (const std::string& p : docs_problems(docs)) ADD_FAILURE() << "docs/config.md: " << p;
}

// ---- documented ranges and values against the loader

// A bound as docs/config.md writes it: "4096", "-1", "10^8", "2^63-1", "1.2e-38". A float written
// with an exponent is rounded to its digits: f32's smallest normal is 1.17549435e-38, written
// 1.2e-38, so the edges are judged one unit of the last digit inside and outside it.
struct DocBound {
  std::string text;
  double value = 0;
  int64_t integer = 0;  // exact for the integer forms (2^63-1 does not fit a double)
  double unit = 0;      // > 0: rounded to this unit
};

DocBound parse_bound(const std::string& t) {
  DocBound b;
  b.text = t;
  std::smatch m;
  if (std::regex_match(t, m, std::regex(R"((\d+)\^(\d+)(-1)?)"))) {
    long double v = std::pow(std::stold(m[1]), std::stold(m[2]));
    if (m[3].matched) v -= 1;
    b.integer =
        v >= 9.2233720368547758e18L ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(v);
    b.value = static_cast<double>(v);
  } else if (std::regex_match(t, m, std::regex(R"(-?\d+(\.(\d+))?e(-?\d+))"))) {
    b.value = std::stod(t);
    b.unit = std::pow(10.0, std::stod(m[3]) - static_cast<double>(m[2].length()));
  } else {
    b.value = std::stod(t);
    b.integer = static_cast<int64_t>(b.value);
  }
  return b;
}

struct DocRow {
  std::string key, type, meaning;
};

std::vector<DocRow> doc_rows(const std::string& markdown) {
  const std::regex heading(R"(^#+ \[([a-z_.]+)\]\s*$)");
  const std::regex row(R"(^\| `([a-z_0-9]+)` \| ([a-z\[\]]+) \| `[^`]*` \| (.*) \|$)");
  std::vector<DocRow> rows;
  std::string section;
  std::istringstream in(markdown);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, heading))
      section = m[1];
    else if (std::regex_match(line, m, row))
      rows.push_back({section + "." + std::string(m[1]), m[2], m[3]});
  }
  return rows;
}

// What the loader says to `key = value` ("" = accepted), `value` written as TOML.
std::string loads(const std::string& key, const std::string& value,
                  const std::vector<std::string>& with = {}) {
  std::vector<std::string> sets = with;
  sets.push_back(key + "=" + value);
  try {
    load_config("", sets);
  } catch (const Error& e) {
    return e.kind == Error::kUsage ? std::string(e.what())
                                   : std::string("(not a usage error) ") + e.what();
  }
  return "";
}

std::string float_text(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s = buf;
  return s.find_first_of(".en") == std::string::npos ? s + ".0" : s;
}

// Every range and set of values docs/config.md states, checked against the loader: a value just
// outside the range is refused with an error naming the key and the bound, the edges are accepted,
// an unbounded side takes a large value, and each listed value loads while one not listed is
// refused. A numeric key must state its range ("finite" where any finite value goes).
std::vector<std::string> range_problems(const std::string& markdown) {
  std::vector<std::string> problems;
  std::map<std::string, std::vector<std::string>> choices;
  for (const ConfigKeyInfo& k : config_keys()) choices[k.key] = k.choices;
  // The rules across keys that an edge must also meet (n_embd divisible by n_head, n_kv_head
  // dividing n_head): set beside the key, so the edge itself is what is judged.
  const std::map<std::string, std::vector<std::string>> with = {
      {"model.n_embd", {"model.n_head=1"}},
      {"model.n_head", {"model.n_embd=1024"}},
      {"model.n_kv_head", {"model.n_head=1024", "model.n_embd=1024"}},
      {"data.task", {"data.path=corpus.txt"}},
      {"data.eval_fraction", {"data.task=text", "data.path=corpus.txt"}},
  };
  const std::string num = R"((-?\d+(?:\.\d+)?(?:e-?\d+)?(?:\^\d+(?:-1)?)?))";
  const std::string lead = R"((?:^|[,;:] |each |from |are ))";
  const std::regex span(lead + num + R"((?: \([^)]*\))? to )" + num);
  const std::regex interval(lead + R"(in ([\[(]))" + num + ", " + num + R"(([\])]))");
  const std::regex compare(lead + R"((>=|>|<=|<) )" + num);
  const std::regex special("`" + num + "` = ");
  for (const DocRow& row : doc_rows(markdown)) {
    const std::string& key = row.key;
    const auto it = with.find(key);
    const std::vector<std::string> companions =
        it == with.end() ? std::vector<std::string>{} : it->second;
    auto wrap = [&](const std::string& v) { return row.type == "int[]" ? "[" + v + "]" : v; };
    // ---- a range
    std::smatch m, best;
    int kind = -1;
    for (int k = 0; k < 3; ++k) {
      const std::regex& re = k == 0 ? span : k == 1 ? interval : compare;
      if (std::regex_search(row.meaning, m, re) && (kind < 0 || m.position(0) < best.position(0)))
        best = m, kind = k;
    }
    const bool numeric = row.type == "int" || row.type == "float" || row.type == "int[]";
    const bool integer = row.type != "float";
    if (kind < 0) {
      if (numeric && !std::regex_search(row.meaning, std::regex(R"((^|[,;:] )finite\b)")))
        problems.push_back(key + " states no range (write one, e.g. \">= 0\", or \"finite\")");
    } else if (numeric || row.type == "string") {
      std::optional<DocBound> lo, hi;
      bool lo_open = false, hi_open = false;
      if (kind == 0) {
        lo = parse_bound(best[1]), hi = parse_bound(best[2]);
      } else if (kind == 1) {
        lo = parse_bound(best[2]), hi = parse_bound(best[3]);
        lo_open = best[1] == "(", hi_open = best[4] == ")";
      } else {
        const std::string op = best[1];
        (op[0] == '>' ? lo : hi) = parse_bound(best[2]);
        (op[0] == '>' ? lo_open : hi_open) = op.size() == 1;
      }
      // Values the row gives a meaning of their own ("`0` = none") load whatever the range.
      std::set<std::string> specials;
      for (std::sregex_iterator s(row.meaning.begin(), row.meaning.end(), special), end; s != end;
           ++s)
        specials.insert((*s)[1]);
      auto text = [&](double v, int64_t i) {
        return wrap(integer ? std::to_string(i) : float_text(v));
      };
      auto expect_ok = [&](double v, int64_t i, const char* what) {
        const std::string t = text(v, i);
        const std::string e = loads(key, t, companions);
        if (!e.empty())
          problems.push_back(key + " = " + t + " (" + what + " of \"" + best.str() +
                             "\") is refused: " + e);
      };
      auto expect_refused = [&](double v, int64_t i, const DocBound& b) {
        const std::string t = text(v, i);
        if (specials.count(integer ? std::to_string(i) : t)) return;
        const std::string e = loads(key, t, companions);
        if (e.empty())
          problems.push_back(key + " = " + t + " (just outside \"" + best.str() + "\") loads");
        else if (e.find(key) == std::string::npos ||
                 (e.find(b.text) == std::string::npos &&
                  e.find(std::to_string(b.integer)) == std::string::npos))
          problems.push_back(key + " = " + t + " is refused without naming the key and " + b.text +
                             ": " + e);
      };
      // One side: `b` the bound, `dir` -1 for the lower and +1 for the upper.
      auto side = [&](const DocBound& b, bool open, int dir) {
        if (integer) {
          const int64_t edge = open ? b.integer - dir : b.integer;
          expect_ok(static_cast<double>(edge), edge, "the edge");
          if (!(dir > 0 && edge == std::numeric_limits<int64_t>::max()))
            expect_refused(0, edge + dir, b);
        } else if (b.unit > 0) {
          expect_ok(b.value - dir * b.unit, 0, "inside the edge");
          expect_refused(b.value + dir * b.unit, 0, b);
        } else {
          const double out = std::nextafter(b.value, dir * kInfinity);
          const double in = std::nextafter(b.value, -dir * kInfinity);
          expect_ok(open ? in : b.value, 0, "the edge");
          expect_refused(open ? b.value : out, 0, b);
        }
      };
      if (lo) side(*lo, lo_open, -1);
      if (hi) side(*hi, hi_open, +1);
      if (!hi && lo)  // unbounded above: a large value loads
        expect_ok(1e30, int64_t{1000000000}, "a large value");
      for (const std::string& s : specials) {
        const std::string e = loads(key, wrap(s), companions);
        if (!e.empty()) problems.push_back(key + " = " + s + " (documented) is refused: " + e);
      }
    }
    // ---- a set of values: the first list of `values` ("`a`, `b` or `c`"), parentheses aside
    if (row.type != "string") continue;
    std::string flat = row.meaning;
    for (std::string prev; prev != flat;)
      prev = flat, flat = std::regex_replace(flat, std::regex(R"( ?\([^()]*\))"), "");
    std::vector<std::string> listed;
    // (at the start of the text, or of what follows a label: "Attention backend: `eager`, ...")
    if (std::regex_search(flat, m,
                          std::regex("^(?:[^`:]*: )?(`[^`]+`(?:(?:, |,? or )`[^`]+`)+)"))) {
      const std::string list = m[1];
      const std::regex item("`([^`]+)`");
      for (std::sregex_iterator v(list.begin(), list.end(), item), end; v != end; ++v)
        listed.push_back((*v)[1]);
    }
    for (const std::string& v : listed) {
      if (std::any_of(v.begin(), v.end(), [](char ch) { return ch >= 'A' && ch <= 'Z'; }))
        continue;  // a placeholder (cuda:N)
      const std::string e = loads(key, v, companions);
      if (!e.empty()) problems.push_back(key + " = " + v + " is documented but refused: " + e);
    }
    for (const std::string& c : choices[key])
      if (row.meaning.find("`" + c + "`") == std::string::npos)
        problems.push_back(key + " takes " + c + ", which its row does not list");
    if (!listed.empty() || !choices[key].empty()) {
      const std::string e = loads(key, "bogus", companions);
      if (e.empty())
        problems.push_back(key + " = bogus loads");
      else if (e.find(key) == std::string::npos)
        problems.push_back(key + " = bogus is refused without naming the key: " + e);
      for (const std::string& c : choices[key])
        if (!e.empty() && e.find(c) == std::string::npos)
          problems.push_back(key + " = bogus is refused without listing " + c + ": " + e);
    }
  }
  return problems;
}

// The drift tests: the docs with `from` replaced by `to` (which must be there), and whether a
// problem says `text`.
std::string replaced_once(std::string docs, const std::string& from, const std::string& to) {
  const size_t at = docs.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) docs.replace(at, from.size(), to);
  return docs;
}
bool has(const std::vector<std::string>& problems, const std::string& text) {
  for (const std::string& p : problems)
    if (p.find(text) != std::string::npos) return true;
  return false;
}

TEST(Config, DocumentedRangesAndValuesAreTheEnforcedOnes) {
  for (const std::string& p : range_problems(read_docs())) ADD_FAILURE() << "docs/config.md: " << p;
}

// The range check itself catches a bound that moved on either side, and a list that grew.
TEST(Config, RangeCheckDetectsDrift) {
  const std::string docs = read_docs();
  auto mutated = [&](const std::string& from, const std::string& to) {
    return range_problems(replaced_once(docs, from, to));
  };
  EXPECT_TRUE(has(mutated("Transformer blocks, 1 to 1024.", "Transformer blocks, 1 to 2048."),
                  "model.n_layer = 2048 (the edge"));
  EXPECT_TRUE(has(mutated("Transformer blocks, 1 to 1024.", "Transformer blocks, 1 to 512."),
                  "model.n_layer = 513 (just outside"));
  EXPECT_TRUE(has(mutated("Peak learning rate, > 0.", "Peak learning rate, >= 0."),
                  "optim.lr = 0.0 (the edge"));
  EXPECT_TRUE(has(mutated("`adamw` or `sgd`.", "`adamw`, `sgd` or `lion`."),
                  "optim.name = lion is documented but refused"));
  EXPECT_TRUE(has(mutated("Decoupled weight decay, >= 0;", "Decoupled weight decay;"),
                  "optim.weight_decay states no range"));
}

// The docs check itself catches each kind of drift.
TEST(Config, DocsCheckDetectsDrift) {
  const std::string docs = read_docs();
  auto mutated = [&](const std::string& from, const std::string& to) {
    return docs_problems(replaced_once(docs, from, to));
  };
  EXPECT_TRUE(has(mutated("| `lr` | float | `0.003` |", "| `lr` | float | `0.004` |"),
                  "optim.lr is documented with default 0.004 but the code's default is 0.003"));
  EXPECT_TRUE(has(mutated("| `batch_size` | int |", "| `batch_size` | float |"),
                  "train.batch_size is documented as float but is int"));
  EXPECT_TRUE(
      has(mutated("| `hysteresis` |", "| `hysteresys` |"), "scaler.hysteresis is not documented"));
  EXPECT_TRUE(has(mutated("| `hysteresis` |", "| `hysteresys` |"),
                  "scaler.hysteresys is documented but the loader does not know it"));
  EXPECT_TRUE(has(mutated("`[\"q_proj\", \"v_proj\"]`", "`[\"q_proj\"]`"),
                  "model.adapter.target_modules is documented with default"));
}

}  // namespace
}  // namespace keel
