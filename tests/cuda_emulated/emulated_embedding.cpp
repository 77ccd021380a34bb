// backend/cuda/embedding.cu built for the host emulator (prelude.h says how; CUB's radix sort from
// shim/cub, its contract on the host).
#include "tests/cuda_emulated/prelude.h"
#define cuda emucuda
#include "keel/backend/cuda/embedding.cu"
