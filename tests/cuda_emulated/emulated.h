// The host builds of backend/cuda's sources (emulated_*.cpp), as the tests see them.
#pragma once
#include "keel/backend/activation.h"
#include "keel/backend/attention.h"
#include "keel/backend/cross_entropy.h"
#include "keel/backend/dropout.h"
#include "keel/backend/elementwise.h"
#include "keel/backend/embedding.h"
#include "keel/backend/monitor.h"
#include "keel/backend/norm.h"
#include "keel/backend/optim.h"
#include "keel/backend/rope.h"
#include "keel/backend/shape.h"
#include "keel/backend/softmax.h"

#include <string>
#include <vector>

namespace keel::emucuda {
const AttentionKernels& attention_table();         // backend/cuda/attention.cu (+ attention_mma.cu)
const ActivationKernels& activation_table();       // backend/cuda/activation.cu
const CrossEntropyKernels& cross_entropy_table();  // backend/cuda/cross_entropy.cu
const DropoutKernels& dropout_table();             // backend/cuda/dropout.cu
const ElementwiseKernels& elementwise_table();     // backend/cuda/elementwise.cu
const EmbeddingKernels& embedding_table();         // backend/cuda/embedding.cu
const MonitorKernels& monitor_table();             // backend/cuda/monitor.cu
const NormKernels& norm_table();                   // backend/cuda/norm.cu
const OptimKernels& optim_table();                 // backend/cuda/optim.cu
const RopeKernels& rope_table();                   // backend/cuda/rope.cu
const ShapeKernels& shape_table();                 // backend/cuda/shape.cu
const SoftmaxKernels& softmax_table();             // backend/cuda/softmax.cu
// "<file> <function>" of every kernel launch site reached so far, in order (emulated_runtime.cpp).
std::vector<std::string>& launched_files();
}  // namespace keel::emucuda
