// dist/ pieces without mpirun: gradient buckets, data sharding, the rank-consistency check with a
// fake group, process-group selection, and the NCCL group (skipped without a GPU). The mpirun
// runs of the whole step are in tests/cli/test_cli_dist.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <set>

#include "keel/dist/bucket.h"
#include "keel/dist/process_group.h"
#include "keel/numerics/convert.h"
#include "keel/numerics/error.h"
#include "keel/train/collective.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using dist::Bucket;
using dist::plan_buckets;

// Every element of every tensor in exactly one segment, in order, no bucket over the cap.
void expect_exact_cover(const std::vector<Bucket>& plan, const std::vector<int64_t>& numels,
                        int64_t cap) {
  size_t t = 0;
  int64_t off = 0;
  for (const Bucket& b : plan) {
    EXPECT_LE(b.numel, cap);
    EXPECT_GT(b.numel, 0);
    int64_t sum = 0;
    for (const auto& s : b.segments) {
      while (t < numels.size() && numels[t] == 0) ++t;
      ASSERT_LT(t, numels.size());
      EXPECT_EQ(s.tensor, t);
      EXPECT_EQ(s.offset, off);
      EXPECT_GT(s.count, 0);
      off += s.count;
      sum += s.count;
      if (off == numels[t]) {
        ++t;
        off = 0;
      }
    }
    EXPECT_EQ(sum, b.numel);
  }
  while (t < numels.size() && numels[t] == 0) ++t;
  EXPECT_EQ(t, numels.size()) << "not every tensor was covered";
}

TEST(Buckets, SmallTensorsShareABucketLargeOnesAreCut) {
  // cap 10: [3, 4] share (7), 5 does not fit -> 3 more fill the first, 2 start the next ...
  const std::vector<int64_t> numels = {3, 4, 5, 0, 25, 1};
  const auto plan = plan_buckets(numels, 10);
  expect_exact_cover(plan, numels, 10);
  // Greedy fill: every bucket but the last is full.
  for (size_t i = 0; i + 1 < plan.size(); ++i) EXPECT_EQ(plan[i].numel, 10);
  EXPECT_EQ(plan.size(), 4u);              // 38 elements
  EXPECT_EQ(plan[0].segments.size(), 3u);  // 3 + 4 + 3 of the 5
  // A tensor of exactly the cap is one in-place bucket.
  const auto one = plan_buckets({10, 10}, 10);
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(one[1].segments.size(), 1u);
  EXPECT_EQ(one[1].segments[0].tensor, 1u);
  EXPECT_TRUE(plan_buckets({}, 4).empty());
  EXPECT_THROW(plan_buckets({1}, 0), Error);
}

TEST(Buckets, RandomShapesAreCoveredExactly) {
  uint64_t x = 12345;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> numels;
    const int n = 1 + static_cast<int>((x = x * 6364136223846793005ull + 1) >> 60);
    for (int i = 0; i < n; ++i)
      numels.push_back(static_cast<int64_t>(((x = x * 6364136223846793005ull + 1) >> 40) % 100));
    const int64_t cap = 1 + static_cast<int64_t>(((x = x * 6364136223846793005ull + 1) >> 40) % 64);
    expect_exact_cover(plan_buckets(numels, cap), numels, cap);
  }
}

// A fake 2-rank sum: the other rank holds `other` times this rank's values.
TEST(Buckets, AllReduceSumsEveryElementOnceAndRoundsLowPrecisionOnce) {
  Tensor a = Tensor::from_floats({1, 2, 3}, {3});
  Tensor big = Tensor::from_floats(std::vector<float>(40, 0.5f), {8, 5});  // 160 bytes
  Tensor h = Tensor::from_floats({1.0f, 1.0f / 3, 100.0f}, {3}, DType::BF16);
  Tensor e = Tensor::from_floats({0.25f, 65504.0f}, {2}, DType::F16);
  std::vector<Tensor> grads = {a, big, h, e};
  int calls = 0;
  std::set<const float*> in_place;
  std::vector<float> staging;
  const std::vector<const void*> datas = {a.data(), big.data(), h.data(), e.data()};
  dist::all_reduce_in_buckets(
      grads, /*cap_bytes=*/16 * 4,
      [&](float* v, size_t n) {
        ++calls;
        EXPECT_LE(n, 16u);
        for (size_t i = 0; i < n; ++i) v[i] += 2 * v[i];  // + the other rank's (2x) values
        if (v != staging.data()) in_place.insert(v);
      },
      staging);
  // 3 + 40 + 3 + 2 = 48 elements, 16 per bucket.
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(a.to_floats(), (std::vector<float>{3, 6, 9}));
  for (float v : big.to_floats()) EXPECT_EQ(v, 1.5f);
  // bf16: widened, summed in f32, rounded once: 3 * bf16(1/3) rounded to bf16.
  const float third = bf16_bits_to_f32(f32_to_bf16_bits(1.0f / 3));
  EXPECT_EQ(h.to_floats()[1], bf16_bits_to_f32(f32_to_bf16_bits(3 * third)));
  EXPECT_EQ(h.to_floats()[2], 300.0f);
  // f16: 3 * 65504 overflows to inf in f16 (the finite check sees it, as on one process).
  EXPECT_EQ(e.to_floats()[0], 0.75f);
  EXPECT_TRUE(std::isinf(e.to_floats()[1]));
  // A bucket that is one piece of one f32 tensor is reduced in place, without staging.
  EXPECT_TRUE(in_place.count(big.data_as<float>() + 13)) << "expected the 2nd bucket in place";
}

TEST(Sharding, RanksCoverTheWindowWithoutOverlap) {
  for (int W : {1, 2, 3, 4}) {
    for (int64_t count : {0, 1, 2, 5, 8}) {
      std::vector<int64_t> all;
      for (int r = 0; r < W; ++r) {
        const auto mine = rank_micro_batches(10, count, r, W);
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT_EQ(mine[i], 10 + r + static_cast<int64_t>(i) * W);  // r, r + W, ...
        }
        all.insert(all.end(), mine.begin(), mine.end());
      }
      std::sort(all.begin(), all.end());
      std::vector<int64_t> want(static_cast<size_t>(count));
      std::iota(want.begin(), want.end(), 10);
      EXPECT_EQ(all, want) << "W=" << W << " count=" << count;
    }
  }
  // A remainder window of 1 micro-batch over 2 ranks: rank 1 gets none (it still joins every
  // collective of the step with zero gradients).
  EXPECT_TRUE(rank_micro_batches(6, 1, 1, 2).empty());
  EXPECT_THROW(rank_micro_batches(0, 4, 2, 2), Error);
}

// A fake group: all_gather returns what the "ranks" were set to hold (this process plays rank 0
// and reports its own values; the others' are preset).
class FakeGroup final : public Collective {
 public:
  explicit FakeGroup(std::vector<std::vector<double>> others) : others_(std::move(others)) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1 + static_cast<int>(others_.size()); }
  std::string backend() const override { return "fake"; }
  void all_reduce_grads(std::vector<Tensor>&) override {}
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_max(double*, size_t) override {}
  void all_gather(const double* in, size_t n, double* out) override {
    std::memcpy(out, in, n * sizeof(double));
    for (size_t r = 0; r < others_.size(); ++r) {
      EXPECT_EQ(others_[r].size(), n);
      std::memcpy(out + (r + 1) * n, others_[r].data(), n * sizeof(double));
    }
  }

 private:
  std::vector<std::vector<double>> others_;
};

TEST(RankConsistency, AgreementPassesAndADifferenceNamesTheValueAndTheRanks) {
  const double ck = tensors_checksum({Tensor::from_floats({1, 2}, {2})});
  const std::vector<RankCheckValue> mine = {
      {"step", 100}, {"loss_scale", 65536}, {"lr", 3e-4}, {"parameters_checksum", ck, true}};
  FakeGroup same({{100, 65536, 3e-4, ck}, {100, 65536, 3e-4, ck}});
  EXPECT_NO_THROW(check_rank_consistency(same, 100, mine));

  const double other_ck = tensors_checksum({Tensor::from_floats({1, 3}, {2})});
  FakeGroup diff({{100, 65536, 3e-4, ck}, {100, 32768, 3e-4, other_ck}});
  try {
    check_rank_consistency(diff, 100, mine);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("step 100"), std::string::npos) << m;
    EXPECT_NE(m.find("loss_scale is 65536 on rank 0, 32768 on rank 2"), std::string::npos) << m;
    EXPECT_NE(m.find("parameters_checksum"), std::string::npos) << m;
    EXPECT_EQ(m.find("lr is"), std::string::npos) << m;      // lr agrees
    EXPECT_EQ(m.find("on rank 1"), std::string::npos) << m;  // rank 1 agrees with rank 0
  }
  // Bit for bit: -0.0 is not 0.0.
  FakeGroup neg(std::vector<std::vector<double>>{{-0.0}});
  EXPECT_THROW(check_rank_consistency(neg, 1, {{"lr", 0.0}}), Error);
}

uint64_t bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

TEST(RankConsistency, ChecksumSeesOneBit) {
  Tensor a = Tensor::from_floats({1, 2, 3, 4, 5}, {5});
  Tensor b = a.clone();
  EXPECT_EQ(bits(tensors_checksum({a})), bits(tensors_checksum({b})));
  const uint64_t before = bits(tensors_checksum({a, b}));
  b.data_as<uint32_t>()[4] ^= 1u;  // the tail element's lowest bit
  EXPECT_NE(before, bits(tensors_checksum({a, b})));
  EXPECT_NE(bits(tensors_checksum({a, a})), bits(tensors_checksum({a, b})));
  EXPECT_NE(bits(tensors_checksum({a, b})), bits(tensors_checksum({b, a})));  // order matters
}

TEST(ProcessGroups, SelectionAndErrors) {
  auto single = dist::make_process_group("single", 25);
  EXPECT_EQ(single->world_size(), 1);
  EXPECT_EQ(single->rank(), 0);
  EXPECT_EQ(single->bucket_bytes(), 25000000);  // dist.bucket_mb counts 10^6 bytes
  double v[2] = {1, 2}, out[2];
  single->all_gather(v, 2, out);
  EXPECT_EQ(out[1], 2);
  if (!dist::launched_by_mpirun()) {
    EXPECT_EQ(dist::make_process_group("auto", 25)->backend(), "single");
  }
  EXPECT_THROW(dist::make_process_group("gloo", 25), Error);
  EXPECT_THROW(dist::make_process_group("single", 0), Error);
}

bool gpu_present() { return dist::usable_gpus() > 0; }

TEST(NcclGroup, WithoutAGpuOrNcclTheErrorSaysSo) {
  if (dist::nccl_available() && gpu_present())
    GTEST_SKIP() << "a GPU is present (see OneRankNcclCollectives)";
  try {
    dist::make_process_group("nccl", 25);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("dist.backend = \"nccl\""), std::string::npos) << m;
    EXPECT_NE(m.find("mpi"), std::string::npos) << m;  // the fix
  }
}

// Every group's collectives wait in ProcessGroup::wait_until_done (MPI's requests, NCCL's
// streams): it returns once the collective is done, and past dist.timeout_s it marks the group
// stuck and names the collective, its purpose, this rank and the others. (MPI's deadline end to
// end: CliDist's stalled-rank tests; NCCL's with two ranks needs two GPUs.)
class PollingGroup final : public dist::ProcessGroup {
 public:
  PollingGroup() : ProcessGroup(1024) {}
  int rank() const override { return 1; }
  int world_size() const override { return 3; }
  std::string backend() const override { return "polling"; }
  void all_reduce_grads(std::vector<Tensor>&) override {}
  void all_reduce_sum_f32(float*, size_t) override {}
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_max(double*, size_t) override {}
  void all_gather(const double*, size_t, double*) override {}
  [[noreturn]] void abort(int code) override { std::exit(code); }
  using ProcessGroup::wait_until_done;
  bool stuck() const { return stuck_; }
};

TEST(ProcessGroup, ACollectiveWaitsUntilDoneOrItsDeadline) {
  PollingGroup g;
  g.set_timeout(5);
  int polls = 0;
  g.wait_until_done([&] { return ++polls == 300; }, "ncclAllReduce(sum)", "");
  EXPECT_EQ(polls, 300);  // past the spinning polls, into the naps
  EXPECT_FALSE(g.stuck());
  g.set_timeout(0.05);
  const auto start = std::chrono::steady_clock::now();
  const std::string m = test::error_of([&] {
    g.wait_until_done([] { return false; }, "ncclAllReduce(sum of gradients)",
                      "summing gradient bucket 1 of 2 at step 3");
  });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 0.05);
  EXPECT_LT(waited, 2.0);
  EXPECT_TRUE(g.stuck());
  EXPECT_EQ(m,
            "ncclAllReduce(sum of gradients) while summing gradient bucket 1 of 2 at step 3 did "
            "not complete within dist.timeout_s = 0.05 s on rank 1: one or more of ranks 0, 2 did "
            "not arrive (stopped, hung, or running a different config); check that rank's "
            "output, or raise dist.timeout_s for slow steps");
}

TEST(NcclGroup, OneRankNcclCollectives) {
  if (!dist::nccl_available()) GTEST_SKIP() << "this build has no NCCL (KEEL_NCCL=OFF)";
  if (!gpu_present()) GTEST_SKIP() << "no usable CUDA GPU on this machine";
  // A 1-rank group still runs every collective through NCCL (host -> device -> NCCL -> host).
  auto g = dist::make_process_group("nccl", 0.001);  // 1000-byte buckets: several calls
  ASSERT_EQ(g->backend(), "nccl");
  g->set_timeout(30);  // each collective's stream polled to its deadline, done well before
  EXPECT_EQ(g->world_size(), 1);
  std::vector<float> big(1000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.5f;
  const std::vector<float> want = big;
  g->all_reduce_sum_f32(big.data(), big.size());
  EXPECT_EQ(big, want);
  double s[3] = {1.5, -2, 3}, m[2] = {7, -1}, out[3];
  g->all_reduce_sum(s, 3);
  EXPECT_EQ(s[1], -2);
  g->all_reduce_max(m, 2);
  EXPECT_EQ(m[0], 7);
  g->all_gather(s, 3, out);
  EXPECT_EQ(out[2], 3);
  Tensor a = Tensor::from_floats(std::vector<float>(700, 0.25f), {700});
  Tensor h = Tensor::from_floats({1, 2, 3}, {3}, DType::BF16);
  std::vector<Tensor> grads = {a, h};
  g->all_reduce_grads(grads);
  EXPECT_EQ(a.to_floats()[699], 0.25f);
  EXPECT_EQ(h.to_floats()[2], 3.0f);
  EXPECT_GE(g->buckets_reduced(), 3);  // 703 floats in 250-float buckets
}

}  // namespace
}  // namespace keel
