// CUDA tests (label `cuda`): they need a GPU and run through
// scripts/device-check. Every byte that comes back is checked against a
// pattern written by a kernel. SPILLWAY_CUDA_TEST_MAX_BYTES caps the largest
// transfer (the sanitizer runs use a small cap); the default is 1 GiB.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "runtime/backend/cuda/cuda_check.h"
#include "runtime/backend/cuda/test_kernels.h"
#include "spillway/error.h"
#include "spillway/runtime.h"

namespace spillway {
namespace {

using runtime::testing::launch_count_mismatches;
using runtime::testing::launch_fill_pattern;
using runtime::testing::launch_spin;
using runtime::testing::pattern_byte;

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::size_t max_bytes() {
  const char* env = std::getenv("SPILLWAY_CUDA_TEST_MAX_BYTES");
  return env ? std::strtoull(env, nullptr, 10) : std::size_t{1} << 30;
}

class CudaRuntime : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    SPILLWAY_CUDA_CHECK(cudaSetDevice(0));
    SPILLWAY_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
    SPILLWAY_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&mismatches_), sizeof(unsigned long long)));
  }
  void TearDown() override {
    if (compute_) {
      SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(compute_));
      SPILLWAY_CUDA_CHECK(cudaStreamDestroy(compute_));
    }
    if (mismatches_) SPILLWAY_CUDA_CHECK(cudaFree(mismatches_));
  }

  RuntimeOptions options() {
    RuntimeOptions o;
    o.backend = BackendKind::kCuda;
    o.compute_stream = compute_;
    return o;
  }
  // A device storage holding the pattern of `seed`, written by a kernel on
  // the compute stream and adopted by `rt` (freed with cudaFreeAsync).
  DeviceValue make_device_value(Runtime& rt, std::size_t bytes, std::uint64_t seed) {
    void* data = nullptr;
    SPILLWAY_CUDA_CHECK(cudaMallocAsync(&data, bytes, compute_));
    launch_fill_pattern(data, bytes, seed, compute_);
    SPILLWAY_CUDA_CHECK(cudaGetLastError());
    StorageId id = rt.adopt(data, bytes, [](void* p, std::size_t, void* stream) {
      (void)cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
    });
    return DeviceValue{id, data, bytes};
  }
  StorageId make_value(Runtime& rt, std::size_t bytes, std::uint64_t seed) {
    return make_device_value(rt, bytes, seed).storage;
  }
  // Mismatching bytes of `data` against the pattern, counted on the compute
  // stream (so after whatever the compute stream waited for).
  unsigned long long mismatches(const void* data, std::size_t bytes, std::uint64_t seed) {
    SPILLWAY_CUDA_CHECK(cudaMemsetAsync(mismatches_, 0, sizeof(unsigned long long), compute_));
    launch_count_mismatches(data, bytes, seed, mismatches_, compute_);
    SPILLWAY_CUDA_CHECK(cudaGetLastError());
    unsigned long long n = 0;
    SPILLWAY_CUDA_CHECK(cudaMemcpyAsync(&n, mismatches_, sizeof(n), cudaMemcpyDeviceToHost,
                                        compute_));
    SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(compute_));
    return n;
  }
  std::size_t host_mismatches(const HostHandle& h, std::uint64_t seed) {
    const auto* p = static_cast<const std::uint8_t*>(h.data);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < h.bytes; ++i) bad += p[i] != pattern_byte(seed, i);
    return bad;
  }

  cudaStream_t compute_ = nullptr;
  unsigned long long* mismatches_ = nullptr;
};

TEST_F(CudaRuntime, RoundTripIsByteExactFromOneByteToOneGiB) {
  Runtime rt(options());
  std::vector<std::size_t> sizes = {1, 7, 4096, 65537, kMiB + 3, 33 * kMiB + 5, 64 * kMiB,
                                    std::size_t{1} << 30};
  std::uint64_t seed = 1;
  for (std::size_t bytes : sizes) {
    if (bytes > max_bytes()) continue;
    SCOPED_TRACE(bytes);
    StorageId s = make_value(rt, bytes, ++seed);
    HostHandle h = rt.offload(s, {});
    rt.wait_offload(h, s, {});
    EXPECT_EQ(rt.state(s), StorageState::kOnHost);
    SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(compute_));
    if (bytes <= 64 * kMiB) {
      EXPECT_EQ(host_mismatches(h, seed), 0u);
    }
    DeviceValue v = rt.reload(h, 0, {});
    rt.wait_reload(v.storage, {});
    EXPECT_EQ(mismatches(v.data, bytes, seed), 0u);
    rt.release(v.storage, {});
    rt.release(s, {});
    rt.release_host(h);
  }
}

TEST_F(CudaRuntime, BothDirectionsAtOnceInterleavedWithCompute) {
  Runtime rt(options());
  const std::size_t bytes = std::min<std::size_t>(48 * kMiB + 4097, max_bytes());
  constexpr int kLayers = 8;
  // "Forward" of step 0: produce, offload, compute, release at the wait.
  std::vector<StorageId> values;
  std::vector<HostHandle> hosts;
  for (int l = 0; l < kLayers; ++l) {
    values.push_back(make_value(rt, bytes, 100 + l));
    hosts.push_back(rt.offload(values.back(), {}));
    launch_spin(50, compute_);
    if (l > 0) rt.wait_offload(hosts[l - 1], values[l - 1], {});
  }
  rt.wait_offload(hosts.back(), values.back(), {});
  // Step 1: its forward offloads new values while the previous step's values
  // reload, so both copy streams are busy at once; new allocations reuse the
  // memory released above, which exposes any missing wait.
  std::vector<DeviceValue> reloaded;
  std::vector<StorageId> next;
  std::vector<HostHandle> next_hosts;
  for (int l = 0; l < kLayers; ++l) {
    reloaded.push_back(rt.reload(hosts[kLayers - 1 - l], /*priority=*/kLayers - l, {}));
    next.push_back(make_value(rt, bytes, 200 + l));
    next_hosts.push_back(rt.offload(next.back(), {}));
    launch_spin(30, compute_);
  }
  for (int l = 0; l < kLayers; ++l) {
    rt.wait_reload(reloaded[l].storage, {});
    EXPECT_EQ(mismatches(reloaded[l].data, bytes, 100 + (kLayers - 1 - l)), 0u) << "layer " << l;
    rt.wait_offload(next_hosts[l], next[l], {});
  }
  for (int l = 0; l < kLayers; ++l) {
    DeviceValue v = rt.reload(next_hosts[l], 0, {});
    rt.wait_reload(v.storage, {});
    EXPECT_EQ(mismatches(v.data, bytes, 200 + l), 0u) << "layer " << l;
    rt.release(v.storage, {});
  }
  CopyEngineStats copies = rt.copy_stats();
  EXPECT_EQ(copies.bytes_d2h, 2 * kLayers * bytes);
  EXPECT_EQ(copies.bytes_h2d, 2 * kLayers * bytes);
}

TEST_F(CudaRuntime, PinnedBlocksAreReusedAcrossSteps) {
  RuntimeOptions o = options();
  Runtime rt(o);
  const std::vector<std::size_t> sizes = {std::min(64 * kMiB, max_bytes()), kMiB, 65536};
  std::uint64_t allocations_after_first = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<std::pair<StorageId, HostHandle>> saved;
    for (int layer = 0; layer < 4; ++layer) {
      for (std::size_t bytes : sizes) {
        StorageId s = make_value(rt, bytes, step * 1000 + layer * 10 + bytes % 7);
        HostHandle h = rt.offload(s, {});
        rt.wait_offload(h, s, {});
        saved.emplace_back(s, h);
      }
    }
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      DeviceValue v = rt.reload(it->second, 0, {});
      rt.wait_reload(v.storage, {});
      rt.release(v.storage, {});
      rt.release_host(it->second);
      rt.release(it->first, {});
    }
    if (step == 0) allocations_after_first = rt.pool_stats().pinned_allocations;
  }
  PinnedPoolStats stats = rt.pool_stats();
  EXPECT_EQ(stats.pinned_allocations, allocations_after_first);
  EXPECT_LE(stats.bytes_pinned, stats.peak_bytes_requested * 11 / 10);
  EXPECT_GT(stats.reuses, 0u);
}

// A caller-supplied allocator (as PyTorch's caching allocator will be).
class CountingAllocator : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes, void* stream) override {
    void* p = nullptr;
    SPILLWAY_CUDA_CHECK(cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)));
    ++allocations;
    return p;
  }
  void deallocate(void* p, std::size_t, void* stream) noexcept override {
    (void)cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
    ++deallocations;
  }
  int allocations = 0;
  int deallocations = 0;
};

TEST_F(CudaRuntime, ReloadUsesTheSuppliedAllocatorAndHostBudgetRefusalKeepsTheValue) {
  CountingAllocator allocator;
  {
    RuntimeOptions o = options();
    o.device_allocator = &allocator;
    o.pool.host_budget_bytes = 8 * kMiB;
    Runtime rt(o);
    DeviceValue big = make_device_value(rt, 16 * kMiB, 7);
    EXPECT_THROW(rt.offload(big.storage, {}), OutOfMemory);
    EXPECT_EQ(rt.state(big.storage), StorageState::kResident);
    StorageId small = make_value(rt, 4 * kMiB, 8);
    HostHandle h = rt.offload(small, {});
    rt.wait_offload(h, small, {});
    DeviceValue v = rt.reload(h, 0, {});
    rt.wait_reload(v.storage, {});
    EXPECT_EQ(allocator.allocations, 1);
    EXPECT_EQ(mismatches(v.data, 4 * kMiB, 8), 0u);
    EXPECT_EQ(mismatches(big.data, 16 * kMiB, 7), 0u);  // the refused value is intact
    rt.release(v.storage, {});
    EXPECT_EQ(allocator.deallocations, 1);
    rt.release_host(h);
  }
}

}  // namespace
}  // namespace spillway
