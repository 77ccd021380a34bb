#include "keel/numerics/dtype.h"

namespace keel {

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view n) {
  if (n == "f32" || n == "float32" || n == "fp32" || n == "float") return DType::F32;
  if (n == "bf16" || n == "bfloat16") return DType::BF16;
  if (n == "f16" || n == "fp16" || n == "float16" || n == "half") return DType::F16;
  if (n == "i32" || n == "int32") return DType::I32;
  if (n == "i64" || n == "int64") return DType::I64;
  if (n == "u8" || n == "uint8") return DType::U8;
  return std::nullopt;
}

}  // namespace keel
