#include "keel/ops/moe.h"

#include <algorithm>
#include <memory>
#include <span>
#include <string>

#include "keel/backend/moe.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {

// The routing's plan as the kernels read it (pointers into `r`'s lists).
std::vector<MoeExpertRows> expert_rows(const MoeRouting& r) {
  std::vector<MoeExpertRows> rows(r.rows_of.size());
  for (size_t x = 0; x < rows.size(); ++x)
    rows[x] = {r.rows_of[x].data(), r.slots_of[x].data(), std::ssize(r.rows_of[x])};
  return rows;
}

}  // namespace

double MoeBalance::Sums::loss() const {
  if (tokens == 0) return 0;
  double sum = 0;
  for (size_t x = 0; x < chosen.size(); ++x) sum += chosen[x] * probs[x];
  const auto n = static_cast<double>(tokens);
  return static_cast<double>(chosen.size()) * sum / (n * n);
}

void MoeBalance::Sums::clear() {
  std::fill(chosen.begin(), chosen.end(), 0.0);
  std::fill(probs.begin(), probs.end(), 0.0);
  tokens = 0;
}

void MoeBalance::begin(const Tensor& key_padding, int64_t tokens_per_layer) {
  forward.clear();
  counted.clear();
  if (!key_padding.defined()) return;
  KEEL_CHECK(key_padding.numel() == tokens_per_layer,
             "MoeBalance: a mask of " + std::to_string(key_padding.numel()) + " for " +
                 std::to_string(tokens_per_layer) + " tokens");
  const Tensor mask = key_padding.to(Device::cpu()).to_dtype(DType::U8);
  const auto* m = mask.data_as<uint8_t>();
  counted.assign(m, m + tokens_per_layer);
}

namespace {

// A layer's routing added to a balance's sums: each counted token's k choices and probabilities.
void add_routing(MoeBalance& b, const float* probs, const std::vector<int32_t>& experts, int64_t n,
                 int64_t e, int64_t k) {
  for (MoeBalance::Sums* s : {&b.forward, &b.step}) {
    s->chosen.resize(static_cast<size_t>(e), 0.0);
    s->probs.resize(static_cast<size_t>(e), 0.0);
  }
  std::vector<double> chosen(static_cast<size_t>(e), 0.0), prob(static_cast<size_t>(e), 0.0);
  int64_t tokens = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (!b.counted.empty() && !b.counted[static_cast<size_t>(t)]) continue;
    ++tokens;
    for (int64_t j = 0; j < k; ++j) chosen[static_cast<size_t>(experts[t * k + j])] += 1;
    for (int64_t x = 0; x < e; ++x) prob[static_cast<size_t>(x)] += probs[t * e + x];
  }
  for (MoeBalance::Sums* s : {&b.forward, &b.step}) {
    for (size_t x = 0; x < chosen.size(); ++x) {
      s->chosen[x] += chosen[x];
      s->probs[x] += prob[x];
    }
    s->tokens += tokens;
  }
}

}  // namespace

// The weights' backward, through the renormalization and the softmax (backend/moe.h), with the
// balance loss's gradient where a balance asks for one.
struct MoeRouteNode final : Node {
  Tensor probs;  // [tokens, experts] f32
  Tensor weights;
  std::vector<int32_t> experts;
  int64_t k = 0;
  bool normalize = false;
  DType logits_dt = DType::F32;
  std::shared_ptr<const MoeBalance> balance;
  std::vector<Tensor> backward(const Tensor& g) override {  // g [tokens, k]
    const Tensor gw = g.dtype() == DType::F32 ? g : g.to_dtype(DType::F32);
    const int64_t n = probs.size(0), e = probs.size(1);
    // d(grad * loss)/dP_x for each counted token: grad * experts * f_x / N, f_x = chosen_x / N.
    std::vector<float> dprobs;
    if (balance && balance->grad != 0 && balance->forward.tokens > 0) {
      const MoeBalance::Sums& f = balance->forward;
      const auto tokens = static_cast<double>(f.tokens);
      for (int64_t x = 0; x < e; ++x)
        dprobs.push_back(static_cast<float>(balance->grad * static_cast<double>(e) *
                                            f.chosen[static_cast<size_t>(x)] / (tokens * tokens)));
    }
    Tensor dlogits = Tensor::empty({n, e}, logits_dt, probs.device());
    moe_kernels(probs.device())
        .route_backward(
            dlogits.data(), logits_dt, gw.data_as<float>(), probs.data_as<float>(),
            weights.data_as<float>(), experts.data(), n, e, k, normalize,
            dprobs.empty() ? nullptr : dprobs.data(),
            dprobs.empty() || balance->counted.empty() ? nullptr : balance->counted.data());
    return {dlogits};
  }
  const char* name() const override { return "moe_route"; }
};

MoeRouting moe_route(const Tensor& router_logits, int64_t top_k, bool normalize,
                     const std::shared_ptr<MoeBalance>& balance, bool count) {
  check_floating("moe_route", router_logits);
  KEEL_CHECK(router_logits.dim() == 2, "moe_route: router logits must be [tokens, experts], got " +
                                           shape_str(router_logits.shape()));
  const int64_t n = router_logits.size(0), e = router_logits.size(1);
  KEEL_CHECK(top_k >= 1 && top_k <= e, "moe_route: top_k = " + std::to_string(top_k) + " of " +
                                           std::to_string(e) + " experts");
  const Device dev = router_logits.device();
  const MoeKernels& kern = moe_kernels(dev);
  MoeRouting r;
  r.tokens = n;
  r.top_k = top_k;
  Tensor probs = Tensor::empty({n, e}, DType::F32, dev);
  r.weights = Tensor::empty({n, top_k}, DType::F32, dev);
  r.experts.resize(static_cast<size_t>(n * top_k));
  kern.route(router_logits.data(), router_logits.dtype(), n, e, top_k, normalize,
             probs.data_as<float>(), r.weights.data_as<float>(), r.experts.data());
  r.rows_of.resize(static_cast<size_t>(e));
  r.slots_of.resize(static_cast<size_t>(e));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const auto x = static_cast<size_t>(r.experts[static_cast<size_t>(t * top_k + j)]);
      r.rows_of[x].push_back(t);
      r.slots_of[x].push_back(static_cast<int32_t>(j));
    }
  if (balance) {
    KEEL_CHECK(balance->counted.empty() || std::ssize(balance->counted) == n,
               "moe_route: a balance counting " + std::to_string(balance->counted.size()) +
                   " tokens for a layer of " + std::to_string(n));
    if (count) add_routing(*balance, probs.data_as<float>(), r.experts, n, e, top_k);
  }
  if (any_requires_grad({&router_logits})) {
    auto node = std::make_shared<MoeRouteNode>();
    node->probs = probs;
    node->weights = r.weights.view(r.weights.shape());  // no weights -> node -> weights cycle
    node->experts = r.experts;
    node->k = top_k;
    node->normalize = normalize;
    node->logits_dt = router_logits.dtype();
    node->balance = balance;
    record_node(r.weights, node, {&router_logits});
  }
  return r;
}

int64_t moe_padded_rows(int64_t m) {
  const int64_t step = m <= 64 ? 8 : m <= 512 ? 32 : m <= 4096 ? 128 : 512;
  return (m + step - 1) / step * step;
}

// The gather's backward: each real row's gradient added to its token's row of dx.
struct MoeGatherNode final : Node {
  std::vector<int64_t> rows;
  int64_t n = 0, d = 0;
  DType dt = DType::F32;
  void scatter_into(Tensor& dx, const Tensor& g) const {
    const Tensor gx = g.dtype() == dt ? g : g.to_dtype(dt);
    moe_kernels(g.device()).scatter_add(dx.data(), gx.data(), dt, rows.data(), std::ssize(rows), d);
  }
  std::vector<Tensor> backward(const Tensor& g) override {
    if (!needs_grad(0)) return {Tensor()};
    Tensor dx = grad_buffer(0, {n, d}, dt, g.device());
    dx.zero();
    scatter_into(dx, g);
    return {dx};
  }
  // The rows go straight into x's other gradients (the router's, the other experts'): no [n, d]
  // zeros per expert.
  bool backward_into(const Tensor& g, const PendingSum& pending_sum) override {
    Tensor* sum = needs_grad(0) ? pending_sum(0) : nullptr;
    if (!sum || sum->dtype() != dt || sum->numel() != n * d || sum->device() != g.device())
      return false;
    scatter_into(*sum, g);
    return true;
  }
  const char* name() const override { return "gather_rows"; }
};

Tensor gather_rows(const Tensor& x, const std::vector<int64_t>& rows, int64_t padded) {
  check_floating("gather_rows", x);
  KEEL_CHECK(x.dim() == 2, "gather_rows: x must be [tokens, d], got " + shape_str(x.shape()));
  const int64_t n = x.size(0), d = x.size(1), m = std::ssize(rows);
  for (int64_t r : rows)
    KEEL_CHECK(r >= 0 && r < n,
               "gather_rows: row " + std::to_string(r) + " of " + std::to_string(n));
  Tensor out = Tensor::empty({std::max(m, padded), d}, x.dtype(), x.device());
  moe_kernels(x.device()).gather(out.data(), x.data(), x.dtype(), rows.data(), m, out.size(0), d);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<MoeGatherNode>();
    node->rows = rows;
    node->n = n;
    node->d = d;
    node->dt = x.dtype();
    record_node(out, node, {&x});
  }
  return out;
}

// The combine's backward: each expert output's gradient and the weights' (backend/moe.h).
struct MoeCombineNode final : Node {
  std::vector<Tensor> ys;  // the experts' outputs (undefined: no rows)
  MoeRouting plan;         // its weights [tokens, k] f32 an input of this node
  int64_t d = 0;
  std::vector<Tensor> backward(const Tensor& g) override {  // g [tokens, d]
    std::vector<Tensor> grads(1 + ys.size());
    std::vector<const void*> y_ptrs(ys.size(), nullptr);
    std::vector<void*> dy_ptrs(ys.size(), nullptr);
    std::vector<DType> y_dts(ys.size(), DType::F32);
    for (size_t x = 0; x < ys.size(); ++x) {
      if (!ys[x].defined()) continue;
      y_ptrs[x] = ys[x].data();
      y_dts[x] = ys[x].dtype();
      if (!needs_grad(1 + x)) continue;
      // (zeros: the rows past the tokens', an expert output's padding, get none)
      grads[1 + x] = Tensor::zeros(ys[x].shape(), ys[x].dtype(), ys[x].device());
      dy_ptrs[x] = grads[1 + x].data();
    }
    const Tensor& weights = plan.weights;
    if (needs_grad(0)) grads[0] = Tensor::zeros(weights.shape(), DType::F32, weights.device());
    const std::vector<MoeExpertRows> rows = expert_rows(plan);
    moe_kernels(g.device())
        .combine_backward(g.data(), g.dtype(), y_ptrs.data(), y_dts.data(), dy_ptrs.data(),
                          rows.data(), std::ssize(rows), weights.data_as<float>(),
                          grads[0].defined() ? grads[0].data_as<float>() : nullptr, plan.top_k, d);
    return grads;
  }
  const char* name() const override { return "moe_combine"; }
};

Tensor moe_combine(const std::vector<Tensor>& expert_outputs, const MoeRouting& routing,
                   DType dtype) {
  const size_t e = routing.rows_of.size();
  KEEL_CHECK(expert_outputs.size() == e, "moe_combine: " + std::to_string(expert_outputs.size()) +
                                             " expert outputs for " + std::to_string(e) +
                                             " experts");
  int64_t d = -1;
  Device dev = routing.weights.device();
  std::vector<const void*> y_ptrs(e, nullptr);
  std::vector<DType> y_dts(e, DType::F32);
  for (size_t x = 0; x < e; ++x) {
    const Tensor& y = expert_outputs[x];
    const int64_t rows = std::ssize(routing.rows_of[x]);
    if (rows == 0) continue;
    KEEL_CHECK(y.defined() && y.dim() == 2 && y.size(0) >= rows && (d < 0 || y.size(1) == d),
               "moe_combine: expert " + std::to_string(x) + "'s output must be [" +
                   std::to_string(rows) + " or more, d], got " +
                   (y.defined() ? shape_str(y.shape()) : std::string("none")));
    check_floating("moe_combine", y);
    d = y.size(1);
    y_ptrs[x] = y.data();
    y_dts[x] = y.dtype();
  }
  KEEL_CHECK(d >= 0, "moe_combine: no expert has rows (a routing of no tokens)");
  const std::vector<MoeExpertRows> rows = expert_rows(routing);
  Tensor out = Tensor::empty({routing.tokens, d}, dtype, dev);
  moe_kernels(dev).combine(out.data(), dtype, y_ptrs.data(), y_dts.data(), rows.data(),
                           std::ssize(rows), routing.weights.data_as<float>(), routing.top_k,
                           routing.tokens, d);
  std::vector<const Tensor*> inputs = {&routing.weights};
  for (const Tensor& y : expert_outputs) inputs.push_back(y.defined() ? &y : nullptr);
  if (any_requires_grad(std::span<const Tensor* const>(inputs))) {
    auto node = std::make_shared<MoeCombineNode>();
    for (size_t x = 0; x < e; ++x)
      node->ys.push_back(routing.rows_of[x].empty() ? Tensor() : expert_outputs[x]);
    node->plan = routing;
    node->d = d;
    record_node(out, node, std::span<const Tensor* const>(inputs));
  }
  return out;
}

// The gated rows' backward: x's gradient and the gate logit's (backend/moe.h).
struct GateRowsNode final : Node {
  Tensor x, logit;
  std::vector<Tensor> backward(const Tensor& g) override {  // g [n, d]
    const Tensor gd = g.dtype() == x.dtype() ? g : g.to_dtype(x.dtype());
    Tensor dx = needs_grad(0) ? Tensor::empty_like(x) : Tensor();
    Tensor dl = needs_grad(1) ? Tensor::empty_like(logit) : Tensor();
    moe_kernels(x.device())
        .gate_rows_backward(dx.defined() ? dx.data() : nullptr, dl.defined() ? dl.data() : nullptr,
                            gd.data(), x.data(), logit.data(), x.dtype(), x.size(0), x.size(1));
    return {dx, dl};
  }
  const char* name() const override { return "gate_rows"; }
};

Tensor gate_rows(const Tensor& x, const Tensor& logit) {
  check_floating("gate_rows", x);
  KEEL_CHECK(x.dim() == 2 && logit.dim() == 2 && logit.size(0) == x.size(0) && logit.size(1) == 1,
             "gate_rows: x [n, d] and logit [n, 1], got " + shape_str(x.shape()) + " and " +
                 shape_str(logit.shape()));
  KEEL_CHECK(logit.dtype() == x.dtype(), "gate_rows: x and logit of one dtype");
  Tensor out = Tensor::empty_like(x);
  moe_kernels(x.device())
      .gate_rows(out.data(), x.data(), logit.data(), x.dtype(), x.size(0), x.size(1));
  if (any_requires_grad({&x, &logit})) {
    auto node = std::make_shared<GateRowsNode>();
    node->x = x;
    node->logit = logit;
    record_node(out, node, {&x, &logit});
  }
  return out;
}

}  // namespace keel::ops
