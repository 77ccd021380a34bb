// The host builds of backend/cuda's sources (emulated_*.cpp), as the tests see them.
#pragma once
#include "keel/backend/attention.h"

#include <string>
#include <vector>

namespace keel::emucuda {
const AttentionKernels& attention_table();  // backend/cuda/attention.cu (+ attention_mma.cu)
// The source file of every kernel launched so far, in order (emulated_runtime.cpp).
std::vector<std::string>& launched_files();
}  // namespace keel::emucuda
