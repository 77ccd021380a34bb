// Causal attention: eager and math through the matmul kernels with a masked softmax between them,
// flash through its own tiled kernels (backend/attention.h). Forward and backward side by side.
#include "keel/ops/attention.h"

#include <cmath>
#include <string>

#include "keel/backend/attention.h"
#include "keel/backend/dropout.h"
#include "keel/backend/elementwise.h"
#include "keel/backend/matmul.h"
#include "keel/ops/dropout.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

AttentionBackend attention_backend_from_name(std::string_view name) {
  if (name == "eager") return AttentionBackend::kEager;
  if (name == "math") return AttentionBackend::kMath;
  if (name == "flash") return AttentionBackend::kFlash;
  throw Error("attention backend '" + std::string(name) +
                  "' is unknown; valid backends are: eager, math, flash (model.attention)",
              Error::kUsage);
}

const char* attention_backend_name(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::kEager:
      return "eager";
    case AttentionBackend::kMath:
      return "math";
    case AttentionBackend::kFlash:
      return "flash";
  }
  return "?";
}

namespace {

const ElementwiseKernels& ew(Device d) { return elementwise_kernels(d); }

// t in dtype dt (t itself when it already is), converted by the backend's vectorized kernel (the
// eager backward rounds its [B, H, T, T] probabilities this way every layer).
Tensor as_dtype(const Tensor& t, DType dt) {
  if (t.dtype() == dt) return t;
  Tensor out = Tensor::empty(t.shape(), dt, t.device());
  ew(t.device()).convert(out.data(), dt, t.data(), t.dtype(), t.numel());
  return out;
}

// c = alpha·op(a)·op(b) over `batch` matrices, f32 accumulation scaled in f32; c has dtype out_dt
// (F32 or in_dt). alpha other than 1 on the CPU only.
void mm(Device dev, void* c, DType out_dt, const void* a, const void* b, DType in_dt, int64_t batch,
        int64_t m, int64_t n, int64_t k, bool ta, bool tb, float alpha = 1.f) {
  MatmulArgs args;
  args.c = c;
  args.a = a;
  args.b = b;
  args.in_dt = in_dt;
  args.out_dt = out_dt;
  args.batch = batch;
  args.m = m;
  args.n = n;
  args.k = k;
  args.trans_a = ta;
  args.trans_b = tb;
  args.alpha = alpha;
  matmul_kernels(dev).matmul(args);
}

// out = round(alpha * op(a)·op(b)) into out's dtype, whatever the operands' dtype in_dt: the
// product accumulates in f32 and is rounded once.
void mm_into(Tensor& out, float alpha, const Tensor& a, const Tensor& b, DType in_dt, int64_t batch,
             int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
  const Device dev = out.device();
  if (alpha == 1.f && (out.dtype() == in_dt || out.dtype() == DType::F32))
    return mm(dev, out.data(), out.dtype(), a.data(), b.data(), in_dt, batch, m, n, k, ta, tb);
  Tensor acc = out.dtype() == DType::F32 ? out : Tensor::empty(out.shape(), DType::F32, dev);
  mm(dev, acc.data(), DType::F32, a.data(), b.data(), in_dt, batch, m, n, k, ta, tb);
  if (alpha != 1.f)
    ew(dev).axpby(acc.data(), alpha, acc.data(), 0.f, nullptr, DType::F32, acc.numel());
  if (acc.data() != out.data())
    ew(dev).convert(out.data(), out.dtype(), acc.data(), DType::F32, acc.numel());
}

}  // namespace

int64_t first_bad_position(const Tensor& positions) {
  KEEL_CHECK(positions.dtype() == DType::I64 && positions.dim() == 2 && positions.device().is_cpu(),
             "first_bad_position: positions must be cpu i64 [B, T]");
  const int64_t* p = positions.data_as<int64_t>();
  const int64_t t = positions.size(1);
  for (int64_t k = 0; k < positions.numel(); ++k)
    if (p[k] != 0 && (k % t == 0 || p[k] != p[k - 1] + 1)) return k;
  return -1;
}

namespace {

// A packed row's positions: I64 [B, T] on the CPU, each row restarting at 0 and counting up by one
// (the kernels' first_key(b, i) = i - position is then an example's first token, never after i).
void check_positions(const Tensor& pos, const AttentionDims& d, Device dev) {
  if (pos.dtype() != DType::I64 || pos.shape() != Shape{d.batch, d.seq})
    throw Error(std::string("attention: positions must be i64 [B, T] = ") +
                shape_str({d.batch, d.seq}) + ", got " + dtype_name(pos.dtype()) + " " +
                shape_str(pos.shape()));
  if (!dev.is_cpu() || !pos.device().is_cpu())
    throw Error("attention: packed rows (positions) attend on the CPU only; the " + dev.str() +
                    " kernels take no positions yet: set data.pack = false, or run.device = cpu",
                Error::kUsage);
  if (const int64_t k = first_bad_position(pos); k >= 0)
    throw Error("attention: positions[" + std::to_string(k / d.seq) + ", " +
                std::to_string(k % d.seq) + "] = " + std::to_string(pos.data_as<int64_t>()[k]) +
                " neither starts an example (0) nor follows the position before it by one; "
                "packed positions restart at 0 on each example's first token");
}

// Validates the operands and describes them for the kernels (mask pointers set by the caller).
AttentionDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionMask& am, const AttentionScores& sc,
                             const AttentionDropout& drop) {
  const Tensor& mask = am.key_padding;
  check_floating("attention", q);
  check_operands("attention", q, k);
  check_operands("attention", q, v);
  if (q.dim() != 4 || k.dim() != 4 || k.shape() != v.shape() || q.size(0) != k.size(0) ||
      q.size(2) != k.size(2) || q.size(3) != k.size(3) || q.size(3) < 1 || k.size(1) < 1 ||
      q.size(1) % k.size(1) != 0)
    throw Error("attention: q " + shape_str(q.shape()) + ", k " + shape_str(k.shape()) + ", v " +
                shape_str(v.shape()) +
                " do not fit q [B, Hq, T, D], k and v [B, Hkv, T, D] with Hq a multiple of Hkv "
                "and D >= 1; reshape to that layout (heads before sequence)");
  AttentionDims d;
  d.batch = q.size(0);
  d.heads_q = q.size(1);
  d.heads_kv = k.size(1);
  d.seq = q.size(2);
  d.head_dim = q.size(3);
  KEEL_CHECK(
      sc.scale >= 0 && std::isfinite(sc.scale) && sc.softcap >= 0 && std::isfinite(sc.softcap),
      "attention: scale and softcap must be finite and >= 0");
  d.scale = sc.scale_for(d.head_dim);
  d.softcap = sc.softcap;
  if (d.softcap > 0 && !q.device().is_cpu())
    throw Error(
        "attention: a soft cap on the scores (Gemma-2's attn_logit_softcapping) attends on "
        "the CPU only; the " +
            q.device().str() + " kernels do not cap yet: run on the cpu",
        Error::kUsage);
  if (mask.defined()) {
    if (mask.dtype() != DType::U8 || mask.shape() != Shape{d.batch, d.seq})
      throw Error(std::string("attention: key_padding_mask must be u8 [B, T] = ") +
                  shape_str({d.batch, d.seq}) + ", got " + dtype_name(mask.dtype()) + " " +
                  shape_str(mask.shape()) + "; build it as 1 for real tokens, 0 for padding");
    KEEL_CHECK(
        mask.device() == q.device(),
        "attention: key_padding_mask on " + mask.device().str() + " but q on " + q.device().str());
    const Tensor host = mask.device().is_cpu() ? mask : mask.to(Device::cpu());  // [B, T], small
    const uint8_t* m = host.data_as<uint8_t>();
    for (int64_t i = 0; i < mask.numel(); ++i)
      if (m[i] > 1)
        throw Error("attention: key_padding_mask holds " + std::to_string(m[i]) + " at [" +
                    std::to_string(i / d.seq) + ", " + std::to_string(i % d.seq) +
                    "]; use 1 for real tokens and 0 for padding");
  }
  if (am.positions.defined()) check_positions(am.positions, d, q.device());
  KEEL_CHECK(am.window >= 0, "attention: window = " + std::to_string(am.window) + " must be >= 0");
  d.window = am.window;
  if (d.window > 0 && d.window < d.seq && !q.device().is_cpu())
    throw Error("attention: a sliding window of " + std::to_string(d.window) + " over rows of " +
                    std::to_string(d.seq) + " tokens attends on the CPU only; the " +
                    q.device().str() +
                    " kernels do not slide yet: keep rows within the window, or run on the cpu",
                Error::kUsage);
  if (drop.p != 0.f) {
    const DropoutMask m = dropout_mask(drop.p);  // an Error outside [0, 1)
    if (!q.device().is_cpu())
      throw Error(
          "attention: dropout on the attention probabilities (model.attention_dropout) "
          "runs on the CPU only; the " +
              q.device().str() +
              " kernels do not drop yet: set model.attention_dropout = 0, or run on "
              "the cpu",
          Error::kUsage);
    d.dropout = true;
    d.drop_threshold = m.threshold;
    d.drop_scale = m.scale;
    d.drop_seed = drop.seed;
  }
  return d;
}

const uint8_t* mask_ptr(const Tensor& mask) {
  return mask.defined() ? mask.data_as<uint8_t>() : nullptr;
}
const int64_t* positions_ptr(const Tensor& pos) {
  return pos.defined() ? pos.data_as<int64_t>() : nullptr;
}

// Eager and math. The compute dtype cdt is the input dtype (eager) or f32 (math): scores and
// probabilities are rounded to cdt, products take cdt operands and accumulate in f32.
// Per kv head the group's query heads are contiguous rows: Q as [B*Hkv, G*T, D] multiplies K
// [B*Hkv, T, D] without copying k or v.
struct MaterializedAttention {
  AttentionDims d;
  DType cdt;
  int64_t batch() const { return d.batch * d.heads_kv; }
  int64_t rows() const { return d.heads_q / d.heads_kv * d.seq; }  // G*T

  // out = x · keep · scale with the probability dropout's mask over [B, Hq, T, T] (the layout of
  // P, dP and the [B*Hkv, G*T, T] products alike), rounded once into x's dtype; out may be x.
  void drop(Tensor& out, const Tensor& x) const {
    dropout_kernels(x.device())
        .apply(out.data(), x.data(), x.dtype(), x.numel(), d.drop_seed, d.drop_threshold,
               d.drop_scale);
  }
  // P·V's and dV's operand P (pc, in cdt) dropped: in place, unless pc is p32 itself (in f32),
  // which the backward keeps undropped.
  Tensor dropped(const Tensor& pc, const Tensor& p32) const {
    Tensor pd = pc.data() == p32.data() ? Tensor::empty(p32.shape(), cdt, p32.device()) : pc;
    drop(pd, pc);
    return pd;
  }

  // Returns P in f32 [B, Hq, T, T] (0 where masked) and writes out [B, Hq, T, D].
  Tensor forward(Tensor& out, const Tensor& qc, const Tensor& kc, const Tensor& vc) const {
    const int64_t t = d.seq, dd = d.head_dim;
    const Device dev = out.device();
    Tensor p32 = Tensor::empty({d.batch, d.heads_q, t, t}, DType::F32, dev);
    Tensor pc = cdt == DType::F32 ? p32 : Tensor::empty(p32.shape(), cdt, dev);
    void* p_lp = cdt == DType::F32 ? nullptr : pc.data();
    if (cdt != DType::F32 && dev.is_cpu()) {
      // S = scale·Q·Kᵀ scaled in f32 and rounded to cdt by the product itself: the bits of the
      // raw f32 scores scaled and rounded by the softmax kernel, in half the bytes written and
      // read. P·V's operand pc overwrites S row by row. CPU only: the CUDA matmul takes no
      // alpha (it refuses one), so the GPU keeps the f32 scores below.
      mm(dev, p_lp, cdt, qc.data(), kc.data(), cdt, batch(), rows(), t, dd, false, true, d.scale);
      attention_kernels(dev).softmax_forward(p32.data_as<float>(), p_lp, cdt, p_lp, cdt, cdt, d);
    } else {
      // S[B*Hkv, G*T, T] = Q·Kᵀ, f32 (the kernel scales and rounds it to cdt), softmax in place.
      mm(dev, p32.data(), DType::F32, qc.data(), kc.data(), cdt, batch(), rows(), t, dd, false,
         true);
      attention_kernels(dev).softmax_forward(p32.data_as<float>(), p_lp, cdt, p32.data(),
                                             DType::F32, cdt, d);
    }
    // Dropout (HF's eager attention: the probabilities in the compute dtype, then F.dropout).
    if (d.dropout) pc = dropped(pc, p32);
    // O[B*Hkv, G*T, D] = P·V
    mm_into(out, 1.f, pc, vc, cdt, batch(), rows(), dd, t, false, false);
    return p32;
  }

  // Gradients into dq/dk/dv (each undefined when not needed).
  void backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& gc, const Tensor& qc,
                const Tensor& kc, const Tensor& vc, const Tensor& p32) const {
    const int64_t t = d.seq, dd = d.head_dim;
    const Device dev = p32.device();
    const bool scores = dq.defined() || dk.defined();
    // dV needs P in cdt (in f32 it is p32 itself): the softmax backward writes it from the rows it
    // reads anyway, instead of a conversion pass over p32 of its own.
    const bool p_from_backward = dv.defined() && scores && cdt != DType::F32;
    Tensor pc;
    if (dv.defined())
      pc = p_from_backward ? Tensor::empty(p32.shape(), cdt, dev) : as_dtype(p32, cdt);
    Tensor ds;
    if (scores) {
      // dP[B*Hkv, G*T, T] = dO·Vᵀ, rounded to cdt; dS overwrites it (the kernel reads a row first).
      ds = Tensor::empty({d.batch, d.heads_q, t, t}, cdt, dev);
      mm(dev, ds.data(), cdt, gc.data(), vc.data(), cdt, batch(), rows(), t, dd, false, true);
      if (d.dropout) drop(ds, ds);  // back through the dropout: the gradient of the undropped P
      attention_kernels(dev).softmax_backward(ds.data(), cdt, p32.data_as<float>(), ds.data(), cdt,
                                              p_from_backward ? pc.data() : nullptr, d);
    }
    if (dv.defined()) {  // dV[B*Hkv, T, D] = Pᵀ·dO, summed over the group's heads
      if (d.dropout) pc = dropped(pc, p32);  // the dropped P, as the forward's product took it
      mm_into(dv, 1.f, pc, gc, cdt, batch(), t, dd, rows(), true, false);
      pc = Tensor();
    }
    if (!scores) return;
    // dQ = scale·dS·K, dK = scale·dSᵀ·Q
    if (dq.defined()) mm_into(dq, d.scale, ds, kc, cdt, batch(), rows(), dd, t, false, false);
    if (dk.defined()) mm_into(dk, d.scale, ds, qc, cdt, batch(), t, dd, rows(), true, false);
  }
};

}  // namespace

struct AttentionNode final : Node {
  AttentionBackend backend;
  AttentionDims dims;
  Tensor q, k, v, mask, positions;
  Tensor p32;  // eager, math: probabilities [B, Hq, T, T] f32
  // flash: output (a handle without grad_fn); flash, and eager/math with a soft cap: logsumexp
  // [B, Hq, T] f32
  Tensor out, lse;

  std::vector<Tensor> backward(const Tensor& grad) override {
    const DType dt = q.dtype();
    AttentionDims d = dims;
    d.key_padding_mask = mask_ptr(mask);
    d.positions = positions_ptr(positions);
    if (backend != AttentionBackend::kFlash && lse.defined()) d.softmax_lse = lse.data_as<float>();
    Tensor dq, dk, dv;
    if (needs_grad(0)) dq = Tensor::empty_like(q);
    if (needs_grad(1)) dk = Tensor::empty_like(k);
    if (needs_grad(2)) dv = Tensor::empty_like(v);
    if (backend == AttentionBackend::kFlash) {
      const Tensor g = as_dtype(grad, dt);
      attention_kernels(q.device())
          .flash_backward(dq.defined() ? dq.data() : nullptr, dk.defined() ? dk.data() : nullptr,
                          dv.defined() ? dv.data() : nullptr, q.data(), k.data(), v.data(),
                          out.data(), g.data(), lse.data_as<float>(), dt, d);
    } else {
      MaterializedAttention ma{d, backend == AttentionBackend::kEager ? dt : DType::F32};
      ma.backward(dq, dk, dv, as_dtype(grad, ma.cdt), as_dtype(q, ma.cdt), as_dtype(k, ma.cdt),
                  as_dtype(v, ma.cdt), p32);
    }
    return {dq, dk, dv};
  }
  const char* name() const override {
    switch (backend) {
      case AttentionBackend::kEager:
        return "attention_eager";
      case AttentionBackend::kMath:
        return "attention_math";
      case AttentionBackend::kFlash:
        return "attention_flash";
    }
    return "attention";
  }
};

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                 AttentionBackend backend, const AttentionScores& scores,
                 const AttentionDropout& dropout) {
  AttentionDims d = attention_dims(q, k, v, mask, scores, dropout);
  d.key_padding_mask = mask_ptr(mask.key_padding);
  d.positions = positions_ptr(mask.positions);
  const DType dt = q.dtype();
  Tensor out = Tensor::empty(q.shape(), dt, q.device());
  Tensor p32, lse;
  if (backend == AttentionBackend::kFlash) {
    lse = Tensor::empty({d.batch, d.heads_q, d.seq}, DType::F32, q.device());
    attention_kernels(q.device())
        .flash_forward(out.data(), lse.data_as<float>(), q.data(), k.data(), v.data(), dt, d);
  } else {
    if (d.softcap > 0) {  // the softmax's row logsumexps, for the cap's derivative
      lse = Tensor::empty({d.batch, d.heads_q, d.seq}, DType::F32, q.device());
      d.softmax_lse = lse.data_as<float>();
    }
    MaterializedAttention ma{d, backend == AttentionBackend::kEager ? dt : DType::F32};
    p32 = ma.forward(out, as_dtype(q, ma.cdt), as_dtype(k, ma.cdt), as_dtype(v, ma.cdt));
    d.softmax_lse = nullptr;  // the node's copy of d points at its own lse
  }
  if (any_requires_grad({&q, &k, &v})) {
    auto n = std::make_shared<AttentionNode>();
    n->backend = backend;
    n->dims = d;
    n->q = q;
    n->k = k;
    n->v = v;
    n->mask = mask.key_padding;
    n->positions = mask.positions;
    n->p32 = p32;
    n->lse = lse;
    if (backend == AttentionBackend::kFlash)
      n->out = out.view(out.shape());  // shares the data, not the grad_fn: no reference cycle
    record_node(out, n, {&q, &k, &v});
  }
  return out;
}

}  // namespace keel::ops
