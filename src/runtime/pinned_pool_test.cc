// The pinned pool: size classes, stream-ordered reuse, the host budget, and
// the reference workload's steady state.

#include "runtime/pinned_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = kKiB * kKiB;

TEST(PinnedClassSize, WastesAtMostOneSixteenthAboveAPage) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 100000; ++i) {
    std::size_t bytes = 1 + rng() % (std::size_t{4} << 30);
    std::size_t cls = pinned_class_size(bytes, 4);
    ASSERT_GE(cls, bytes);
    ASSERT_LE(cls, std::max<std::size_t>(bytes + bytes / 16, 4096) + 4096) << bytes;
    ASSERT_EQ(cls % 4096, 0u);
  }
}

TEST(PinnedClassSize, ReferenceActivationSizesAreExactClasses) {
  // BENCHMARKS.md T1: 16384 tokens x hidden 2048 / MLP 5632 in bf16, the
  // attention logsumexp (4 x 16 heads x 4096 fp32) and a norm's rstd.
  for (std::size_t bytes : {64 * kMiB, 176 * kMiB, 1 * kMiB, 64 * kKiB}) {
    EXPECT_EQ(pinned_class_size(bytes, 4), bytes);
  }
  // Power-of-two rounding would pin 256 MiB for the 176 MiB MLP activation.
  EXPECT_EQ(pinned_class_size(176 * kMiB, 0), 256 * kMiB);
}

class PinnedPoolTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = make_fake_backend({});
  FakeControls& fake_ = *backend_->fake_controls();
};

TEST_F(PinnedPoolTest, BlockIsReusedOnlyAfterTheStreamThatUsedItPassedIt) {
  PinnedPool pool(*backend_, {});
  auto stream = backend_->create_stream(FakeControls::Role::kD2H);
  std::vector<char> device(8 * kKiB, 'z');
  PinnedBlock first = pool.allocate(8 * kKiB);
  std::memset(first.data, 'a', 8 * kKiB);
  // A slow use of the block: the stream is held up, then copies into it.
  fake_.set_delay(FakeControls::Role::kD2H, 20000, 20000, 1);
  backend_->copy(first.data, device.data(), device.size(), CopyKind::kDeviceToHost, *stream);
  pool.release(first, {stream.get()});
  PinnedBlock second = pool.allocate(8 * kKiB);
  EXPECT_EQ(second.data, first.data);
  EXPECT_EQ(std::memcmp(second.data, device.data(), device.size()), 0)
      << "handed out before the copy into it had run";
  PinnedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.pinned_allocations, 1u);
  EXPECT_EQ(stats.reuses, 1u);
  pool.release(second, {});
}

TEST_F(PinnedPoolTest, BudgetRefusalChangesNothing) {
  PinnedPool pool(*backend_, PinnedPoolOptions{.host_budget_bytes = 1 * kMiB});
  PinnedBlock a = pool.allocate(600 * kKiB);
  PinnedPoolStats before = pool.stats();
  try {
    pool.allocate(600 * kKiB);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("[pinned_pool] request of 614400 bytes"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("host budget of 1048576"), std::string::npos);
  }
  EXPECT_THROW(pool.allocate(2 * kMiB), OutOfMemory);
  PinnedPoolStats after = pool.stats();
  EXPECT_EQ(after.bytes_pinned, before.bytes_pinned);
  EXPECT_EQ(after.bytes_live, before.bytes_live);
  EXPECT_EQ(after.pinned_allocations, before.pinned_allocations);
  EXPECT_EQ(after.budget_refusals, 2u);
  pool.release(a, {});
}

TEST_F(PinnedPoolTest, AtTheBudgetABusyBlockOfTheClassIsAwaitedNotRefused) {
  PinnedPool pool(*backend_, PinnedPoolOptions{.host_budget_bytes = 1 * kMiB});
  auto stream = backend_->create_stream(FakeControls::Role::kH2D);
  std::vector<char> device(1 * kMiB);
  PinnedBlock a = pool.allocate(1 * kMiB);
  fake_.set_delay(FakeControls::Role::kH2D, 5000, 5000, 1);
  backend_->copy(device.data(), a.data, device.size(), CopyKind::kHostToDevice, *stream);
  pool.release(a, {stream.get()});
  PinnedBlock b = pool.allocate(1 * kMiB);
  EXPECT_EQ(b.data, a.data);
  EXPECT_EQ(pool.stats().pinned_allocations, 1u);
  pool.release(b, {});
}

TEST_F(PinnedPoolTest, CachedBlocksOfOtherClassesAreFreedToFitTheBudget) {
  PinnedPool pool(*backend_, PinnedPoolOptions{.host_budget_bytes = 2 * kMiB});
  pool.release(pool.allocate(1536 * kKiB), {});
  PinnedBlock b = pool.allocate(1 * kMiB);
  PinnedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.pinned_frees, 1u);
  EXPECT_EQ(stats.bytes_pinned, 1 * kMiB);
  pool.release(b, {});
  pool.trim();
  EXPECT_EQ(pool.stats().bytes_pinned, 0u);
}

TEST_F(PinnedPoolTest, PinnedAllocationFailureIsOutOfMemoryAndChangesNothing) {
  PinnedPool pool(*backend_, {});
  fake_.fail_next_pinned_allocations(1);
  EXPECT_THROW(pool.allocate(64 * kKiB), OutOfMemory);
  PinnedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.bytes_pinned, 0u);
  EXPECT_EQ(stats.bytes_live, 0u);
  PinnedBlock b = pool.allocate(64 * kKiB);
  EXPECT_EQ(pool.stats().pinned_allocations, 1u);
  pool.release(b, {});
}

TEST_F(PinnedPoolTest, AnExactBlockPinsItsPageRoundedSizeAndIsFreedOnceItsStreamPassed) {
  // Note [Exact blocks]: 17 MiB + 1 would take the 18 MiB class; exact pins a page more.
  PinnedPool pool(*backend_, {});
  const std::size_t bytes = 17 * kMiB + 1;
  PinnedBlock block = pool.allocate(bytes, HostFit::kExact);
  EXPECT_TRUE(block.exact);
  EXPECT_EQ(block.bytes, 17 * kMiB + 4096);
  EXPECT_EQ(pool.stats().bytes_pinned, 17 * kMiB + 4096);
  EXPECT_EQ(pinned_class_size(bytes, 4), 18 * kMiB);
  // Released while a slow copy still reads it: not freed until the stream passed.
  auto stream = backend_->create_stream(FakeControls::Role::kH2D);
  std::vector<char> device(bytes);
  fake_.set_delay(FakeControls::Role::kH2D, 20000, 20000, 1);
  backend_->copy(device.data(), block.data, bytes, CopyKind::kHostToDevice, *stream);
  pool.release(block, {stream.get()});
  EXPECT_EQ(pool.stats().bytes_live, 0u);
  backend_->synchronize(*stream);
  pool.trim();
  PinnedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.bytes_pinned, 0u);
  EXPECT_EQ(stats.pinned_frees, 1u);
  // Never parked: the same size again pins anew.
  PinnedBlock again = pool.allocate(bytes, HostFit::kExact);
  EXPECT_EQ(pool.stats().pinned_allocations, 2u);
  EXPECT_EQ(pool.stats().reuses, 0u);
  pool.release(again, {});
  EXPECT_EQ(pool.stats().bytes_pinned, 0u);  // no stream used it: freed at once
}

TEST_F(PinnedPoolTest, ReleasedExactBlocksStillInUseAreAwaitedToFitTheBudget) {
  PinnedPool pool(*backend_, PinnedPoolOptions{.host_budget_bytes = 1 * kMiB});
  PinnedBlock a = pool.allocate(700 * kKiB, HostFit::kExact);
  auto stream = backend_->create_stream(FakeControls::Role::kH2D);
  std::vector<char> device(700 * kKiB);
  fake_.set_delay(FakeControls::Role::kH2D, 20000, 20000, 1);
  backend_->copy(device.data(), a.data, device.size(), CopyKind::kHostToDevice, *stream);
  pool.release(a, {stream.get()});
  PinnedBlock b = pool.allocate(700 * kKiB, HostFit::kExact);  // waits for a's copy, frees a
  PinnedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.bytes_pinned, 700 * kKiB);
  EXPECT_EQ(stats.pinned_frees, 1u);
  pool.release(b, {});
}

TEST(PinnedPoolOptionsTest, OutOfRangeOptionsAreRejected) {
  auto backend = make_fake_backend({});
  EXPECT_THROW(PinnedPool(*backend, PinnedPoolOptions{.class_bits = 11}), InvalidArgument);
  EXPECT_THROW(PinnedPool(*backend, PinnedPoolOptions{.numa_node = -3}), InvalidArgument);
}

// The saved activations of one Llama layer of BENCHMARKS.md T1 (hidden 2048,
// 16 heads, MLP 5632, batch 4 x seq 4096 = 16384 tokens, bf16).
std::vector<std::size_t> t1_layer_activation_bytes() {
  const std::size_t tokens = std::size_t{4} * 4096;
  const std::size_t hidden = tokens * 2048 * 2;  // 64 MiB
  const std::size_t mlp = tokens * 5632 * 2;     // 176 MiB
  const std::size_t rstd = tokens * 4;           // 64 KiB, fp32
  const std::size_t lse = std::size_t{4} * 16 * 4096 * 4;     // 1 MiB, fp32
  return {hidden, rstd, hidden,                  // input, rstd, normed input
          hidden, hidden, hidden,                // q, k, v after rope
          hidden, lse,                           // attention output, logsumexp
          hidden, rstd, hidden,                  // residual, rstd, normed
          mlp, mlp, mlp, mlp};                   // gate, silu(gate), up, silu*up
}

TEST(PinnedPoolReference, ThousandStepsOfT1PinNothingAfterTheFirstAndStayWithinTenPercent) {
  auto backend = make_fake_backend(FakeBackendOptions{.unbacked_pinned = true});
  PinnedPool pool(*backend, {});
  auto d2h = backend->create_stream(FakeControls::Role::kD2H);
  auto h2d = backend->create_stream(FakeControls::Role::kH2D);
  const std::vector<std::size_t> layer = t1_layer_activation_bytes();
  constexpr int kLayers = 16;
  std::uint64_t after_first_step = 0;
  for (int step = 0; step < 1000; ++step) {
    std::vector<PinnedBlock> saved;
    for (int l = 0; l < kLayers; ++l) {
      for (std::size_t bytes : layer) saved.push_back(pool.allocate(bytes));
    }
    // Backward frees in reverse; the copies that read a block are on both
    // copy streams in the real runtime.
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      pool.release(*it, {d2h.get(), h2d.get()});
    }
    if (step == 0) after_first_step = pool.stats().pinned_allocations;
  }
  PinnedPoolStats stats = pool.stats();
  EXPECT_EQ(stats.pinned_allocations, after_first_step);
  EXPECT_EQ(stats.pinned_allocations, kLayers * layer.size());
  EXPECT_LE(static_cast<double>(stats.bytes_pinned),
            1.1 * static_cast<double>(stats.peak_bytes_requested));
  EXPECT_EQ(stats.reuses, std::size_t{999} * kLayers * layer.size());
}

}  // namespace
}  // namespace spillway::runtime
