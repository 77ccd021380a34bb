// Everything the per-ISA kernel sources (*.inc) may use, included before the target pragma.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "keel/backend/cpu/kernel_tables.h"
#include "keel/backend/parallel.h"
#include "keel/numerics/convert.h"
#include "keel/numerics/error.h"
#include "keel/numerics/format_info.h"
#include "keel/numerics/hash.h"
#include "keel/numerics/tensor_stats.h"
