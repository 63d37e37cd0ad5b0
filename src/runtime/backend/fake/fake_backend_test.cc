// The fake backend keeps CUDA's ordering rules: what the runtime's race tests
// rely on.

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "runtime/backend/backend.h"
#include "spillway/error.h"

namespace spillway::runtime {
namespace {

TEST(FakeBackend, StreamRunsWorkInOrderAndEventsMarkIt) {
  auto backend = make_fake_backend({});
  auto stream = backend->create_stream(FakeControls::Role::kD2H);
  backend->fake_controls()->set_delay(FakeControls::Role::kD2H, 50, 200, 1);
  std::vector<char> src(1 << 16, 'a'), dst(1 << 16, 0);
  auto event = backend->create_event();
  backend->copy(dst.data(), src.data(), src.size(), CopyKind::kDeviceToHost, *stream);
  backend->record(*event, *stream);
  backend->synchronize(*event);
  EXPECT_TRUE(backend->query(*event));
  EXPECT_EQ(dst, src);
}

TEST(FakeBackend, StreamWaitOrdersWorkAcrossStreams) {
  auto backend = make_fake_backend({});
  auto fake = backend->fake_controls();
  fake->set_delay(FakeControls::Role::kD2H, 500, 1000, 2);
  auto slow = backend->create_stream(FakeControls::Role::kD2H);
  auto fast = backend->create_stream(FakeControls::Role::kH2D);
  std::vector<char> a(4096, 'x'), b(4096, 0), c(4096, 0);
  auto event = backend->create_event();
  backend->copy(b.data(), a.data(), a.size(), CopyKind::kDeviceToHost, *slow);
  backend->record(*event, *slow);
  backend->wait(*fast, *event);
  backend->copy(c.data(), b.data(), b.size(), CopyKind::kHostToDevice, *fast);
  backend->synchronize(*fast);
  EXPECT_EQ(c, a);
}

TEST(FakeBackend, UnrecordedEventIsComplete) {
  auto backend = make_fake_backend({});
  auto event = backend->create_event();
  EXPECT_TRUE(backend->query(*event));
  backend->synchronize(*event);
}

TEST(FakeBackend, CopyFailureSurfacesAtTheNextEventAndReachesWaiters) {
  auto backend = make_fake_backend({});
  auto d2h = backend->create_stream(FakeControls::Role::kD2H);
  auto h2d = backend->create_stream(FakeControls::Role::kH2D);
  backend->fake_controls()->fail_next_copies(1);
  std::vector<char> a(64, 1), b(64, 0);
  backend->copy(b.data(), a.data(), a.size(), CopyKind::kDeviceToHost, *d2h);
  auto first = backend->create_event();
  backend->record(*first, *d2h);
  backend->wait(*h2d, *first);
  auto second = backend->create_event();
  backend->record(*second, *h2d);
  EXPECT_THROW(backend->synchronize(*first), TransferError);
  EXPECT_THROW(backend->synchronize(*second), TransferError);
  // The failure is reported once per stream: later work is clean.
  backend->copy(b.data(), a.data(), a.size(), CopyKind::kDeviceToHost, *d2h);
  auto third = backend->create_event();
  backend->record(*third, *d2h);
  backend->synchronize(*third);
  EXPECT_EQ(a, b);
}

TEST(FakeBackend, StreamSynchronizeThrowsOnceAnyWorkOnItFailedAndStaysThrowing) {
  // The copy engine forgets a lane's transfers without querying their events
  // when synchronize(Stream&) returns (Note [Drain] in copy_engine.h): it must
  // not return after a failure that only an event has seen.
  auto backend = make_fake_backend({});
  auto d2h = backend->create_stream(FakeControls::Role::kD2H);
  auto h2d = backend->create_stream(FakeControls::Role::kH2D);
  std::vector<char> a(64, 1), b(64, 0);
  backend->copy(b.data(), a.data(), a.size(), CopyKind::kDeviceToHost, *d2h);
  backend->synchronize(*d2h);  // clean so far
  backend->fake_controls()->fail_next_copies(1);
  backend->copy(b.data(), a.data(), a.size(), CopyKind::kDeviceToHost, *d2h);
  auto event = backend->create_event();
  backend->record(*event, *d2h);
  EXPECT_THROW(backend->synchronize(*event), TransferError);  // the event took the failure
  EXPECT_THROW(backend->synchronize(*d2h), TransferError);
  backend->copy(b.data(), a.data(), a.size(), CopyKind::kDeviceToHost, *d2h);
  EXPECT_THROW(backend->synchronize(*d2h), TransferError) << "a stream's failure is sticky";
  backend->synchronize(*h2d);  // another stream is not touched
}

TEST(FakeBackend, ArenaIsBoundedAndInjectedFailuresCount) {
  auto backend = make_fake_backend(FakeBackendOptions{.device_bytes = 1 << 20});
  DeviceAllocator& alloc = backend->default_allocator();
  void* p = alloc.allocate(1 << 19, nullptr);
  EXPECT_THROW(alloc.allocate(1 << 20, nullptr), OutOfMemory);
  backend->fake_controls()->fail_next_device_allocations(1);
  EXPECT_THROW(alloc.allocate(16, nullptr), OutOfMemory);
  void* q = alloc.allocate(16, nullptr);
  alloc.deallocate(q, 16, nullptr);
  alloc.deallocate(p, 1 << 19, nullptr);
  EXPECT_EQ(backend->fake_controls()->device_bytes_in_use(), 0u);
  backend->fake_controls()->fail_next_pinned_allocations(1);
  EXPECT_THROW(backend->allocate_pinned(16, -1, nullptr), OutOfMemory);
  void* h = backend->allocate_pinned(16, -1, nullptr);
  backend->free_pinned(h, 16);
}

TEST(FakeBackend, DeviceMemoryIsStreamOrderedLikeCudaMallocAsync) {
  auto backend = make_fake_backend({});
  auto fake = backend->fake_controls();
  StreamHandle compute = fake->create_compute_stream();
  StreamHandle other = fake->create_compute_stream();
  DeviceAllocator& alloc = backend->default_allocator();
  void* p = alloc.allocate(256, compute.native);
  fake->launch(compute, [p] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::memset(p, 7, 256);  // still ours: the free point is queued behind this kernel
  });
  alloc.deallocate(p, 256, compute.native);
  EXPECT_EQ(fake->device_bytes_in_use(), 0u);
  // Another stream may not have it until the compute stream passed the free.
  void* q = alloc.allocate(256, other.native);
  EXPECT_NE(q, p);
  // The same stream may: its next work runs after the free point.
  void* r = alloc.allocate(256, compute.native);
  EXPECT_EQ(r, p);
  alloc.deallocate(q, 256, other.native);
  alloc.deallocate(r, 256, compute.native);
  fake->synchronize(compute);
  fake->synchronize(other);
  EXPECT_EQ(fake->device_bytes_in_use(), 0u);
}

}  // namespace
}  // namespace spillway::runtime
