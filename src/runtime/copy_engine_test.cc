// The copy engine: chunking, priorities, failures.

#include "runtime/copy_engine.h"

#include <gtest/gtest.h>

#include <vector>

#include "runtime/fake_test_util.h"
#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(CopyEngine, LargeTransferIsSplitIntoChunksAndArrivesExactly) {
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = kMiB,
                                                .max_inflight_bytes = 2 * kMiB});
  std::vector<char> src(10 * kMiB + 123), dst(src.size());
  testing::fill_pattern(src.data(), src.size(), 5);
  TransferPtr t = engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), src.size(), 0, {});
  engine.synchronize(t);
  EXPECT_EQ(dst, src);
  CopyEngineStats stats = engine.stats();
  EXPECT_EQ(stats.chunks, 11u);
  EXPECT_EQ(stats.bytes_d2h, src.size());
}

TEST(CopyEngine, UrgentTransferOvertakesAHugeOneBetweenChunks) {
  auto backend = make_fake_backend({});
  backend->fake_controls()->set_delay(FakeControls::Role::kH2D, 2000, 2000, 1);
  CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = std::size_t{256} * 1024,
                                                .max_inflight_bytes = std::size_t{512} * 1024});
  std::vector<char> huge_src(32 * std::size_t{256} * 1024, 'h'), huge_dst(huge_src.size());
  std::vector<char> small_src(1000, 's'), small_dst(1000);
  TransferPtr huge = engine.submit(CopyKind::kHostToDevice, huge_dst.data(), huge_src.data(),
                                   huge_src.size(), 0, {});
  TransferPtr urgent = engine.submit(CopyKind::kHostToDevice, small_dst.data(),
                                     small_src.data(), small_src.size(), 10, {});
  engine.synchronize(urgent);
  // 32 chunks take >= 64 ms; the urgent copy waited for at most a few.
  EXPECT_FALSE(engine.poll(huge));
  EXPECT_EQ(small_dst, small_src);
  engine.synchronize(huge);
  EXPECT_EQ(huge_dst, huge_src);
}

TEST(CopyEngine, TransferStartsOnlyAfterItsAfterEvents) {
  auto backend = make_fake_backend({});
  FakeControls& fake = *backend->fake_controls();
  StreamHandle compute = fake.create_compute_stream();
  CopyEngine engine(*backend, {});
  std::vector<char> src(4096, 0), dst(4096, 1);
  fake.launch(compute, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    testing::fill_pattern(src.data(), src.size(), 9);
  });
  auto producer = backend->wrap_stream(compute.native);
  std::shared_ptr<Event> after = backend->create_event();
  backend->record(*after, *producer);
  TransferPtr t =
      engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), src.size(), 0, {after});
  engine.synchronize(t);
  EXPECT_EQ(testing::count_mismatches(dst.data(), dst.size(), 9), 0u);
}

TEST(CopyEngine, FailedCopySurfacesAsTransferErrorAtTheWait) {
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, {});
  backend->fake_controls()->fail_next_copies(1);
  std::vector<char> src(4096, 3), dst(4096);
  TransferPtr t = engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), src.size(), 0, {});
  try {
    engine.synchronize(t);
    FAIL() << "expected TransferError";
  } catch (const TransferError& e) {
    EXPECT_NE(std::string(e.what()).find("device-to-host copy of 4096 bytes failed"),
              std::string::npos)
        << e.what();
  }
  // The next transfer on the stream is clean.
  TransferPtr again =
      engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), src.size(), 0, {});
  engine.synchronize(again);
  EXPECT_EQ(dst, src);
}

TEST(CopyEngine, SparedFailureIsLeftForTheNextCheckAndReportedOnce) {
  // A wait that already acted on its own transfer passes it as `spare`: its
  // failure must not be raised there, yet must not be lost either.
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, {});
  backend->fake_controls()->fail_next_copies(2);
  std::vector<char> src(4096, 3), dst_a(4096), dst_b(4096);
  TransferPtr a =
      engine.submit(CopyKind::kDeviceToHost, dst_a.data(), src.data(), src.size(), 0, {});
  TransferPtr b =
      engine.submit(CopyKind::kDeviceToHost, dst_b.data(), src.data(), src.size(), 0, {});
  engine.drain();  // both ran and failed; drain reports nothing
  // Sparing `a` still reports `b`, which is behind it on the stream.
  EXPECT_THROW(engine.check_failures(a.get()), TransferError);
  EXPECT_NO_THROW(engine.check_failures(a.get()));
  EXPECT_THROW(engine.check_failures(), TransferError);  // now `a`, once
  EXPECT_NO_THROW(engine.check_failures());
}

TEST(CopyEngine, BadOptionsAreRejected) {
  auto backend = make_fake_backend({});
  EXPECT_THROW(CopyEngine(*backend, CopyEngineOptions{.chunk_bytes = 0}), InvalidArgument);
  EXPECT_THROW(CopyEngine(*backend, CopyEngineOptions{.chunk_bytes = 2 * kMiB,
                                                      .max_inflight_bytes = kMiB}),
               InvalidArgument);
}

}  // namespace
}  // namespace spillway::runtime
