// Mixture-of-experts routing and combine on the CPU (backend/moe.h). Small next to the experts'
// products (n x e for the routing, n x k x d for the combine): one plain implementation, parallel
// over tokens (or over an expert's rows), each output element computed by one thread in a fixed
// order, so the bits depend on neither the thread count nor timing.
#include "keel/backend/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "keel/backend/parallel.h"
#include "keel/numerics/convert.h"
#include "keel/numerics/error.h"

namespace keel {

namespace {

float load(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::BF16:
      return load_f32(static_cast<const bf16_t*>(p) + i);
    case DType::F16:
      return load_f32(static_cast<const f16_t*>(p) + i);
    default:
      return static_cast<const float*>(p)[i];
  }
}

void store(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::BF16:
      store_f32(static_cast<bf16_t*>(p) + i, v);
      break;
    case DType::F16:
      store_f32(static_cast<f16_t*>(p) + i, v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// The dtype of a product of a and b (PyTorch's promotion among the floating dtypes keel has).
DType wider(DType a, DType b) {
  if (a == b) return a;
  return DType::F32;  // f32 with anything, and bf16 with f16
}

// torch.topk's order: larger first, NaN larger than every number; equal values by lower index.
bool before(float a, int32_t ia, float b, int32_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

void route(const void* logits, DType dt, int64_t n, int64_t e, int64_t k, bool normalize,
           float* probs, float* weights, int32_t* experts) {
  parallel_for(
      n, std::max<int64_t>(1, 4096 / std::max<int64_t>(e, 1)), [&](int64_t t0, int64_t t1) {
        std::vector<int32_t> order(static_cast<size_t>(e));
        for (int64_t t = t0; t < t1; ++t) {
          float* p = probs + t * e;  // softmax in f32 (HF: F.softmax(logits, dtype=torch.float))
          float m = -INFINITY;
          for (int64_t x = 0; x < e; ++x) {
            p[x] = load(logits, dt, t * e + x);
            m = std::isnan(p[x]) || std::isnan(m) ? NAN : std::max(m, p[x]);
          }
          float sum = 0;
          for (int64_t x = 0; x < e; ++x) sum += (p[x] = std::exp(p[x] - m));
          for (int64_t x = 0; x < e; ++x) p[x] /= sum;
          std::iota(order.begin(), order.end(), 0);
          std::partial_sort(order.begin(), order.begin() + k, order.end(),
                            [&](int32_t a, int32_t b) { return before(p[a], a, p[b], b); });
          float chosen = 0;  // the k probabilities' sum, in their order (torch's sum over the k)
          for (int64_t j = 0; j < k; ++j) {
            experts[t * k + j] = order[static_cast<size_t>(j)];
            weights[t * k + j] = p[order[static_cast<size_t>(j)]];
            chosen += weights[t * k + j];
          }
          if (normalize)
            for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= chosen;
        }
      });
}

void route_backward(void* dlogits, DType dt, const float* dweights, const float* probs,
                    const float* weights, const int32_t* experts, int64_t n, int64_t e, int64_t k,
                    bool normalize, const float* dprobs, const uint8_t* counted) {
  parallel_for(n, std::max<int64_t>(1, 4096 / std::max<int64_t>(e, 1)),
               [&](int64_t t0, int64_t t1) {
                 std::vector<float> dp(static_cast<size_t>(e));
                 for (int64_t t = t0; t < t1; ++t) {
                   const float *p = probs + t * e, *w = weights + t * k, *gw = dweights + t * k;
                   std::fill(dp.begin(), dp.end(), 0.f);
                   // w_j = p_j / S with S = sum of the chosen p: dL/dp_j = (gw_j - <gw, w>) / S.
                   float gw_dot_w = 0, chosen = 0;
                   if (normalize)
                     for (int64_t j = 0; j < k; ++j) {
                       gw_dot_w += gw[j] * w[j];
                       chosen += p[experts[t * k + j]];
                     }
                   for (int64_t j = 0; j < k; ++j)
                     dp[static_cast<size_t>(experts[t * k + j])] =
                         normalize ? (gw[j] - gw_dot_w) / chosen : gw[j];
                   float dp_dot_p = 0;                        // softmax: dz = p * (dp - <dp, p>)
                   if (dprobs && (!counted || counted[t])) {  // every dp non-zero
                     for (int64_t x = 0; x < e; ++x) {
                       dp[static_cast<size_t>(x)] += dprobs[x];
                       dp_dot_p += dp[static_cast<size_t>(x)] * p[x];
                     }
                   } else {  // the chosen alone (the same bits as before a balance existed)
                     for (int64_t j = 0; j < k; ++j) {
                       const int32_t x = experts[t * k + j];
                       dp_dot_p += dp[static_cast<size_t>(x)] * p[x];
                     }
                   }
                   for (int64_t x = 0; x < e; ++x)
                     store(dlogits, dt, t * e + x, p[x] * (dp[static_cast<size_t>(x)] - dp_dot_p));
                 }
               });
}

// Each token's (expert, row) pairs in ascending expert order: the order its sum runs in.
struct TokenRows {
  std::vector<int64_t> start;                      // [n + 1] into `pairs`
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (expert, row)
};
TokenRows token_rows(const MoeExpertRows* experts, int64_t n_experts, int64_t n) {
  TokenRows tr;
  tr.start.assign(static_cast<size_t>(n + 1), 0);
  for (int64_t x = 0; x < n_experts; ++x)
    for (int64_t r = 0; r < experts[x].rows; ++r) ++tr.start[experts[x].tokens[r] + 1];
  for (int64_t t = 0; t < n; ++t) tr.start[t + 1] += tr.start[t];
  tr.pairs.resize(static_cast<size_t>(tr.start[n]));
  std::vector<int64_t> fill(tr.start.begin(), tr.start.end() - 1);
  for (int64_t x = 0; x < n_experts; ++x)  // experts ascending: each token's list in that order
    for (int64_t r = 0; r < experts[x].rows; ++r)
      tr.pairs[static_cast<size_t>(fill[experts[x].tokens[r]]++)] = {x, r};
  return tr;
}

// A row of d values of dtype dt at p + offset, as f32 (dispatched once a row, not per element).
void load_row(const void* p, DType dt, int64_t offset, int64_t d, float* dst) {
  switch (dt) {
    case DType::BF16:
      for (int64_t j = 0; j < d; ++j) dst[j] = load_f32(static_cast<const bf16_t*>(p) + offset + j);
      break;
    case DType::F16:
      for (int64_t j = 0; j < d; ++j) dst[j] = load_f32(static_cast<const f16_t*>(p) + offset + j);
      break;
    default:
      std::memcpy(dst, static_cast<const float*>(p) + offset, d * sizeof(float));
  }
}
void store_row(void* p, DType dt, int64_t offset, int64_t d, const float* src) {
  switch (dt) {
    case DType::BF16:
      for (int64_t j = 0; j < d; ++j) store_f32(static_cast<bf16_t*>(p) + offset + j, src[j]);
      break;
    case DType::F16:
      for (int64_t j = 0; j < d; ++j) store_f32(static_cast<f16_t*>(p) + offset + j, src[j]);
      break;
    default:
      std::memcpy(static_cast<float*>(p) + offset, src, d * sizeof(float));
  }
}
// v rounded to dt, in place (f32: as it is).
void round_row(DType dt, int64_t d, float* v) {
  if (dt == DType::F32) return;
  for (int64_t j = 0; j < d; ++j) v[j] = round_to(dt, v[j]);
}

void combine(void* out, DType out_dt, const void* const* ys, const DType* y_dts,
             const MoeExpertRows* experts, int64_t n_experts, const float* weights, int64_t k,
             int64_t n, int64_t d) {
  const TokenRows tr = token_rows(experts, n_experts, n);
  parallel_for(
      n, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t t0, int64_t t1) {
        std::vector<float> acc(static_cast<size_t>(d)), v(static_cast<size_t>(d));
        for (int64_t t = t0; t < t1; ++t) {
          std::fill(acc.begin(), acc.end(), 0.f);  // HF's torch.zeros, then index_add_ per expert
          for (int64_t q = tr.start[t]; q < tr.start[t + 1]; ++q) {
            const auto [x, r] = tr.pairs[static_cast<size_t>(q)];
            const float w = round_to(out_dt, weights[t * k + experts[x].slots[r]]);
            load_row(ys[x], y_dts[x], r * d, d, v.data());
            for (int64_t j = 0; j < d; ++j) v[j] *= w;
            round_row(wider(y_dts[x], out_dt), d, v.data());  // the product's dtype
            round_row(out_dt, d, v.data());                   // .to(out)
            for (int64_t j = 0; j < d; ++j) acc[j] += v[j];
            round_row(out_dt, d, acc.data());  // index_add_ in out's dtype
          }
          store_row(out, out_dt, t * d, d, acc.data());
        }
      });
}

void combine_backward(const void* g, DType g_dt, const void* const* ys, const DType* y_dts,
                      void* const* dys, const MoeExpertRows* experts, int64_t n_experts,
                      const float* weights, float* dweights, int64_t k, int64_t d) {
  // Every (expert, row) in one parallel loop: each writes its own row of dys and its own weight.
  std::vector<int64_t> first(static_cast<size_t>(n_experts + 1), 0);
  for (int64_t x = 0; x < n_experts; ++x) first[x + 1] = first[x] + experts[x].rows;
  parallel_for(first[n_experts], std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
               [&](int64_t i0, int64_t i1) {
                 std::vector<float> gt(static_cast<size_t>(d)), v(static_cast<size_t>(d));
                 int64_t x = std::upper_bound(first.begin(), first.end(), i0) - first.begin() - 1;
                 for (int64_t i = i0; i < i1; ++i) {
                   while (i >= first[x + 1]) ++x;
                   const MoeExpertRows& ex = experts[x];
                   const int64_t r = i - first[x], t = ex.tokens[r], at = t * k + ex.slots[r];
                   const DType prod_dt = wider(y_dts[x], g_dt);
                   load_row(g, g_dt, t * d, d, gt.data());  // the index_add_'s and the cast's
                   if (dys[x]) {
                     const float w = round_to(g_dt, weights[at]);
                     for (int64_t j = 0; j < d; ++j) v[j] = gt[j] * w;
                     round_row(prod_dt, d, v.data());
                     store_row(dys[x], y_dts[x], r * d, d, v.data());
                   }
                   if (dweights) {
                     load_row(ys[x], y_dts[x], r * d, d, v.data());
                     for (int64_t j = 0; j < d; ++j) v[j] *= gt[j];
                     round_row(prod_dt, d, v.data());
                     float dw = 0;
                     for (int64_t j = 0; j < d; ++j) dw += v[j];
                     dweights[at] = dw;
                   }
                 }
               });
}

void gather(void* out, const void* x, DType dt, const int64_t* rows, int64_t m, int64_t padded,
            int64_t d) {
  const size_t row = static_cast<size_t>(d) * dtype_size(dt);
  char* o = static_cast<char*>(out);
  const char* src = static_cast<const char*>(x);
  parallel_for(m, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
               [&](int64_t r0, int64_t r1) {
                 for (int64_t r = r0; r < r1; ++r)
                   std::memcpy(o + r * row, src + rows[r] * row, row);
               });
  if (padded > m) std::memset(o + m * row, 0, static_cast<size_t>(padded - m) * row);
}

void scatter_add(void* dx, const void* g, DType dt, const int64_t* rows, int64_t m, int64_t d) {
  parallel_for(m, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
               [&](int64_t r0, int64_t r1) {
                 std::vector<float> a(static_cast<size_t>(d)), b(static_cast<size_t>(d));
                 for (int64_t r = r0; r < r1; ++r) {
                   load_row(dx, dt, rows[r] * d, d, a.data());
                   load_row(g, dt, r * d, d, b.data());
                   for (int64_t j = 0; j < d; ++j) a[j] += b[j];
                   store_row(dx, dt, rows[r] * d, d, a.data());
                 }
               });
}

// sigmoid(l) rounded to dt, as the gate's torch.sigmoid in the logit's dtype leaves it.
float rounded_sigmoid(const void* logit, DType dt, int64_t t) {
  const float s = 1.0f / (1.0f + std::exp(-load(logit, dt, t)));
  return round_to(dt, s);
}

void gate_rows(void* out, const void* x, const void* logit, DType dt, int64_t n, int64_t d) {
  parallel_for(n, std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1)),
               [&](int64_t t0, int64_t t1) {
                 for (int64_t t = t0; t < t1; ++t) {
                   const float s = rounded_sigmoid(logit, dt, t);
                   for (int64_t j = 0; j < d; ++j)
                     store(out, dt, t * d + j, s * load(x, dt, t * d + j));
                 }
               });
}

void gate_rows_backward(void* dx, void* dlogit, const void* g, const void* x, const void* logit,
                        DType dt, int64_t n, int64_t d) {
  parallel_for(n, std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1)),
               [&](int64_t t0, int64_t t1) {
                 for (int64_t t = t0; t < t1; ++t) {
                   const float s = rounded_sigmoid(logit, dt, t);
                   float gx = 0;
                   for (int64_t j = 0; j < d; ++j) {
                     const float gj = load(g, dt, t * d + j);
                     if (dx) store(dx, dt, t * d + j, gj * s);
                     gx += gj * load(x, dt, t * d + j);
                   }
                   if (dlogit) store(dlogit, dt, t, gx * s * (1.0f - s));
                 }
               });
}

const MoeKernels kCpuMoe = {route,   route_backward,   gather,    scatter_add,
                            combine, combine_backward, gate_rows, gate_rows_backward};

}  // namespace

const MoeKernels& moe_kernels(Device dev) {
  if (dev.is_cuda())
    throw Error(
        "a mixture-of-experts layer's routing runs on the CPU only (keel has no CUDA kernels for "
        "it yet); set run.device = \"cpu\" (keel generate / eval: --device cpu)",
        Error::kUsage);
  KEEL_CHECK(dev.is_cpu(), "no MoE kernels for " + dev.str() + " in this build");
  return kCpuMoe;
}

}  // namespace keel
