// backend/cuda/softmax.cu built for the host emulator (prelude.h says how).
#include "tests/cuda_emulated/prelude.h"
#define cuda emucuda
#include "keel/backend/cuda/softmax.cu"
