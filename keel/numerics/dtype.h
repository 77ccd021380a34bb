// DType: the element formats keel stores. Floating formats carry their exact IEEE layout; the
// integer formats hold token ids, labels and masks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace keel {

enum class DType : uint8_t { F32, BF16, F16, I32, I64, U8 };

inline constexpr size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}

inline constexpr bool dtype_is_floating(DType dt) {
  return dt == DType::F32 || dt == DType::BF16 || dt == DType::F16;
}

// Lower-case names as used in configs, safetensors ("F32", "BF16", "F16" there) and messages.
const char* dtype_name(DType dt);
// Accepts "f32"/"float32"/"fp32", "bf16"/"bfloat16", "f16"/"fp16"/"float16", "i32", "i64", "u8".
std::optional<DType> dtype_from_name(std::string_view name);

}  // namespace keel
