// Built-in task "arith": procedurally generated multi-digit addition and subtraction, e.g.
// "417+85=502\n" or "604-37=567\n". Needs no download and is deterministic from a seed, so it
// is the default task of a run and of the tests (a small model learns it in minutes on a CPU).
//
// Each operand draws its digit count uniformly from 1..digits, then a value uniformly among the
// numbers with that many digits (so short problems are as common as long ones). The operator is
// '+' or '-' with equal odds; subtraction swaps the operands when needed so that answers are never
// negative. An example is the bytes of "a+b=c\n"; the targets are the answer digits and the final
// newline only (the model is never trained to predict the question).
//
// The held-out problems are drawn first, without repeats; training problems are then drawn from
// the same distribution with the held-out problems rejected, so no held-out problem (as a string)
// ever appears in training. Training may repeat a problem (small digit counts have few problems).
// Drawing the held-out set first keeps it fixed when num_train changes.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/data/dataset.h"
#include "keel/data/tokenizer.h"

namespace keel::data {

struct ArithOptions {
  int64_t num_train = 20000, num_eval = 500;
  int64_t digits = 3;  // max digits per operand, 1..18
  uint64_t seed = 1337;
  // Aligned form: operands zero-padded to `digits`, the answer zero-padded to digits + 1 and
  // written least-significant digit first ("417+085=2050\n" for 502). Every digit then sits at a
  // fixed position and a left-to-right model emits each answer digit after the carry it depends
  // on: the task is learned several times faster (the default of a run; DataConfig::arith_reverse).
  bool reverse_answer = false;
};

struct ArithTask {
  std::unique_ptr<Dataset> train, eval;  // eval: the held-out problems as examples (eval loss)
  // Exact-match eval: feed the prompt ("417+85="), generate greedily until stop_token ('\n')
  // or max_answer_tokens, and compare the decoded text with the answer ("502", no newline).
  std::vector<std::string> eval_prompts, eval_answers;
  int32_t stop_token = '\n';
  int64_t max_answer_tokens = 0;  // digits + 2: the longest answer (a carry) and its newline
};

// Errors (kind kUsage): digits outside 1..18, num_train < 1, num_eval < 0, or num_eval above half
// of the distinct problems with that many digits (the held-out set would starve training).
ArithTask make_arith_task(const ByteTokenizer& tok, const ArithOptions& opt);

// The tokens of the task's longest example: "a+b=" with two `digits`-digit operands, an answer of
// digits + 1 (a carry; aligned: always that long) and its newline.
inline int64_t arith_longest_example(int64_t digits) { return 3 * digits + 4; }

// Number of distinct problems with operands of at most `digits` digits (a+b for every ordered
// pair, a-b for a >= b), as a double since it overflows int64 beyond 9 digits.
double arith_problem_count(int64_t digits);

}  // namespace keel::data
