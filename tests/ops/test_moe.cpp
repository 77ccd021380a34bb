// Mixture-of-experts routing and combine (ops/moe.h): f64 references of the routing (softmax, top
// k, renormalization) and of the combine with HF's roundings, gradient checks of the whole
// route -> gather -> experts -> combine path, ties, NaN, determinism over thread counts, errors.
// The layer's parity with PyTorch is the models' (ModelParity on the qwen3_moe fixture).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "keel/autograd/node.h"
#include "keel/backend/moe.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "keel/ops/moe.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::expect_close;
using test::expect_gradcheck;
using test::randn;

struct RouteRef {
  std::vector<float> weights;
  std::vector<int32_t> experts;
};

// f64 softmax, the k largest (lower index first on a tie), renormalized when asked.
RouteRef route_ref(const Tensor& logits, int64_t k, bool normalize) {
  const auto v = logits.to_floats();
  const int64_t n = logits.size(0), e = logits.size(1);
  RouteRef r;
  for (int64_t t = 0; t < n; ++t) {
    double m = -INFINITY, s = 0;
    for (int64_t x = 0; x < e; ++x) m = std::max(m, double(v[t * e + x]));
    std::vector<double> p(e);
    for (int64_t x = 0; x < e; ++x) s += p[x] = std::exp(double(v[t * e + x]) - m);
    std::vector<int32_t> order(e);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) chosen += p[order[j]] / s;
    for (int64_t j = 0; j < k; ++j) {
      r.experts.push_back(order[j]);
      r.weights.push_back(static_cast<float>(p[order[j]] / s / (normalize ? chosen : 1.0)));
    }
  }
  return r;
}

TEST(MoeRoute, WeightsAndExpertsMatchTheReference) {
  for (DType dt : {DType::F32, DType::BF16})
    for (const bool normalize : {false, true})
      for (int64_t k : {1, 2, 4}) {
        const std::string what = std::string(dtype_name(dt)) + (normalize ? " normalized" : "") +
                                 " k=" + std::to_string(k);
        const Tensor logits = randn({13, 8}, 3, 2.f, dt);
        const ops::MoeRouting r = ops::moe_route(logits, k, normalize);
        const RouteRef ref = route_ref(logits, k, normalize);
        EXPECT_EQ(r.experts, ref.experts) << what;
        EXPECT_EQ(r.weights.shape(), (Shape{13, k})) << what;
        EXPECT_EQ(r.weights.dtype(), DType::F32) << what;
        expect_close(r.weights.to_floats(), ref.weights, 1e-7, 1e-6, what);
        // Each expert's tokens ascending, with the slot that chose it.
        for (size_t x = 0; x < r.rows_of.size(); ++x) {
          for (size_t i = 0; i < r.rows_of[x].size(); ++i) {
            const int64_t t = r.rows_of[x][i];
            if (i) {
              EXPECT_LT(r.rows_of[x][i - 1], t) << what;
            }
            EXPECT_EQ(r.experts[t * k + r.slots_of[x][i]], static_cast<int32_t>(x)) << what;
          }
        }
      }
}

TEST(MoeRoute, TiesGoToTheLowerExpertAndNanIsNeverHidden) {
  // Equal logits: experts 0 and 1 first (torch.topk's order).
  const ops::MoeRouting tie = ops::moe_route(Tensor::from_floats({1, 1, 1, 1}, {1, 4}), 2, true);
  EXPECT_EQ(tie.experts, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(tie.weights.to_floats(), (std::vector<float>{0.5f, 0.5f}));
  // A NaN logit makes the token's every weight NaN, as the softmax it comes from.
  const ops::MoeRouting nan = ops::moe_route(
      Tensor::from_floats({0, std::numeric_limits<float>::quiet_NaN(), 1, 2}, {1, 4}), 2, false);
  for (float w : nan.weights.to_floats()) EXPECT_TRUE(std::isnan(w));
}

// The combine with HF's roundings, in f64 then rounded as each step of
// final.index_add_(0, tokens, (y * w.to(out)).to(out)) rounds.
std::vector<float> combine_ref(const std::vector<Tensor>& ys, const ops::MoeRouting& r, DType out,
                               int64_t d) {
  const auto w = r.weights.to_floats();
  std::vector<float> acc(r.tokens * d, 0.f);
  for (size_t x = 0; x < ys.size(); ++x) {
    if (r.rows_of[x].empty()) continue;
    const auto y = ys[x].to_floats();
    const DType prod = ys[x].dtype() == out ? out : DType::F32;
    for (size_t i = 0; i < r.rows_of[x].size(); ++i) {
      const int64_t t = r.rows_of[x][i];
      const float wt = round_to(out, w[t * r.top_k + r.slots_of[x][i]]);
      for (int64_t j = 0; j < d; ++j) {
        const float v = round_to(out, round_to(prod, y[i * d + j] * wt));
        acc[t * d + j] = round_to(out, acc[t * d + j] + v);
      }
    }
  }
  return acc;
}

TEST(MoeCombine, SumsTheChosenExpertsInExpertOrderWithHfsRoundings) {
  const int64_t n = 9, e = 6, d = 5, k = 2;
  for (DType y_dt : {DType::F32, DType::BF16})
    for (DType out : {DType::F32, DType::BF16}) {
      const std::string what = std::string("y ") + dtype_name(y_dt) + ", out " + dtype_name(out);
      const ops::MoeRouting r = ops::moe_route(randn({n, e}, 5), k, true);
      std::vector<Tensor> ys(e);
      for (int64_t x = 0; x < e; ++x)
        if (!r.rows_of[x].empty()) ys[x] = randn({std::ssize(r.rows_of[x]), d}, 100 + x, 1.f, y_dt);
      const Tensor y = ops::moe_combine(ys, r, out);
      EXPECT_EQ(y.shape(), (Shape{n, d})) << what;
      EXPECT_EQ(y.dtype(), out) << what;
      EXPECT_EQ(y.to_floats(), combine_ref(ys, r, out, d)) << what;  // bit for bit
    }
}

// The whole layer's path, differentiated numerically: logits = x W_r, each expert a linear map of
// its gathered tokens, the combine of their outputs. Logits far apart keep the choices fixed
// under the finite differences.
TEST(MoeCombine, GradientsOfTheWholeRoutedPathMatchFiniteDifferences) {
  const int64_t n = 7, c = 4, e = 5, k = 2;
  for (const bool normalize : {false, true}) {
    auto f = [&](const std::vector<Tensor>& in) {
      const Tensor& x = in[0];  // [n, c]
      const ops::MoeRouting r = ops::moe_route(ops::linear(x, in[1]), k, normalize);
      std::vector<Tensor> ys(e);
      for (int64_t xe = 0; xe < e; ++xe)
        if (!r.rows_of[xe].empty())  // padded to 8 rows, as the layer pads
          ys[xe] = ops::linear(ops::gather_rows(x, r.rows_of[xe], 8), in[2 + xe]);
      return ops::moe_combine(ys, r, DType::F32);
    };
    std::vector<Tensor> inputs = {randn({n, c}, 11), randn({e, c}, 12, 3.f)};
    for (int64_t xe = 0; xe < e; ++xe) inputs.push_back(randn({c, c}, 20 + xe));
    for (Tensor& t : inputs) t.set_requires_grad(true);
    test::GradcheckOptions opt;
    opt.step = 1e-3;
    expect_gradcheck(f, inputs, opt, normalize ? "normalized" : "plain");
  }
}

// An expert's batch padded with zero rows: the gather's padding is zero, the combine reads only
// the tokens' rows, and a padded expert output gives the same sum, bit for bit.
TEST(MoeCombine, PaddedExpertBatchesGiveTheSameSum) {
  EXPECT_EQ(ops::moe_padded_rows(1), 8);
  EXPECT_EQ(ops::moe_padded_rows(64), 64);
  EXPECT_EQ(ops::moe_padded_rows(65), 96);
  EXPECT_EQ(ops::moe_padded_rows(513), 640);
  EXPECT_EQ(ops::moe_padded_rows(5000), 5120);
  const Tensor x = randn({11, 6}, 4);
  const ops::MoeRouting r = ops::moe_route(randn({11, 5}, 6), 2, true);
  const Tensor w = randn({6, 6}, 8);
  std::vector<Tensor> plain(5), padded(5);
  for (int64_t e = 0; e < 5; ++e) {
    if (r.rows_of[e].empty()) continue;
    const int64_t m = std::ssize(r.rows_of[e]), p = ops::moe_padded_rows(m);
    const Tensor g = ops::gather_rows(x, r.rows_of[e], p);
    ASSERT_EQ(g.size(0), p);
    const auto gv = g.to_floats();
    for (int64_t i = m * 6; i < p * 6; ++i) EXPECT_EQ(gv[i], 0.f);
    padded[e] = ops::linear(g, w);
    plain[e] = ops::linear(ops::gather_rows(x, r.rows_of[e]), w);
  }
  EXPECT_EQ(ops::moe_combine(padded, r, DType::F32).to_floats(),
            ops::moe_combine(plain, r, DType::F32).to_floats());
}

TEST(MoeCombine, BitsDoNotDependOnTheThreadCount) {
  const ops::MoeRouting r = ops::moe_route(randn({300, 16}, 7), 4, true);
  std::vector<Tensor> ys(16);
  for (int64_t x = 0; x < 16; ++x)
    if (!r.rows_of[x].empty()) ys[x] = randn({std::ssize(r.rows_of[x]), 64}, 30 + x);
  std::vector<float> first;
  for (int threads : {1, 3}) {
    test::ThreadsGuard guard(threads);
    const auto got = ops::moe_combine(ys, r, DType::BF16).to_floats();
    if (first.empty())
      first = got;
    else
      EXPECT_EQ(got, first);
  }
}

// The load-balancing loss (ops::MoeBalance) against HF's load_balancing_loss_func written out in
// f64 over two layers' routings with padding, and its gradient, with the routing weights', against
// finite differences of F = <g1, w1> + <g2, w2> + c * loss (the choices fixed: logits far apart).
TEST(MoeBalance, LossIsHfsAndItsGradientMatchesFiniteDifferences) {
  const int64_t n = 6, e = 5, k = 2;
  const Tensor mask = Tensor::from_ints({1, 1, 1, 0, 1, 0}, {2, 3}, DType::U8);
  const std::vector<float> g1 = randn({n, k}, 31).to_floats(), g2 = randn({n, k}, 32).to_floats();
  const double c = 0.7;
  for (const bool normalize : {false, true}) {
    SCOPED_TRACE(normalize ? "normalized" : "plain");
    // HF's function: the layers' logits concatenated, masked means of the one-hot choices and of
    // the softmax, their product summed times the experts.
    auto hf_loss = [&](const std::vector<std::vector<float>>& layers) {
      std::vector<double> chosen(e, 0), probs(e, 0);
      double tokens = 0;
      for (const auto& l : layers)
        for (int64_t t = 0; t < n; ++t) {
          if (!mask.data_as<uint8_t>()[t]) continue;
          tokens += 1;
          const std::vector<float> row(l.begin() + t * e, l.begin() + t * e + e);
          const RouteRef r = route_ref(Tensor::from_floats(row, {1, e}), k, false);
          for (int32_t x : r.experts) chosen[x] += 1;
          double m = -INFINITY, sum = 0;
          for (int64_t x = 0; x < e; ++x) m = std::max(m, double(l[t * e + x]));
          for (int64_t x = 0; x < e; ++x) sum += std::exp(double(l[t * e + x]) - m);
          for (int64_t x = 0; x < e; ++x) probs[x] += std::exp(double(l[t * e + x]) - m) / sum;
        }
      double out = 0;
      for (int64_t x = 0; x < e; ++x) out += chosen[x] / tokens * (probs[x] / tokens);
      return out * e;
    };
    // F through keel's routing and balance.
    auto objective = [&](const std::vector<std::vector<float>>& layers, double* aux) {
      auto balance = std::make_shared<ops::MoeBalance>();
      balance->begin(mask, n);
      double f = 0;
      for (size_t l = 0; l < layers.size(); ++l) {
        const ops::MoeRouting r =
            ops::moe_route(Tensor::from_floats(layers[l], {n, e}), k, normalize, balance);
        const auto w = r.weights.to_floats();
        for (size_t i = 0; i < w.size(); ++i) f += double(l ? g2[i] : g1[i]) * w[i];
      }
      if (aux) *aux = balance->forward.loss();
      return f + c * balance->forward.loss();
    };
    std::vector<std::vector<float>> layers = {randn({n, e}, 41, 3.f).to_floats(),
                                              randn({n, e}, 42, 3.f).to_floats()};
    double aux = 0;
    objective(layers, &aux);
    EXPECT_NEAR(aux, hf_loss(layers), 1e-6);
    // Analytic: the routes' backward with g on the weights and balance->grad = c.
    auto balance = std::make_shared<ops::MoeBalance>();
    balance->begin(mask, n);
    std::vector<Tensor> logits, weights;
    std::vector<ops::MoeRouting> routes;
    for (size_t l = 0; l < 2; ++l) {
      logits.push_back(Tensor::from_floats(layers[l], {n, e}));
      logits.back().set_requires_grad(true);
      routes.push_back(ops::moe_route(logits.back(), k, normalize, balance));
    }
    // (A recompute's routing, count = false, adds nothing to the sums.)
    ops::moe_route(Tensor::from_floats(layers[0], {n, e}), k, normalize, balance, false);
    EXPECT_DOUBLE_EQ(balance->forward.loss(), aux);
    EXPECT_EQ(balance->forward.tokens, 2 * 4);
    balance->grad = c;
    backward(routes[0].weights, Tensor::from_floats(g1, {n, k}));
    backward(routes[1].weights, Tensor::from_floats(g2, {n, k}));
    const double h = 1e-3;
    for (size_t l = 0; l < 2; ++l) {
      const auto analytic = logits[l].grad().to_floats();
      for (size_t i = 0; i < layers[l].size(); ++i) {
        auto plus = layers, minus = layers;
        plus[l][i] += static_cast<float>(h);
        minus[l][i] -= static_cast<float>(h);
        const double numeric = (objective(plus, nullptr) - objective(minus, nullptr)) / (2 * h);
        EXPECT_NEAR(analytic[i], numeric, 2e-3 + 2e-3 * std::fabs(numeric))
            << "layer " << l << " logit " << i;
      }
    }
    // A padded token's logits get the weights' gradient alone: balance->grad = 0 gives it too.
    auto unbalanced = std::make_shared<ops::MoeBalance>();
    unbalanced->begin(mask, n);
    Tensor l0 = Tensor::from_floats(layers[0], {n, e});
    l0.set_requires_grad(true);
    const ops::MoeRouting r0 = ops::moe_route(l0, k, normalize, unbalanced);
    backward(r0.weights, Tensor::from_floats(g1, {n, k}));
    const auto with = logits[0].grad().to_floats(), without = l0.grad().to_floats();
    for (int64_t t : {3, 5})
      for (int64_t x = 0; x < e; ++x) EXPECT_EQ(with[t * e + x], without[t * e + x]);
    EXPECT_NE(with[0], without[0]);
  }
  // Even routing: every token's probabilities uniform, choices spread evenly, gives top_k.
  auto even = std::make_shared<ops::MoeBalance>();
  even->begin(Tensor(), 4);
  ops::moe_route(Tensor::zeros({4, 4}, DType::F32), 1, false, even);  // ties: expert 0 takes all
  EXPECT_DOUBLE_EQ(even->forward.loss(), 1.0);  // 4 * (1 * 1/4): P even, whatever f is
  EXPECT_DOUBLE_EQ(even->step.loss(), 1.0);
}

// Qwen2-MoE's gated shared expert: sigmoid(logit) * x against f64, and both gradients against
// finite differences; the sigmoid rounded to bf16 first under bf16.
TEST(MoeGateRows, ValuesAndGradientsMatch) {
  const Tensor x = randn({5, 3}, 51), logit = randn({5, 1}, 52, 2.f);
  const auto xv = x.to_floats(), lv = logit.to_floats();
  const auto out = ops::gate_rows(x, logit).to_floats();
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_NEAR(out[t * 3 + j], xv[t * 3 + j] / (1 + std::exp(-double(lv[t]))), 1e-6);
  std::vector<Tensor> inputs = {randn({5, 3}, 53), randn({5, 1}, 54)};
  for (Tensor& t : inputs) t.set_requires_grad(true);
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::gate_rows(in[0], in[1]); },
                   inputs, test::GradcheckOptions{}, "gate_rows");
  const Tensor xb = randn({2, 4}, 55, 1.f, DType::BF16), lb = randn({2, 1}, 56, 1.f, DType::BF16);
  const auto yb = ops::gate_rows(xb, lb).to_floats();
  const auto xbv = xb.to_floats(), lbv = lb.to_floats();
  for (int64_t t = 0; t < 2; ++t) {
    const float s = Tensor::full({}, 1.0f / (1.0f + std::exp(-lbv[t])), DType::BF16).item();
    for (int64_t j = 0; j < 4; ++j)
      EXPECT_EQ(yb[t * 4 + j], Tensor::full({}, s * xbv[t * 4 + j], DType::BF16).item());
  }
}

TEST(MoeErrors, ShapesTopKAndTheGpuAreNamed) {
  EXPECT_NE(test::error_of([] {
              ops::moe_route(randn({3, 4}, 1), 5, true);
            }).find("top_k = 5 of 4"),
            std::string::npos);
  EXPECT_NE(test::error_of([] {
              ops::moe_route(randn({3}, 1), 1, true);
            }).find("router logits must be [tokens, experts]"),
            std::string::npos);
  const ops::MoeRouting r = ops::moe_route(randn({3, 2}, 1), 1, true);
  std::vector<Tensor> wrong(2);
  for (int x = 0; x < 2; ++x)
    if (!r.rows_of[x].empty()) wrong[x] = randn({std::ssize(r.rows_of[x]) - 1, 4}, 2);
  EXPECT_NE(test::error_of([&] { ops::moe_combine(wrong, r, DType::F32); }).find("output must be"),
            std::string::npos);
  // A GPU has no MoE kernels yet: the message says where the layer runs.
  const std::string m = test::error_of([] { moe_kernels(Device::cuda(0)); });
  EXPECT_NE(m.find("runs on the CPU only"), std::string::npos) << m;
  EXPECT_NE(m.find("run.device = \"cpu\""), std::string::npos) << m;
}

}  // namespace
}  // namespace keel
