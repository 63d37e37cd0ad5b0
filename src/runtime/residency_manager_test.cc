// The residency manager on the fake backend: every state transition, every
// misuse error, and faults that must lose nothing.

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <string>

#include "runtime/fake_test_util.h"
#include "spillway/error.h"
#include "spillway/runtime.h"

namespace spillway {
namespace {

using testing::count_mismatches;
using testing::launch_check;
using testing::launch_fill;

constexpr std::size_t kMiB = std::size_t{1} << 20;

class Residency : public ::testing::Test {
 protected:
  explicit Residency(RuntimeOptions options = small_chunks()) : rt_(options) {
    fake_ = rt_.fake_controls();
    compute_ = fake_->create_compute_stream();
  }
  static RuntimeOptions small_chunks() {
    RuntimeOptions o;
    o.copy.chunk_bytes = std::size_t{256} * 1024;
    o.copy.max_inflight_bytes = 1 * kMiB;
    return o;
  }

  // A device value holding the pattern of `seed`, written by a kernel.
  DeviceValue produce(std::size_t bytes, std::uint64_t seed) {
    DeviceValue v = rt_.allocate(bytes, compute_);
    launch_fill(*fake_, compute_, v.data, bytes, seed);
    return v;
  }
  // Mismatching bytes, read by a kernel after what compute waited for.
  std::size_t check(const DeviceValue& v, std::uint64_t seed) {
    auto bad = std::make_shared<std::atomic<std::size_t>>(0);
    launch_check(*fake_, compute_, v.data, v.bytes, seed, bad);
    fake_->synchronize(compute_);
    return bad->load();
  }
  static std::string message_of(const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no exception)";
  }

  Runtime rt_;
  FakeControls* fake_ = nullptr;
  StreamHandle compute_;
};

TEST_F(Residency, OffloadWaitReloadWaitWalksEveryState) {
  const std::size_t bytes = 3 * kMiB + 17;  // several chunks
  DeviceValue v = produce(bytes, 1);
  EXPECT_EQ(rt_.state(v.storage), StorageState::kResident);
  HostHandle h = rt_.offload(v.storage, compute_);
  EXPECT_EQ(h.source, v.storage);
  EXPECT_EQ(h.bytes, bytes);
  EXPECT_EQ(rt_.state(v.storage), StorageState::kOffloading);
  rt_.wait_offload(h, v.storage, compute_);
  EXPECT_EQ(rt_.state(v.storage), StorageState::kOnHost);
  fake_->synchronize(compute_);
  EXPECT_EQ(fake_->device_bytes_in_use(), 0u) << "device storage released at the forward wait";
  EXPECT_EQ(count_mismatches(h.data, bytes, 1), 0u);

  DeviceValue r = rt_.reload(h, 0, compute_);
  EXPECT_NE(r.storage, v.storage);
  EXPECT_EQ(rt_.state(r.storage), StorageState::kReloading);
  rt_.wait_reload(r.storage, compute_);
  EXPECT_EQ(rt_.state(r.storage), StorageState::kResident);
  EXPECT_EQ(check(r, 1), 0u);
  rt_.release(r.storage, compute_);
  rt_.release(v.storage, compute_);
  rt_.release_host(h);
  EXPECT_THROW(rt_.state(r.storage), StateError);
  fake_->synchronize(compute_);
  EXPECT_EQ(fake_->device_bytes_in_use(), 0u);
  PinnedPoolStats pool = rt_.pool_stats();
  EXPECT_EQ(pool.bytes_live, 0u);
}

TEST_F(Residency, AHostCopyCanBeReloadedTwice) {  // retain_graph / double backward
  DeviceValue v = produce(100000, 2);
  HostHandle h = rt_.offload(v.storage, compute_);
  rt_.wait_offload(h, v.storage, compute_);
  DeviceValue a = rt_.reload(h, 0, compute_);
  DeviceValue b = rt_.reload(h, 5, compute_);
  rt_.wait_reload(b.storage, compute_);
  rt_.wait_reload(a.storage, compute_);
  EXPECT_EQ(check(a, 2), 0u);
  EXPECT_EQ(check(b, 2), 0u);
}

TEST_F(Residency, AnExactHostCopyIsReloadedManyTimesAndFreedWhenDropped) {
  // Weights (Note [Exact blocks]): pinned at the copy's size rounded to a page, not its
  // size class, reloaded once per use, given back to the OS once dropped.
  const std::size_t bytes = 17 * kMiB + 1;
  DeviceValue v = produce(bytes, 3);
  HostHandle h = rt_.offload(v.storage, compute_, HostFit::kExact);
  rt_.wait_offload(h, v.storage, compute_);
  EXPECT_EQ(rt_.pool_stats().bytes_pinned, 17 * kMiB + 4096);
  for (int use = 0; use < 3; ++use) {
    DeviceValue r = rt_.reload(h, 0, compute_);
    rt_.wait_reload(r.storage, compute_);
    EXPECT_EQ(check(r, 3), 0u) << use;
    rt_.release(r.storage, compute_);
  }
  rt_.release_host(h);
  rt_.synchronize();
  rt_.trim_pool();
  PinnedPoolStats pool = rt_.pool_stats();
  EXPECT_EQ(pool.bytes_pinned, 0u);
  EXPECT_EQ(pool.pinned_frees, 1u);
}

TEST_F(Residency, ReloadBeforeTheForwardWaitStillSeesEveryByte) {
  fake_->set_delay(FakeControls::Role::kD2H, 1000, 2000, 4);
  DeviceValue v = produce(2 * kMiB, 3);
  HostHandle h = rt_.offload(v.storage, compute_);
  DeviceValue r = rt_.reload(h, 0, compute_);  // H2D waits for the D2H
  rt_.wait_reload(r.storage, compute_);
  EXPECT_EQ(check(r, 3), 0u);
  rt_.wait_offload(h, v.storage, compute_);
}

TEST_F(Residency, HostThreadComputeRunsKernelsSynchronously) {  // torch CPU mode
  DeviceValue v = rt_.allocate(5000, {});
  testing::fill_pattern(v.data, v.bytes, 6);
  HostHandle h = rt_.offload(v.storage, {});
  rt_.wait_offload(h, v.storage, {});
  DeviceValue r = rt_.reload(h, 0, {});
  rt_.wait_reload(r.storage, {});
  EXPECT_EQ(count_mismatches(r.data, r.bytes, 6), 0u);
}

TEST_F(Residency, AdoptedStorageIsReleasedOnceThroughItsReleaseFn) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  std::vector<char> memory(4096);
  testing::fill_pattern(memory.data(), memory.size(), 7);
  StorageId s = rt_.adopt(memory.data(), memory.size(),
                          [calls](void*, std::size_t bytes, void*) {
                            EXPECT_EQ(bytes, 4096u);
                            ++*calls;
                          });
  HostHandle h = rt_.offload(s, compute_);
  EXPECT_EQ(calls->load(), 0);
  rt_.wait_offload(h, s, compute_);
  EXPECT_EQ(calls->load(), 1);
  rt_.release(s, compute_);
  EXPECT_EQ(calls->load(), 1);
  std::vector<char> target(4096);
  auto into_calls = std::make_shared<std::atomic<int>>(0);
  DeviceValue r = rt_.reload_into(h, target.data(),
                                  [into_calls](void*, std::size_t, void*) { ++*into_calls; });
  rt_.wait_reload(r.storage, compute_);
  fake_->synchronize(compute_);
  EXPECT_EQ(count_mismatches(target.data(), target.size(), 7), 0u);
  rt_.release(r.storage, compute_);
  EXPECT_EQ(into_calls->load(), 1);
}

// --- misuse -------------------------------------------------------------

TEST_F(Residency, WaitWithNoOffloadInFlightIsAStateError) {
  DeviceValue v = produce(4096, 8);
  HostHandle h = rt_.offload(v.storage, compute_);
  rt_.wait_offload(h, v.storage, compute_);
  std::string what = message_of([&] { rt_.wait_offload(h, v.storage, compute_); });
  EXPECT_NE(what.find("[residency] wait on host copy"), std::string::npos) << what;
  EXPECT_NE(what.find("no offload in flight (storage is on_host)"), std::string::npos) << what;
  EXPECT_THROW(rt_.wait_offload(h, v.storage, compute_), StateError);
  EXPECT_EQ(rt_.state(v.storage), StorageState::kOnHost);
}

TEST_F(Residency, WaitReloadWithNoReloadInFlightIsAStateError) {
  DeviceValue v = produce(4096, 9);
  std::string what = message_of([&] { rt_.wait_reload(v.storage, compute_); });
  EXPECT_NE(what.find("no reload in flight (it is resident)"), std::string::npos) << what;
  EXPECT_THROW(rt_.wait_reload(v.storage, compute_), StateError);
  EXPECT_THROW(rt_.wait_reload(12345, compute_), StateError);
}

TEST_F(Residency, ReloadOfSomethingNeverOffloadedIsAStateError) {
  std::string what = message_of([&] { rt_.reload(HostHandle{}, 0, compute_); });
  EXPECT_NE(what.find("[residency] reload of host copy 0: nothing was offloaded to it"),
            std::string::npos)
      << what;
  EXPECT_THROW(rt_.reload(HostHandle{.id = 77}, 0, compute_), StateError);
  // Nor after its host copy was released.
  DeviceValue v = produce(4096, 10);
  HostHandle h = rt_.offload(v.storage, compute_);
  rt_.wait_offload(h, v.storage, compute_);
  rt_.release_host(h);
  EXPECT_THROW(rt_.reload(h, 0, compute_), StateError);
  EXPECT_THROW(rt_.release_host(h), StateError);
}

TEST_F(Residency, SecondOffloadOfAStorageIsAStateError) {
  DeviceValue v = produce(4096, 11);
  HostHandle h = rt_.offload(v.storage, compute_);
  std::string what = message_of([&] { rt_.offload(v.storage, compute_); });
  EXPECT_NE(what.find("second offload of storage"), std::string::npos) << what;
  EXPECT_NE(what.find("it is offloading"), std::string::npos) << what;
  rt_.wait_offload(h, v.storage, compute_);
  EXPECT_THROW(rt_.offload(v.storage, compute_), StateError);
  EXPECT_THROW(rt_.offload(999, compute_), StateError);
  EXPECT_EQ(rt_.pool_stats().bytes_requested, 4096u);
}

TEST_F(Residency, ReleaseWhileACopyIsInFlightIsAStateError) {
  fake_->set_delay(FakeControls::Role::kD2H, 2000, 2000, 1);
  fake_->set_delay(FakeControls::Role::kH2D, 2000, 2000, 1);
  DeviceValue v = produce(4096, 12);
  HostHandle h = rt_.offload(v.storage, compute_);
  std::string what = message_of([&] { rt_.release(v.storage, compute_); });
  EXPECT_NE(what.find("while its copy is in flight (offloading)"), std::string::npos) << what;
  EXPECT_THROW(rt_.release_host(h), StateError);
  rt_.wait_offload(h, v.storage, compute_);
  DeviceValue r = rt_.reload(h, 0, compute_);
  EXPECT_THROW(rt_.release(r.storage, compute_), StateError);
  rt_.wait_reload(r.storage, compute_);
  rt_.release(r.storage, compute_);
  rt_.release_host(h);  // stream-ordered: allowed once no D2H is pending into it
}

TEST_F(Residency, KeepaliveMustBeTheOffloadedStorage) {
  DeviceValue a = produce(4096, 13);
  DeviceValue b = produce(4096, 14);
  HostHandle h = rt_.offload(a.storage, compute_);
  std::string what = message_of([&] { rt_.wait_offload(h, b.storage, compute_); });
  EXPECT_NE(what.find("keepalive storage"), std::string::npos) << what;
  EXPECT_THROW(rt_.wait_offload(h, b.storage, compute_), InvalidArgument);
  EXPECT_EQ(rt_.state(a.storage), StorageState::kOffloading);
  rt_.wait_offload(h, a.storage, compute_);
}

// --- faults lose nothing ------------------------------------------------

class ResidencyWithBudget : public Residency {
 protected:
  ResidencyWithBudget() : Residency(options()) {}
  static RuntimeOptions options() {
    RuntimeOptions o = small_chunks();
    o.pool.host_budget_bytes = 1 * kMiB;
    return o;
  }
};

TEST_F(ResidencyWithBudget, HostBudgetExhaustedKeepsTheValueOnTheDevice) {
  DeviceValue a = produce(std::size_t{768} * 1024, 15);
  DeviceValue b = produce(std::size_t{768} * 1024, 16);
  HostHandle ha = rt_.offload(a.storage, compute_);
  std::string what = message_of([&] { rt_.offload(b.storage, compute_); });
  EXPECT_NE(what.find("[pinned_pool]"), std::string::npos) << what;
  EXPECT_THROW(rt_.offload(b.storage, compute_), OutOfMemory);
  EXPECT_EQ(rt_.state(b.storage), StorageState::kResident);
  EXPECT_EQ(check(b, 16), 0u);
  // Once the budget frees up, the same value offloads fine.
  rt_.wait_offload(ha, a.storage, compute_);
  rt_.release_host(ha);
  HostHandle hb = rt_.offload(b.storage, compute_);
  rt_.wait_offload(hb, b.storage, compute_);
  DeviceValue r = rt_.reload(hb, 0, compute_);
  rt_.wait_reload(r.storage, compute_);
  EXPECT_EQ(check(r, 16), 0u);
}

TEST_F(Residency, PinnedAllocationFailureKeepsTheValueOnTheDevice) {
  DeviceValue v = produce(300000, 17);
  fake_->fail_next_pinned_allocations(1);
  EXPECT_THROW(rt_.offload(v.storage, compute_), OutOfMemory);
  EXPECT_EQ(rt_.state(v.storage), StorageState::kResident);
  EXPECT_EQ(check(v, 17), 0u);
  HostHandle h = rt_.offload(v.storage, compute_);
  rt_.wait_offload(h, v.storage, compute_);
  EXPECT_EQ(rt_.state(v.storage), StorageState::kOnHost);
}

TEST_F(Residency, DeviceAllocationFailureOnReloadKeepsTheHostCopy) {
  DeviceValue v = produce(300000, 18);
  HostHandle h = rt_.offload(v.storage, compute_);
  rt_.wait_offload(h, v.storage, compute_);
  fake_->fail_next_device_allocations(1);
  EXPECT_THROW(rt_.reload(h, 0, compute_), OutOfMemory);
  DeviceValue r = rt_.reload(h, 0, compute_);
  rt_.wait_reload(r.storage, compute_);
  EXPECT_EQ(check(r, 18), 0u);
}

class ResidencyVerified : public Residency {
 protected:
  ResidencyVerified() : Residency(options()) {}
  static RuntimeOptions options() {
    RuntimeOptions o = small_chunks();
    o.verify_before_release = true;
    return o;
  }
};

TEST_F(ResidencyVerified, FailedOffloadCopyRaisesAtTheWaitAndKeepsTheDeviceValue) {
  DeviceValue v = produce(1 * kMiB, 19);
  fake_->fail_next_copies(1);
  HostHandle h = rt_.offload(v.storage, compute_);
  std::string what = message_of([&] { rt_.wait_offload(h, v.storage, compute_); });
  EXPECT_NE(what.find("[residency] offload of storage"), std::string::npos) << what;
  EXPECT_NE(what.find("it stays on the device"), std::string::npos) << what;
  EXPECT_EQ(rt_.state(v.storage), StorageState::kResident);
  EXPECT_EQ(check(v, 19), 0u);
  EXPECT_THROW(rt_.reload(h, 0, compute_), StateError);  // the host copy is gone
  HostHandle again = rt_.offload(v.storage, compute_);
  rt_.wait_offload(again, v.storage, compute_);
  DeviceValue r = rt_.reload(again, 0, compute_);
  rt_.wait_reload(r.storage, compute_);
  EXPECT_EQ(check(r, 19), 0u);
}

TEST_F(ResidencyVerified, FailedReloadCopyRaisesAtItsWaitAndTheHostCopySurvives) {
  DeviceValue v = produce(1 * kMiB, 40);
  HostHandle h = rt_.offload(v.storage, compute_);
  rt_.wait_offload(h, v.storage, compute_);
  rt_.synchronize();
  fake_->fail_next_copies(1);
  DeviceValue bad = rt_.reload(h, 0, compute_);
  std::string what = message_of([&] { rt_.wait_reload(bad.storage, compute_); });
  EXPECT_NE(what.find("[residency] reload into storage"), std::string::npos) << what;
  rt_.release(bad.storage, compute_);
  DeviceValue good = rt_.reload(h, 0, compute_);
  rt_.wait_reload(good.storage, compute_);
  EXPECT_EQ(check(good, 40), 0u);
}

TEST_F(Residency, OffloadCopyFailingAfterItsWaitIsRaisedOnceByTheNextCall) {
  // The D2H cannot run before compute passes the gate, so it fails only after
  // wait_offload returned: the wait succeeds (it cannot know), and the next
  // synchronize() raises the failure exactly once.
  auto gate = std::make_shared<std::promise<void>>();
  std::shared_future<void> open = gate->get_future().share();
  DeviceValue v = produce(600000, 41);
  fake_->launch(compute_, [open] { open.wait(); });
  fake_->fail_next_copies(1);
  HostHandle h = rt_.offload(v.storage, compute_);
  EXPECT_NO_THROW(rt_.wait_offload(h, v.storage, compute_));
  EXPECT_EQ(rt_.state(v.storage), StorageState::kOnHost);
  gate->set_value();
  std::string what = message_of([&] { rt_.synchronize(); });
  EXPECT_NE(what.find("an earlier copy failed after its own wait"), std::string::npos) << what;
  EXPECT_NE(what.find("device-to-host copy of 600000 bytes failed"), std::string::npos) << what;
  EXPECT_NO_THROW(rt_.synchronize());
  rt_.release_host(h);
  rt_.release(v.storage, compute_);
}

TEST_F(Residency, FailedOffloadCopyIsReportedExactlyOnce) {
  // Without verify_before_release the failure may be known at the forward wait
  // or only later; either way exactly one TransferError surfaces.
  for (int round = 0; round < 20; ++round) {
    fake_->set_delay(FakeControls::Role::kD2H, 0, 300, round);
    const std::uint64_t seed = 20 + round;
    DeviceValue v = produce(600000, seed);
    fake_->fail_next_copies(1);
    HostHandle h = rt_.offload(v.storage, compute_);
    int raised = 0;
    try {
      rt_.wait_offload(h, v.storage, compute_);
    } catch (const TransferError&) {
      ++raised;
      EXPECT_EQ(rt_.state(v.storage), StorageState::kResident);
      EXPECT_EQ(check(v, seed), 0u) << "a failed offload must leave the value intact";
      rt_.release(v.storage, compute_);
    }
    if (raised == 0) {
      try {
        DeviceValue r = rt_.reload(h, 0, compute_);
        try {
          rt_.wait_reload(r.storage, compute_);
        } catch (const TransferError&) {
          ++raised;
        }
        rt_.release(r.storage, compute_);
      } catch (const TransferError&) {
        ++raised;
      }
      try {
        rt_.synchronize();
      } catch (const TransferError&) {
        ++raised;
      }
      rt_.release_host(h);
    }
    EXPECT_EQ(raised, 1) << "round " << round;
    rt_.synchronize();  // nothing left to report
  }
}

TEST(RuntimeOptionsTest, CudaBackendAbsentFromThisBuildIsAClearError) {
  if (Runtime::cuda_available()) GTEST_SKIP() << "this build has the CUDA backend";
  RuntimeOptions o;
  o.backend = BackendKind::kCuda;
  try {
    Runtime rt(o);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA backend"), std::string::npos);
  }
}

}  // namespace
}  // namespace spillway
