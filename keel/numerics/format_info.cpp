#include "keel/numerics/format_info.h"

#include "keel/numerics/error.h"

namespace keel {

const FormatInfo& format_info(DType dt) {
  static const FormatInfo f32{DType::F32, 23, 8, 3.4028234663852886e38, 1.1754943508222875e-38,
                              1.401298464324817e-45, 1.1920928955078125e-07};
  static const FormatInfo bf16{DType::BF16, 7, 8, 3.3895313892515355e38, 1.1754943508222875e-38,
                               9.183549615799121e-41, 0.0078125};
  static const FormatInfo f16{DType::F16, 10, 5, 65504.0, 6.103515625e-05, 5.960464477539063e-08,
                              0.0009765625};
  switch (dt) {
    case DType::F32: return f32;
    case DType::BF16: return bf16;
    case DType::F16: return f16;
    default: throw Error(std::string("format_info: ") + dtype_name(dt) + " is not a floating format");
  }
}

}  // namespace keel
