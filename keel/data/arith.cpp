#include "keel/data/arith.h"

#include <algorithm>

#include <unordered_set>

#include "keel/data/rng.h"
#include "keel/numerics/error.h"
#include "keel/numerics/text.h"

namespace keel::data {

namespace {

int64_t pow10(int64_t k) {
  int64_t p = 1;
  for (int64_t i = 0; i < k; ++i) p *= 10;
  return p;
}

struct Problem {
  std::string prompt;  // "417+85="
  std::string answer;  // "502"
};

// One draw from the task's distribution (see arith.h).
Problem draw_problem(SplitMix64& rng, int64_t digits, bool reverse) {
  auto operand = [&] {
    const int64_t k = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(digits)));
    const int64_t lo = k == 1 ? 0 : pow10(k - 1), hi = pow10(k) - 1;
    return lo + static_cast<int64_t>(rng.below(static_cast<uint64_t>(hi - lo + 1)));
  };
  int64_t a = operand(), b = operand();
  const bool sub = rng.below(2) == 1;
  if (sub && a < b) std::swap(a, b);
  const int64_t c = sub ? a - b : a + b;  // < 2e18: fits int64 for digits <= 18
  if (!reverse)
    return {std::to_string(a) + (sub ? "-" : "+") + std::to_string(b) + "=", std::to_string(c)};
  // Aligned form: fixed-width operands, answer least-significant digit first.
  auto padded = [](int64_t v, int64_t width) {
    std::string t = std::to_string(v);
    return std::string(
               static_cast<size_t>(std::max<int64_t>(0, width - static_cast<int64_t>(t.size()))),
               '0') +
           t;
  };
  std::string answer = padded(c, digits + 1);
  std::reverse(answer.begin(), answer.end());
  return {padded(a, digits) + (sub ? "-" : "+") + padded(b, digits) + "=", answer};
}

Example make_example(const ByteTokenizer& tok, const Problem& p) {
  Example e;
  e.tokens = tok.encode(p.prompt + p.answer + "\n");
  e.target.assign(e.tokens.size(), 1);
  std::fill(e.target.begin(), e.target.begin() + static_cast<int64_t>(p.prompt.size()), 0);
  return e;
}

}  // namespace

double arith_problem_count(int64_t digits) {
  const double n = static_cast<double>(pow10(digits));  // operands 0 .. 10^digits - 1
  return n * n + n * (n + 1) / 2;
}

ArithTask make_arith_task(const ByteTokenizer& tok, const ArithOptions& opt) {
  auto usage = [](const std::string& what) { return Error("arith task: " + what, Error::kUsage); };
  if (opt.digits < 1 || opt.digits > 18)
    throw usage("data.digits is " + std::to_string(opt.digits) +
                "; it must be in 1..18 (answers must fit in 64 bits)");
  if (opt.num_train < 1)
    throw usage("data.num_examples is " + std::to_string(opt.num_train) + "; it must be >= 1");
  if (opt.num_eval < 0)
    throw usage("data.eval_examples is " + std::to_string(opt.num_eval) + "; it must be >= 0");
  const double space = arith_problem_count(opt.digits);
  if (static_cast<double>(opt.num_eval) > space / 2)
    throw usage("data.eval_examples = " + std::to_string(opt.num_eval) +
                " held-out problems, but " + std::to_string(static_cast<int64_t>(space)) +
                " distinct problems exist with " + count_of(opt.digits, "digit") +
                "; hold out at most half (lower data.eval_examples or raise data.digits)");

  SplitMix64 rng(opt.seed);
  ArithTask task;
  std::unordered_set<std::string> held_out;
  std::vector<Example> eval, train;
  eval.reserve(static_cast<size_t>(opt.num_eval));
  while (static_cast<int64_t>(eval.size()) < opt.num_eval) {
    Problem p = draw_problem(rng, opt.digits, opt.reverse_answer);
    if (!held_out.insert(p.prompt).second) continue;  // no repeats within the held-out set
    eval.push_back(make_example(tok, p));
    task.eval_prompts.push_back(std::move(p.prompt));
    task.eval_answers.push_back(std::move(p.answer));
  }
  train.reserve(static_cast<size_t>(opt.num_train));
  while (static_cast<int64_t>(train.size()) < opt.num_train) {
    const Problem p = draw_problem(rng, opt.digits, opt.reverse_answer);
    if (held_out.count(p.prompt)) continue;  // held-out problems never appear in training
    train.push_back(make_example(tok, p));
  }
  task.train = std::make_unique<ExampleDataset>(std::move(train), "arith train");
  task.eval = std::make_unique<ExampleDataset>(std::move(eval), "arith eval");
  task.max_answer_tokens = opt.digits + 2;
  return task;
}

}  // namespace keel::data
