// Built-in arith task: every generated problem is parsed and re-checked, targets cover exactly the
// answer and its newline, held-out problems never appear in training, and generation is
// deterministic from the seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "keel/data/arith.h"
#include "keel/data/loader.h"
#include "keel/numerics/error.h"

namespace keel::data {
namespace {

// "a+b=c\n" -> its parts; written independently of the generator (no std::to_string round trip).
struct Parsed {
  int64_t a = 0, b = 0, c = 0;
  char op = 0;
  size_t eq = 0;  // index of '='
  int a_digits = 0, b_digits = 0;
};

bool parse_number(const std::string& s, size_t& i, int64_t& v, int& digits) {
  const size_t start = i;
  v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') v = v * 10 + (s[i++] - '0');
  digits = static_cast<int>(i - start);
  // No empty numbers and no leading zeros ("007").
  return digits > 0 && !(digits > 1 && s[start] == '0');
}

bool parse_problem(const std::string& s, Parsed& p) {
  size_t i = 0;
  int c_digits = 0;
  if (!parse_number(s, i, p.a, p.a_digits) || i >= s.size()) return false;
  p.op = s[i++];
  if (p.op != '+' && p.op != '-') return false;
  if (!parse_number(s, i, p.b, p.b_digits) || i >= s.size() || s[i] != '=') return false;
  p.eq = i++;
  if (!parse_number(s, i, p.c, c_digits)) return false;
  return i + 1 == s.size() && s[i] == '\n';
}

// Checks one example: a correct sum/difference within the digit limit, and target flags set
// exactly on the bytes after '='.
void check_example(const ByteTokenizer& tok, const Example& e, int64_t digits,
                   const std::string& where) {
  const std::string s = tok.decode(e.tokens);
  ASSERT_EQ(e.tokens.size(), s.size()) << where << ": specials in an arith example";
  Parsed p;
  ASSERT_TRUE(parse_problem(s, p)) << where << ": cannot parse \"" << s << "\"";
  EXPECT_LE(p.a_digits, digits) << where << ": " << s;
  EXPECT_LE(p.b_digits, digits) << where << ": " << s;
  EXPECT_EQ(p.c, p.op == '+' ? p.a + p.b : p.a - p.b) << where << ": wrong answer in " << s;
  EXPECT_GE(p.c, 0) << where << ": " << s;
  ASSERT_EQ(e.target.size(), e.tokens.size()) << where;
  for (size_t t = 0; t < e.target.size(); ++t)
    ASSERT_EQ(e.target[t], t > p.eq ? 1 : 0) << where << ": target flag at " << t << " of " << s;
}

std::string text_of(const ByteTokenizer& tok, const Dataset& ds, int64_t i) {
  return tok.decode(ds.get(i).copy().tokens);
}

TEST(Arith, EveryProblemIsCorrectAndTargetsOnlyTheAnswer) {
  ByteTokenizer tok;
  ArithOptions opt;
  opt.num_train = 3000;
  opt.num_eval = 300;
  ArithTask task = make_arith_task(tok, opt);
  ASSERT_EQ(task.train->size(), 3000);
  ASSERT_EQ(task.eval->size(), 300);
  ASSERT_EQ(task.eval_prompts.size(), 300u);
  ASSERT_EQ(task.eval_answers.size(), 300u);
  for (int64_t i = 0; i < task.train->size(); ++i)
    check_example(tok, task.train->get(i).copy(), opt.digits, "train " + std::to_string(i));
  for (int64_t i = 0; i < task.eval->size(); ++i) {
    check_example(tok, task.eval->get(i).copy(), opt.digits, "eval " + std::to_string(i));
    // The exact-match strings describe the same problem as the eval example.
    EXPECT_EQ(task.eval_prompts[i] + task.eval_answers[i] + "\n", text_of(tok, *task.eval, i));
    EXPECT_EQ(task.eval_prompts[i].back(), '=');
    EXPECT_LE(static_cast<int64_t>(task.eval_answers[i].size()) + 1, task.max_answer_tokens);
  }
  EXPECT_EQ(task.stop_token, '\n');
}

TEST(Arith, CoversBothOperatorsAndEveryDigitCount) {
  ByteTokenizer tok;
  ArithOptions opt;
  opt.num_train = 2000;
  opt.num_eval = 10;
  opt.digits = 4;
  ArithTask task = make_arith_task(tok, opt);
  std::set<char> ops;
  std::set<int> lengths;
  int64_t max_answer = 0;
  for (int64_t i = 0; i < task.train->size(); ++i) {
    Parsed p;
    ASSERT_TRUE(parse_problem(text_of(tok, *task.train, i), p));
    ops.insert(p.op);
    lengths.insert(p.a_digits);
    lengths.insert(p.b_digits);
    max_answer = std::max(max_answer, p.c);
  }
  EXPECT_EQ(ops, (std::set<char>{'+', '-'}));
  EXPECT_EQ(lengths, (std::set<int>{1, 2, 3, 4}));
  EXPECT_GE(max_answer, 10000);  // carries into a fifth digit happen
}

TEST(Arith, SplitsAreDisjointAndHeldOutIsUnique) {
  ByteTokenizer tok;
  // digits = 2 has only 15050 problems, so the training draw hits held-out problems often and
  // must reject them.
  for (int64_t digits : {1, 2, 3}) {
    ArithOptions opt;
    opt.digits = digits;
    opt.num_eval = digits == 1 ? 70 : 500;
    opt.num_train = 5000;
    ArithTask task = make_arith_task(tok, opt);
    std::set<std::string> held_out(task.eval_prompts.begin(), task.eval_prompts.end());
    EXPECT_EQ(held_out.size(), task.eval_prompts.size()) << "repeated held-out problem";
    for (int64_t i = 0; i < task.train->size(); ++i) {
      const std::string s = text_of(tok, *task.train, i);
      const std::string prompt = s.substr(0, s.find('=') + 1);
      ASSERT_EQ(held_out.count(prompt), 0u)
          << "held-out problem " << prompt << " in training (digits " << digits << ")";
    }
  }
}

TEST(Arith, DeterministicFromSeed) {
  ByteTokenizer tok;
  ArithOptions opt;
  opt.num_train = 500;
  opt.num_eval = 50;
  ArithTask a = make_arith_task(tok, opt), b = make_arith_task(tok, opt);
  for (int64_t i = 0; i < a.train->size(); ++i) {
    EXPECT_EQ(a.train->get(i).copy().tokens, b.train->get(i).copy().tokens);
    EXPECT_EQ(a.train->get(i).copy().target, b.train->get(i).copy().target);
  }
  EXPECT_EQ(a.eval_prompts, b.eval_prompts);
  EXPECT_EQ(a.eval_answers, b.eval_answers);

  // Another seed, another task.
  ArithOptions other = opt;
  other.seed = opt.seed + 1;
  ArithTask c = make_arith_task(tok, other);
  int64_t same = 0;
  for (int64_t i = 0; i < a.train->size(); ++i)
    same += a.train->get(i).copy().tokens == c.train->get(i).copy().tokens;
  EXPECT_LT(same, 50);  // only coincidences among the small problems
  EXPECT_NE(a.eval_prompts, c.eval_prompts);

  // The held-out set does not depend on the training size; the training prefix does not either.
  ArithOptions more = opt;
  more.num_train = 800;
  ArithTask d = make_arith_task(tok, more);
  EXPECT_EQ(a.eval_prompts, d.eval_prompts);
  for (int64_t i = 0; i < a.train->size(); ++i)
    EXPECT_EQ(a.train->get(i).copy().tokens, d.train->get(i).copy().tokens);
}

TEST(Arith, LoaderLabelsAreTheAnswers) {
  ByteTokenizer tok;
  ArithOptions opt;
  opt.num_train = 64;
  opt.num_eval = 8;
  ArithTask task = make_arith_task(tok, opt);
  DataLoader loader(*task.eval, 8, 16, tok.pad_id(), false, 0);
  Batch b = loader.batch(0, 0);
  const std::vector<int64_t> labels = b.labels.to_ints();
  const int64_t T = b.labels.size(1);  // padded to the batch's longest row
  EXPECT_LE(T, arith_longest_example(opt.digits));
  int64_t expected_targets = 0;
  for (int64_t r = 0; r < 8; ++r) {
    std::vector<int32_t> predicted;
    for (int64_t t = 0; t < T; ++t)
      if (labels[r * T + t] != kIgnoreLabel) predicted.push_back(labels[r * T + t]);
    EXPECT_EQ(tok.decode(predicted), task.eval_answers[r] + "\n") << "row " << r;
    expected_targets += static_cast<int64_t>(task.eval_answers[r].size()) + 1;
  }
  EXPECT_EQ(b.n_targets, expected_targets);
}

// The memory estimate sizes a run's activations by the longest example (batches are padded to
// their longest row): the formula must be the task's true maximum, in both forms.
TEST(Arith, LongestExampleIsTheFormulasLength) {
  ByteTokenizer tok;
  for (bool aligned : {false, true})
    for (int64_t digits : {1, 2, 3, 5}) {
      ArithOptions opt;
      opt.digits = digits;
      opt.num_train = 2000;
      opt.num_eval = 4;
      opt.reverse_answer = aligned;
      const ArithTask task = make_arith_task(tok, opt);
      size_t longest = 0;
      for (int64_t i = 0; i < task.train->size(); ++i)
        longest = std::max(longest, task.train->get(i).size());
      EXPECT_EQ(static_cast<int64_t>(longest), arith_longest_example(digits))
          << digits << " digits, aligned " << aligned;
    }
}

TEST(Arith, BadOptionsAreUsageErrors) {
  ByteTokenizer tok;
  auto expect_usage = [&](ArithOptions opt, const std::string& needle) {
    try {
      make_arith_task(tok, opt);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind, Error::kUsage);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ArithOptions opt;
  opt.digits = 0;
  expect_usage(opt, "data.digits");
  opt.digits = 19;
  expect_usage(opt, "data.digits");
  opt = {};
  opt.num_train = 0;
  expect_usage(opt, "data.num_examples");
  opt = {};
  opt.num_eval = -1;
  expect_usage(opt, "data.eval_examples");
  // One digit: 100 sums + 55 differences; holding out 78 > 155 / 2 would starve training.
  EXPECT_EQ(arith_problem_count(1), 155.0);
  opt = {};
  opt.digits = 1;
  opt.num_eval = 78;
  expect_usage(opt, "155 distinct problems");
  opt.num_eval = 77;
  opt.num_train = 100;
  EXPECT_EQ(make_arith_task(tok, opt).eval->size(), 77);
  opt.num_eval = 0;  // no held-out set is allowed
  EXPECT_EQ(make_arith_task(tok, opt).eval->size(), 0);
}

}  // namespace
}  // namespace keel::data
