// The kernel families every ISA variant provides (one table per family per ISA).
#pragma once
#include "keel/backend/cpu/isa.h"
#include "keel/backend/activation.h"
#include "keel/backend/attention.h"
#include "keel/backend/cross_entropy.h"
#include "keel/backend/dropout.h"
#include "keel/backend/elementwise.h"
#include "keel/backend/monitor.h"
#include "keel/backend/norm.h"
#include "keel/backend/optim.h"
#include "keel/backend/rope.h"
#include "keel/backend/softmax.h"

namespace keel::cpu {
#define KEEL_DECLARE_ISA_TABLES(ns) \
  namespace ns {                    \
  extern const ElementwiseKernels elementwise; \
  extern const AttentionKernels attention;     \
  extern const ActivationKernels activation;   \
  extern const SoftmaxKernels softmax;         \
  extern const NormKernels norm;               \
  extern const RopeKernels rope;               \
  extern const DropoutKernels dropout;         \
  extern const CrossEntropyKernels cross_entropy; \
  extern const OptimKernels optim;             \
  extern const MonitorKernels monitor;         \
  }
KEEL_DECLARE_ISA_TABLES(generic)
KEEL_DECLARE_ISA_TABLES(avx2)
KEEL_DECLARE_ISA_TABLES(avx512)
#undef KEEL_DECLARE_ISA_TABLES

// Picks the table of the running ISA level: pick(generic::x, avx2::x, avx512::x).
template <class T>
const T& pick(const T& g, const T& a2, const T& a512) {
  switch (cpu_isa()) {
    case CpuIsa::Avx512: return a512;
    case CpuIsa::Avx2: return a2;
    default: return g;
  }
}
}  // namespace keel::cpu
