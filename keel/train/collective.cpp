#include "keel/train/collective.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "keel/numerics/error.h"
#include "keel/numerics/hash.h"

namespace keel {

void SingleCollective::all_gather(const double* in, size_t n, double* out) {
  if (n) std::memcpy(out, in, n * sizeof(double));
}

std::vector<int64_t> rank_micro_batches(int64_t first, int64_t count, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world || first < 0 || count < 0)
    throw Error("rank_micro_batches: rank " + std::to_string(rank) + " of world " +
                std::to_string(world) + ", first " + std::to_string(first) + ", count " +
                std::to_string(count) + " is not a valid shard");
  std::vector<int64_t> out;
  for (int64_t i = rank; i < count; i += world) out.push_back(first + i);
  return out;
}

namespace {

uint64_t bits_of(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

std::string show(const RankCheckValue& spec, double v) {
  char buf[40];
  if (spec.hex)
    std::snprintf(buf, sizeof buf, "%016" PRIx64, bits_of(v));
  else
    std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

void check_rank_consistency(Collective& c, int64_t step,
                            const std::vector<RankCheckValue>& values) {
  const size_t n = values.size();
  const int W = c.world_size();
  std::vector<double> mine(n), all(n * static_cast<size_t>(W));
  for (size_t i = 0; i < n; ++i) mine[i] = values[i].value;
  c.all_gather(mine.data(), n, all.data());
  std::string diff;
  for (size_t i = 0; i < n; ++i) {
    const double ref = all[i];
    std::string ranks;
    for (int r = 1; r < W; ++r) {
      const double v = all[static_cast<size_t>(r) * n + i];
      if (bits_of(v) != bits_of(ref))
        ranks += ", " + show(values[i], v) + " on rank " + std::to_string(r);
    }
    if (!ranks.empty())
      diff += (diff.empty() ? "" : "; ") + values[i].name + " is " + show(values[i], ref) +
              " on rank 0" + ranks;
  }
  if (!diff.empty())
    throw Error("rank consistency check at step " + std::to_string(step) +
                ": ranks disagree: " + diff +
                ". Every rank must run the same config (same file, same --set overrides) and the "
                "same keel build; if they do, this is a bug in keel's distributed step: report it "
                "with this message");
}

double tensors_checksum(const std::vector<Tensor>& ts) {
  // FNV-1a over 64-bit words (then the tail bytes): order-sensitive, cheap, not cryptographic.
  uint64_t h = kFnvOffsetBasis;
  for (const Tensor& t : ts) {
    if (!t.defined()) {
      h = fnv1a_step(h, kSplitmixGamma);  // an absent tensor still moves the hash
      continue;
    }
    const Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());  // GPU: a host copy
    const auto* p = static_cast<const unsigned char*>(host.data());
    const size_t nb = host.nbytes(), words = nb / 8;
    for (size_t i = 0; i < words; ++i) {
      uint64_t w;
      std::memcpy(&w, p + 8 * i, 8);
      h = fnv1a_step(h, w);
    }
    h = fnv1a(p + words * 8, nb - words * 8, h);
    h = fnv1a_step(h, nb);
  }
  double d;
  std::memcpy(&d, &h, sizeof d);
  return d;
}

}  // namespace keel
