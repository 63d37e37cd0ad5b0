// The copy engine: chunking, priorities, both directions at once, failures,
// shutdown.

#include "runtime/copy_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "runtime/fake_test_util.h"
#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;

// An event recorded behind a kernel that waits until open(): a transfer made
// to wait for it cannot run before. Opens when destroyed, so a failed test
// leaves no stream blocked.
class Gate {
 public:
  explicit Gate(Backend& backend) : event_(backend.create_event()) {
    FakeControls& fake = *backend.fake_controls();
    StreamHandle compute = fake.create_compute_stream();
    fake.launch(compute, [opened = promise_.get_future().share()] { opened.wait(); });
    backend.record(*event_, *backend.wrap_stream(compute.native));
  }
  ~Gate() { open(); }
  void open() {
    if (!opened_) promise_.set_value();
    opened_ = true;
  }
  const std::shared_ptr<Event>& event() const { return event_; }

 private:
  std::promise<void> promise_;
  bool opened_ = false;
  std::shared_ptr<Event> event_;
};

// Transfers of `bytes` each, covering `src`, to `dst`, in one direction.
std::vector<TransferPtr> submit_all(CopyEngine& engine, CopyKind kind, std::vector<char>& dst,
                                    const std::vector<char>& src, std::size_t bytes) {
  std::vector<TransferPtr> transfers;
  for (std::size_t at = 0; at + bytes <= src.size(); at += bytes) {
    transfers.push_back(engine.submit(kind, dst.data() + at, src.data() + at, bytes, 0, {}));
  }
  return transfers;
}

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

TEST(CopyEngine, WaitedTransferGoesBeforeEarlierPendingOnes) {
  // One chunk in flight: the dispatcher enqueues the gated transfer, takes
  // the next one's chunk and blocks (invariant 2) while `first` and `waited`
  // are pending.
  std::vector<char> src(64 * kKiB, 'x'), dst(src.size());
  std::vector<char> first_src(4096, 'f'), waited_src(4096, 'w'), shared_dst(4096);
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = 64 * kKiB,
                                                .max_inflight_bytes = 64 * kKiB});
  Gate gate(*backend);
  engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), src.size(), 0, {gate.event()});
  engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), src.size(), 0, {});
  TransferPtr first = engine.submit(CopyKind::kDeviceToHost, shared_dst.data(), first_src.data(),
                                    first_src.size(), 0, {});
  TransferPtr waited = engine.submit(CopyKind::kDeviceToHost, shared_dst.data(),
                                     waited_src.data(), waited_src.size(), 0, {});
  std::thread waiter([&] { engine.wait_enqueued(waited); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the wait made it urgent
  gate.open();
  waiter.join();
  engine.drain();
  EXPECT_EQ(shared_dst, first_src) << "the waited transfer ran last, not before `first`";
}

TEST(CopyEngine, AWaitIsEnqueuedWithoutWaitingForTheCopiesBeforeIt) {
  // Note [Awaited transfers]: the dispatcher blocks on `first` (invariant 2)
  // while `waited` is made urgent; once `first` ran, every chunk of `waited`
  // goes on the stream behind `closed` though none of them can run, and the
  // wait returns.
  constexpr std::size_t kChunk = 64 * kKiB;
  std::vector<char> src(kChunk, 'a'), dst(kChunk), waited_src(4 * kChunk), waited_dst(4 * kChunk);
  testing::fill_pattern(waited_src.data(), waited_src.size(), 13);
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = kChunk,
                                                .max_inflight_bytes = kChunk});
  Gate opening(*backend), closed(*backend);
  engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), kChunk, 0, {opening.event()});
  engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), kChunk, 0, {});
  TransferPtr waited = engine.submit(CopyKind::kDeviceToHost, waited_dst.data(),
                                     waited_src.data(), waited_src.size(), 0, {closed.event()});
  auto wait = std::async(std::launch::async, [&] { engine.wait_enqueued(waited); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the wait made it urgent
  opening.open();
  const bool returned = wait.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  EXPECT_FALSE(engine.poll(waited));
  closed.open();
  wait.get();
  EXPECT_TRUE(returned) << "the wait stood until the copies before its last chunk had run";
  engine.synchronize(waited);
  EXPECT_EQ(waited_dst, waited_src);
}

TEST(CopyEngine, AWaitTakesOverFromADispatcherHeldByTheBound) {
  // Note [Awaited transfers]: the dispatcher waits for `first` to run before
  // it enqueues `second` (invariant 2), and `first` cannot run before
  // `opening` opens (on CUDA: until the compute stream gets to the point its
  // copy was asked at). A wait for `waited` begun meanwhile returns once its
  // chunks are on the stream, behind `first`, without waiting for it to run.
  constexpr std::size_t kChunk = 64 * kKiB;
  std::vector<char> src(kChunk, 'a'), dst(kChunk), second_dst(kChunk);
  std::vector<char> waited_src(4 * kChunk), waited_dst(4 * kChunk);
  testing::fill_pattern(waited_src.data(), waited_src.size(), 17);
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = kChunk,
                                                .max_inflight_bytes = kChunk});
  Gate opening(*backend);
  TransferPtr first = engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), kChunk, 0,
                                    {opening.event()});
  TransferPtr second =
      engine.submit(CopyKind::kDeviceToHost, second_dst.data(), src.data(), kChunk, 0, {});
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // held by the bound
  TransferPtr waited = engine.submit(CopyKind::kDeviceToHost, waited_dst.data(),
                                     waited_src.data(), waited_src.size(), 0, {});
  auto wait = std::async(std::launch::async, [&] { engine.wait_enqueued(waited); });
  const bool returned = wait.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  EXPECT_FALSE(engine.poll(waited));  // behind `first` on the stream
  opening.open();
  wait.get();
  EXPECT_TRUE(returned) << "the wait stood until the chunk the dispatcher was held by had run";
  engine.synchronize(waited);
  engine.synchronize(second);
  engine.synchronize(first);
  EXPECT_EQ(waited_dst, waited_src);
  EXPECT_EQ(second_dst, src);
}

TEST(CopyEngine, ADispatcherHeldByTheBoundEnqueuesNoMoreThanItAllows) {
  // Invariant 2 while the dispatcher polls for the bound: two chunks fit, and
  // none can run before the gate opens, so two are on the stream, not eight.
  constexpr std::size_t kChunk = 64 * kKiB;
  std::vector<char> src(8 * kChunk), dst(src.size());
  testing::fill_pattern(src.data(), src.size(), 19);
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = kChunk,
                                                .max_inflight_bytes = 2 * kChunk});
  Gate gate(*backend);
  TransferPtr t = engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(), src.size(), 0,
                                {gate.event()});
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // many polls
  EXPECT_EQ(engine.stats().chunks, 2u);
  gate.open();
  engine.synchronize(t);
  EXPECT_EQ(engine.stats().chunks, 8u);
  EXPECT_EQ(dst, src);
}

TEST(CopyEngine, OneDirectionBlockedOnTheDeviceDoesNotHoldUpTheOther) {
  std::vector<char> src(kMiB), dst(kMiB), h2d_src(4 * kMiB), h2d_dst(h2d_src.size());
  testing::fill_pattern(src.data(), src.size(), 3);
  testing::fill_pattern(h2d_src.data(), h2d_src.size(), 4);
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = 64 * kKiB,
                                                .max_inflight_bytes = 128 * kKiB});
  Gate gate(*backend);
  // Its dispatcher enqueues two chunks behind the gate and blocks on the
  // first (invariant 2).
  TransferPtr blocked = engine.submit(CopyKind::kDeviceToHost, dst.data(), src.data(),
                                      src.size(), 0, {gate.event()});
  for (const TransferPtr& t :
       submit_all(engine, CopyKind::kHostToDevice, h2d_dst, h2d_src, 64 * kKiB)) {
    engine.synchronize(t);
  }
  EXPECT_EQ(h2d_dst, h2d_src);
  EXPECT_FALSE(engine.poll(blocked));
  gate.open();
  engine.synchronize(blocked);
  EXPECT_EQ(dst, src);
}

TEST(CopyEngine, DrainWaitsForEveryTransferInBothDirections) {
  for (FakeControls::Role slow : {FakeControls::Role::kD2H, FakeControls::Role::kH2D}) {
    std::vector<char> d2h_src(kMiB), d2h_dst(kMiB), h2d_src(kMiB), h2d_dst(kMiB);
    testing::fill_pattern(d2h_src.data(), kMiB, 7);
    testing::fill_pattern(h2d_src.data(), kMiB, 8);
    auto backend = make_fake_backend({});
    backend->fake_controls()->set_delay(slow, 100, 300, 5);
    CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = 64 * kKiB,
                                                  .max_inflight_bytes = 256 * kKiB});
    auto d2h = submit_all(engine, CopyKind::kDeviceToHost, d2h_dst, d2h_src, 32 * kKiB);
    auto h2d = submit_all(engine, CopyKind::kHostToDevice, h2d_dst, h2d_src, 32 * kKiB);
    engine.drain();
    for (const auto* batch : {&d2h, &h2d}) {
      for (const TransferPtr& t : *batch) EXPECT_TRUE(engine.poll(t));
    }
    EXPECT_EQ(d2h_dst, d2h_src);
    EXPECT_EQ(h2d_dst, h2d_src);
  }
}

TEST(CopyEngine, DestroyingTheEngineFinishesTheWorkStillPending) {
  std::vector<char> d2h_src(kMiB), d2h_dst(kMiB), h2d_src(kMiB), h2d_dst(kMiB);
  testing::fill_pattern(d2h_src.data(), kMiB, 11);
  testing::fill_pattern(h2d_src.data(), kMiB, 12);
  auto backend = make_fake_backend({});
  backend->fake_controls()->set_delay(FakeControls::Role::kD2H, 50, 300, 9);
  backend->fake_controls()->set_delay(FakeControls::Role::kH2D, 50, 300, 10);
  std::vector<TransferPtr> kept;
  {
    CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = 64 * kKiB,
                                                  .max_inflight_bytes = 128 * kKiB});
    kept = submit_all(engine, CopyKind::kDeviceToHost, d2h_dst, d2h_src, 32 * kKiB);
    for (TransferPtr& t : submit_all(engine, CopyKind::kHostToDevice, h2d_dst, h2d_src, 32 * kKiB)) {
      kept.push_back(std::move(t));
    }
  }
  EXPECT_EQ(d2h_dst, d2h_src);
  EXPECT_EQ(h2d_dst, h2d_src);
  // Their events outlive the engine, and their holders destroy them.
  for (const TransferPtr& t : kept) EXPECT_TRUE(backend->query(*t->done()));
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

TEST(CopyEngine, FailureNobodyWaitsOnInABigBatchIsReportedOnceAfterDrain) {
  // drain() forgets a lane's transfers in one pass when its stream
  // synchronizes cleanly (Note [Drain]); a failed copy in the middle of a
  // batch, whose failure only its chunk event carries, must not go with them.
  constexpr std::size_t kBytes = 4 * kKiB;
  constexpr std::size_t kFailedBytes = 3000;  // names the failed transfer
  std::vector<char> d2h_src(256 * kBytes), d2h_dst(d2h_src.size());
  std::vector<char> h2d_src(256 * kBytes), h2d_dst(h2d_src.size());
  std::vector<char> failed_src(kFailedBytes, 9), failed_dst(kFailedBytes);
  testing::fill_pattern(d2h_src.data(), d2h_src.size(), 21);
  testing::fill_pattern(h2d_src.data(), h2d_src.size(), 22);
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, {});
  auto before = submit_all(engine, CopyKind::kDeviceToHost, d2h_dst, d2h_src, kBytes);
  auto h2d = submit_all(engine, CopyKind::kHostToDevice, h2d_dst, h2d_src, kBytes);
  for (const auto* batch : {&before, &h2d}) {
    for (const TransferPtr& t : *batch) engine.wait_enqueued(t);
  }
  backend->fake_controls()->fail_next_copies(1);  // taken by the next copy enqueued
  TransferPtr failed = engine.submit(CopyKind::kDeviceToHost, failed_dst.data(),
                                     failed_src.data(), kFailedBytes, 0, {});
  engine.wait_enqueued(failed);
  failed.reset();  // nobody waits on it
  std::vector<char> after_src(64 * kBytes, 5), after_dst(after_src.size());
  auto after = submit_all(engine, CopyKind::kDeviceToHost, after_dst, after_src, kBytes);
  engine.drain();
  engine.drain();  // a second drain does not lose it either
  EXPECT_EQ(d2h_dst, d2h_src);
  EXPECT_EQ(h2d_dst, h2d_src);
  EXPECT_EQ(after_dst, after_src);
  try {
    engine.check_failures();
    FAIL() << "the failure was dropped";
  } catch (const TransferError& e) {
    EXPECT_NE(std::string(e.what()).find("device-to-host copy of 3000 bytes failed"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(engine.check_failures()) << "reported twice";
  // Everything else was clean and is forgotten by the next drain.
  TransferPtr clean = engine.submit(CopyKind::kHostToDevice, h2d_dst.data(), h2d_src.data(),
                                    kBytes, 0, {});
  engine.drain();
  EXPECT_TRUE(engine.poll(clean));
  EXPECT_NO_THROW(engine.check_failures());
}

TEST(CopyEngine, TransferEnqueuedWhileDrainSynchronizesIsNotForgotten) {
  // drain() may forget without querying only what was enqueued before it
  // synchronized the stream. `late` is enqueued while drain() waits for the
  // stream, runs only after drain() returned, and fails: its failure must be
  // reported at the next check.
  auto backend = make_fake_backend({});
  CopyEngine engine(*backend, {});
  Gate early_gate(*backend), late_gate(*backend);
  std::vector<char> src(4096, 3), early_dst(4096), late_dst(4096);
  TransferPtr early = engine.submit(CopyKind::kDeviceToHost, early_dst.data(), src.data(),
                                    src.size(), 0, {early_gate.event()});
  engine.wait_enqueued(early);
  std::future<void> drained = std::async(std::launch::async, [&] { engine.drain(); });
  // drain() is now blocked in the synchronize of the stream, behind `early`.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_EQ(drained.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  backend->fake_controls()->fail_next_copies(1);
  TransferPtr late = engine.submit(CopyKind::kDeviceToHost, late_dst.data(), src.data(),
                                   src.size(), 0, {late_gate.event()});
  engine.wait_enqueued(late);
  early_gate.open();
  const bool returned = drained.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  late_gate.open();
  drained.get();
  ASSERT_TRUE(returned) << "drain() waited for `late`: it began after `late` was enqueued";
  EXPECT_EQ(early_dst, src);
  engine.finish(late);  // has run (and failed); reports nothing
  late.reset();
  EXPECT_THROW(engine.check_failures(), TransferError);
  EXPECT_NO_THROW(engine.check_failures());
}

TEST(CopyEngine, SubmitsFromAnotherThreadDuringDrainsAllArriveAndTheirFailureIsReported) {
  constexpr std::size_t kBytes = 4 * kKiB;
  constexpr int kTransfers = 400;
  std::vector<char> src(kTransfers * kBytes), dst(src.size());
  testing::fill_pattern(src.data(), src.size(), 31);
  auto backend = make_fake_backend({});
  backend->fake_controls()->set_delay(FakeControls::Role::kD2H, 0, 20, 3);
  CopyEngine engine(*backend, {});
  std::atomic<bool> submitting{true};
  std::atomic<int> drains{0};
  bool drained_meanwhile = true;
  std::thread submitter([&] {
    std::vector<TransferPtr> sent;
    for (int i = 0; i < kTransfers; ++i) {
      if (i == kTransfers / 4 || i == 3 * kTransfers / 4) {
        // A drain completes while transfers are still being submitted, however the
        // threads are scheduled.
        const int seen = drains.load();
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (drains.load() == seen && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::yield();
        }
        drained_meanwhile = drained_meanwhile && drains.load() > seen;
      }
      if (i == kTransfers / 2) {
        // Every earlier transfer enqueued, so the next copy enqueued is this one's.
        // Oldest first: a waited transfer becomes the most urgent, and waiting only
        // for the last would let it overtake earlier ones still pending.
        for (const TransferPtr& t : sent) engine.wait_enqueued(t);
        backend->fake_controls()->fail_next_copies(1);
      }
      const std::size_t at = i * kBytes;
      sent.push_back(engine.submit(CopyKind::kDeviceToHost, dst.data() + at, src.data() + at,
                                   kBytes, 0, {}));
      if (i == kTransfers / 2) engine.wait_enqueued(sent.back());
    }
    submitting = false;
  });
  while (submitting) {
    engine.drain();
    ++drains;
  }
  submitter.join();
  engine.drain();
  EXPECT_TRUE(drained_meanwhile) << "no drain() completed within 10 s while submitting";
  int reported = 0;
  for (;;) {
    try {
      engine.check_failures();
      break;
    } catch (const TransferError&) {
      ++reported;
    }
  }
  EXPECT_EQ(reported, 1);
  const std::size_t failed_at = kTransfers / 2 * kBytes;
  std::copy(src.begin() + failed_at, src.begin() + failed_at + kBytes,
            dst.begin() + failed_at);  // scribbled by the injected failure
  EXPECT_EQ(dst, src);
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
