#include "keel/ops/shape.h"

#include <numeric>

#include "keel/backend/shape.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {

// A copy of x with dims d0 < d1 swapped, outside autograd.
Tensor swap_copy(const Tensor& x, int64_t d0, int64_t d1) {
  const Shape& s = x.shape();
  auto prod = [&](int64_t lo, int64_t hi) {
    int64_t p = 1;
    for (int64_t k = lo; k < hi; ++k) p *= s[k];
    return p;
  };
  Shape out_shape = s;
  std::swap(out_shape[d0], out_shape[d1]);
  Tensor out = Tensor::empty(out_shape, x.dtype(), x.device());
  // x viewed as [outer, n0, mid, n1, inner]
  shape_kernels(x.device())
      .swap_dims(out.data(), x.data(), dtype_size(x.dtype()), prod(0, d0), s[d0], prod(d0 + 1, d1),
                 s[d1], prod(d1 + 1, x.dim()));
  return out;
}

int64_t normalize_dim(const char* op, int64_t d, int64_t ndim) {
  KEEL_CHECK(d >= -ndim && d < ndim, std::string(op) + ": dim " + std::to_string(d) +
                                         " out of range for a " + std::to_string(ndim) +
                                         "-d tensor");
  return d < 0 ? d + ndim : d;
}

}  // namespace

// ---- reshape: a view; the gradient is viewed back.

struct ReshapeNode final : Node {
  Shape in_shape;
  std::vector<Tensor> backward(const Tensor& g) override { return {g.view(in_shape)}; }
  const char* name() const override { return "reshape"; }
};

Tensor reshape(const Tensor& x, const Shape& shape) {
  int64_t known = 1, inferred = 0;
  for (int64_t d : shape) {
    KEEL_CHECK(d >= -1, "reshape: bad size " + std::to_string(d) + " in " + shape_str(shape));
    if (d == -1)
      ++inferred;
    else
      known *= d;
  }
  const bool fits =
      inferred == 0 ? known == x.numel() : inferred == 1 && known > 0 && x.numel() % known == 0;
  KEEL_CHECK(fits, "reshape: cannot reshape " + shape_str(x.shape()) + " (" +
                       std::to_string(x.numel()) + " elements) into " + shape_str(shape) +
                       " (at most one -1; the other sizes must divide the element count)");
  Tensor out = x.view(shape);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<ReshapeNode>();
    node->in_shape = x.shape();
    record_node(out, node, {&x});
  }
  return out;
}

// ---- transpose, split_heads, merge_heads: a swap of two dims between two views,
//      out = swap(x.view(pre), d0, d1).view(post), recorded as one node.

struct SwapDimsNode final : Node {
  int64_t d0 = 0, d1 = 0;  // d0 <= d1
  Shape swapped;           // pre with d0, d1 exchanged: the gradient's shape before swapping back
  Shape in_shape;          // x's shape
  const char* op = "transpose";
  std::vector<Tensor> backward(const Tensor& g) override {
    // Swapping the same two dims again is the inverse permutation.
    const Tensor gs = g.view(swapped);
    const Tensor gx = d0 == d1 ? gs.clone() : swap_copy(gs, d0, d1);
    return {gx.view(in_shape)};
  }
  const char* name() const override { return op; }
};

namespace {
Tensor swap_op(const char* op, const Tensor& x, const Shape& pre, int64_t d0, int64_t d1,
               const Shape& post) {
  const Tensor xv = x.view(pre);
  Tensor out = (d0 == d1 ? xv.clone() : swap_copy(xv, d0, d1)).view(post);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<SwapDimsNode>();
    node->d0 = d0;
    node->d1 = d1;
    node->swapped = pre;
    std::swap(node->swapped[d0], node->swapped[d1]);
    node->in_shape = x.shape();
    node->op = op;
    record_node(out, node, {&x});
  }
  return out;
}
}  // namespace

Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1) {
  int64_t d0 = normalize_dim("transpose", dim0, x.dim());
  int64_t d1 = normalize_dim("transpose", dim1, x.dim());
  if (d0 > d1) std::swap(d0, d1);
  Shape post = x.shape();
  std::swap(post[d0], post[d1]);
  return swap_op("transpose", x, x.shape(), d0, d1, post);
}

Tensor split_heads(const Tensor& x, int64_t n_heads) {
  KEEL_CHECK(x.dim() == 3 && n_heads > 0 && x.size(2) % n_heads == 0,
             "split_heads: x must be [B, T, H*D] with H = " + std::to_string(n_heads) +
                 " dividing the last dim, got " + shape_str(x.shape()));
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2) / n_heads;
  // [B, T, H, D] -> [B, H, T, D]
  return swap_op("split_heads", x, {b, t, n_heads, d}, 1, 2, {b, n_heads, t, d});
}

Tensor merge_heads(const Tensor& x) {
  KEEL_CHECK(x.dim() == 4, "merge_heads: x must be [B, H, T, D], got " + shape_str(x.shape()));
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  // [B, H, T, D] -> [B, T, H, D] viewed as [B, T, H*D]
  return swap_op("merge_heads", x, x.shape(), 1, 2, {b, t, h * d});
}

// ---- split_last: pieces of the last dim.
//
// Every node has one output, so each piece gets its own node. Their gradients meet in one buffer
// (x's shape, zero where no piece wrote): each piece's backward copies its columns in, the first
// to run hands the buffer to a join node created before the pieces (so it runs after all of them,
// and nothing else feeds it), and the join node passes it on to x. A piece that receives no
// gradient leaves its columns zero.

struct SplitGradBuffer {
  Tensor grad;  // [..., C] in x's dtype; defined between the first piece's backward and the join
};

struct SplitJoinNode final : Node {
  std::shared_ptr<SplitGradBuffer> buf;
  std::vector<Tensor> backward(const Tensor& g) override {
    buf->grad = Tensor();  // ready for another backward pass over the same graph
    return {g};
  }
  const char* name() const override { return "split_last"; }
};

struct SplitPieceNode final : Node {
  std::shared_ptr<SplitGradBuffer> buf;
  Shape x_shape;
  DType dt = DType::F32;
  int64_t rows = 0, cols = 0, begin = 0, width = 0;  // x as [rows, cols]; piece = [begin, +width)
  std::vector<Tensor> backward(const Tensor& g) override {  // g [..., width]
    const bool first = !buf->grad.defined();
    if (first) buf->grad = Tensor::zeros(x_shape, dt, g.device());
    const Tensor gp = g.dtype() == dt ? g : g.to_dtype(dt);
    shape_kernels(g.device())
        .copy_2d(static_cast<char*>(buf->grad.data()) + begin * dtype_size(dt), cols, gp.data(),
                 width, dtype_size(dt), rows, width);
    return {first ? buf->grad : Tensor()};
  }
  const char* name() const override { return "split_last_piece"; }
};

std::vector<Tensor> split_last(const Tensor& x, const std::vector<int64_t>& sizes) {
  KEEL_CHECK(x.dim() >= 1, "split_last: x must have at least one dim");
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  int64_t total = 0;
  for (int64_t s : sizes) {
    KEEL_CHECK(s >= 0, "split_last: negative piece size " + std::to_string(s));
    total += s;
  }
  KEEL_CHECK(total == cols, "split_last: sizes " + shape_str(sizes) + " sum to " +
                                std::to_string(total) + " but the last dim of " +
                                shape_str(x.shape()) + " is " + std::to_string(cols));
  const bool grad = any_requires_grad({&x});
  Tensor joint;  // x's stand-in in the graph: its grad_fn is the join node
  auto buf = std::make_shared<SplitGradBuffer>();
  if (grad) {
    joint = x.view(x.shape());
    auto join = std::make_shared<SplitJoinNode>();
    join->buf = buf;
    record_node(joint, join, {&x});
  }
  const size_t elem = dtype_size(x.dtype());
  std::vector<Tensor> pieces;
  int64_t begin = 0;
  for (int64_t w : sizes) {
    Shape ps = x.shape();
    ps.back() = w;
    Tensor p = Tensor::empty(ps, x.dtype(), x.device());  // [..., w]
    shape_kernels(x.device())
        .copy_2d(p.data(), w, static_cast<const char*>(x.data()) + begin * elem, cols, elem, rows,
                 w);
    if (grad) {
      auto node = std::make_shared<SplitPieceNode>();
      node->buf = buf;
      node->x_shape = x.shape();
      node->dt = x.dtype();
      node->rows = rows;
      node->cols = cols;
      node->begin = begin;
      node->width = w;
      record_node(p, node, {&joint});
    }
    pieces.push_back(p);
    begin += w;
  }
  return pieces;
}

// ---- concat_last: split_last's inverse; its backward cuts the gradient into the parts' widths.

struct ConcatLastNode final : Node {
  int64_t rows = 0;
  std::vector<Shape> shapes;                                // the parts'
  std::vector<Tensor> backward(const Tensor& g) override {  // g [..., sum of the widths]
    int64_t total = 0;
    for (const Shape& s : shapes) total += s.back();
    const size_t elem = dtype_size(g.dtype());
    const char* src = static_cast<const char*>(g.data());
    std::vector<Tensor> grads(shapes.size());
    int64_t begin = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t w = shapes[i].back();
      if (needs_grad(i)) {
        grads[i] = Tensor::empty(shapes[i], g.dtype(), g.device());
        shape_kernels(g.device())
            .copy_2d(grads[i].data(), w, src + begin * elem, total, elem, rows, w);
      }
      begin += w;
    }
    return grads;
  }
  const char* name() const override { return "concat_last"; }
};

Tensor concat_last(const std::vector<Tensor>& parts) {
  KEEL_CHECK(!parts.empty(), "concat_last: no parts");
  const Tensor& a = parts[0];
  int64_t n = 1, total = 0;  // rows (the leading dims' product), the output's width
  for (const Tensor& p : parts) {
    KEEL_CHECK(
        p.dim() >= 1 && p.dim() == a.dim() && p.dtype() == a.dtype() && p.device() == a.device(),
        "concat_last: parts " + shape_str(a.shape()) + " and " + shape_str(p.shape()) +
            " must share their rank, dtype and device");
    for (int64_t d = 0; d + 1 < a.dim(); ++d)
      KEEL_CHECK(p.size(d) == a.size(d), "concat_last: leading dims differ: " +
                                             shape_str(a.shape()) + " and " + shape_str(p.shape()));
    total += p.size(-1);
  }
  for (int64_t d = 0; d + 1 < a.dim(); ++d) n *= a.size(d);
  Shape out_shape = a.shape();
  out_shape.back() = total;
  Tensor out = Tensor::empty(out_shape, a.dtype(), a.device());
  const size_t elem = dtype_size(a.dtype());
  char* dst = static_cast<char*>(out.data());
  int64_t begin = 0;
  for (const Tensor& p : parts) {
    shape_kernels(a.device())
        .copy_2d(dst + begin * elem, total, p.data(), p.size(-1), elem, n, p.size(-1));
    begin += p.size(-1);
  }
  std::vector<const Tensor*> inputs;
  for (const Tensor& p : parts) inputs.push_back(&p);
  if (any_requires_grad(inputs)) {
    auto node = std::make_shared<ConcatLastNode>();
    node->rows = n;
    for (const Tensor& p : parts) node->shapes.push_back(p.shape());
    record_node(out, node, inputs);
  }
  return out;
}

Tensor concat_last(const Tensor& a, const Tensor& b) { return concat_last(std::vector{a, b}); }

}  // namespace keel::ops
