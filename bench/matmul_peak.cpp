// The matmul peak of bench/matmul_peak.h for benches that train in another process (`keel train`
// under bench/seed_8b.sh): prints {"dtype": "bf16", "gflops": G} for the best call of `seconds` of
// back-to-back 1024^3 NT products through keel's kernels. Callers probe before and after their run
// and divide by the higher figure, as compare_keel does within its process.
//
//   matmul_peak [bf16|f32] [seconds = 0.3]
#include <cstdio>
#include <string>

#include "bench/matmul_peak.h"
#include "keel/numerics/error.h"

int main(int argc, char** argv) try {
  const std::string dt = argc > 1 ? argv[1] : "bf16";
  const double seconds = argc > 2 ? std::stod(argv[2]) : 0.3;
  if (dt != "bf16" && dt != "f32")
    throw keel::Error("matmul_peak: dtype '" + dt + "' is not bf16 or f32");
  keel::bench::MatmulPeak peak(dt == "bf16" ? keel::DType::BF16 : keel::DType::F32);
  std::printf("{\"dtype\": \"%s\", \"gflops\": %.2f}\n", dt.c_str(), peak.probe(seconds));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
