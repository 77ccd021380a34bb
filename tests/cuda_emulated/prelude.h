// What a host build of a backend/cuda source file includes first (emulated_*.cpp): the emulator
// (shim/), and every keel header the CUDA sources include, before `cuda` is renamed. The sources
// are then included with `#define cuda emucuda`, so their keel::cuda (kernels, tables, runtime
// calls) becomes keel::emucuda: no symbol of the real CUDA backend, which a CUDA build links into
// this test too, is defined twice. Headers included here keep their names (include guards).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

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
#include "keel/numerics/dtype.h"
#include "keel/numerics/error.h"
#include "keel/numerics/format_info.h"
#include "keel/numerics/hash.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/tensor/device.h"
