// The CUDA kernel tables; the `<family>_kernels(Device)` dispatchers return them for cuda devices.
#pragma once
#include "keel/backend/activation.h"
#include "keel/backend/attention.h"
#include "keel/backend/cross_entropy.h"
#include "keel/backend/dropout.h"
#include "keel/backend/elementwise.h"
#include "keel/backend/embedding.h"
#include "keel/backend/matmul.h"
#include "keel/backend/monitor.h"
#include "keel/backend/norm.h"
#include "keel/backend/optim.h"
#include "keel/backend/rope.h"
#include "keel/backend/shape.h"
#include "keel/backend/softmax.h"

namespace keel::cuda {
const ElementwiseKernels& elementwise_table();
const ActivationKernels& activation_table();
const SoftmaxKernels& softmax_table();
const NormKernels& norm_table();
const RopeKernels& rope_table();
const DropoutKernels& dropout_table();
const CrossEntropyKernels& cross_entropy_table();
const EmbeddingKernels& embedding_table();
const OptimKernels& optim_table();
const ShapeKernels& shape_table();
const AttentionKernels& attention_table();
const MatmulKernels& matmul_table();
const MonitorKernels& monitor_table();
}  // namespace keel::cuda
