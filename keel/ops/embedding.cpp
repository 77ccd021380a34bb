#include "keel/ops/embedding.h"

#include "keel/backend/embedding.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

struct EmbeddingNode final : Node {
  Tensor ids;  // [...] I32 or I64
  int64_t v = 0, d = 0;
  DType dt = DType::F32;
  // dw[ids[i], :] += g[i, :]: each touched row gets its positions' sum (in position order,
  // deterministic); other rows are left as they are.
  void scatter_into(Tensor& dw, const Tensor& g) const {
    const Tensor gw = g.dtype() == dt ? g : g.to_dtype(dt);
    embedding_kernels(g.device())
        .scatter_add(dw.data(), gw.data(), ids.data(), ids.dtype(), dt, ids.numel(), v, d);
  }
  std::vector<Tensor> backward(const Tensor& g) override {  // g [..., D]
    if (!needs_grad(1)) return {Tensor(), Tensor()};
    Tensor dw = grad_buffer(1, {v, d}, dt, g.device());  // [V, D], a flat home or fresh
    dw.zero();
    scatter_into(dw, g);
    return {Tensor(), dw};
  }
  // The rows go straight into the weight's other gradient (a tied head's): no [V, D] zeros and no
  // dense add.
  bool backward_into(const Tensor& g, const PendingSum& pending_sum) override {
    Tensor* sum = needs_grad(1) ? pending_sum(1) : nullptr;
    if (!sum || sum->dtype() != dt || sum->numel() != v * d || sum->device() != g.device())
      return false;
    scatter_into(*sum, g);
    return true;
  }
  const char* name() const override { return "embedding"; }
};

Tensor embedding(const Tensor& ids, const Tensor& weight) {
  KEEL_CHECK(ids.dtype() == DType::I32 || ids.dtype() == DType::I64,
             std::string("embedding: ids must be i32 or i64, got ") + dtype_name(ids.dtype()));
  check_floating("embedding", weight);
  KEEL_CHECK(weight.dim() == 2,
             "embedding: weight must be [vocab, dim], got " + shape_str(weight.shape()));
  KEEL_CHECK(ids.device() == weight.device(),
             "embedding: ids on " + ids.device().str() + " but weight on " + weight.device().str());
  const int64_t v = weight.size(0), d = weight.size(1), n = ids.numel();
  const auto& k = embedding_kernels(weight.device());
  const int64_t bad = k.find_invalid(ids.data(), ids.dtype(), n, v);
  if (bad >= 0) {
    const int64_t id = ids.view({-1}).slice_rows(bad, bad + 1).to_ints()[0];  // any device
    throw Error("embedding: id " + std::to_string(id) + " at position " + std::to_string(bad) +
                " (index " + shape_str(shape_index(ids.shape(), bad)) + " of ids " +
                shape_str(ids.shape()) + ") is outside [0, " + std::to_string(v) +
                "), the table's vocabulary size; check that the tokenizer matches the model's "
                "vocab_size and that padding/label values (-100) are not fed as input ids");
  }
  Shape out_shape = ids.shape();
  out_shape.push_back(d);
  Tensor out = Tensor::empty(out_shape, weight.dtype(), weight.device());  // [..., D]
  k.gather(out.data(), weight.data(), ids.data(), ids.dtype(), weight.dtype(), n, d);
  if (any_requires_grad({&ids, &weight})) {
    auto node = std::make_shared<EmbeddingNode>();
    node->ids = ids;
    node->v = v;
    node->d = d;
    node->dt = weight.dtype();
    record_node(out, node, {&ids, &weight});
  }
  return out;
}

}  // namespace keel::ops
