// Randomized schedules on the fake backend: a small "model" whose forward
// offloads its activations and whose backward reloads them with prefetch,
// while random delays hold up the compute stream, the D2H stream or the H2D
// stream. Every byte that comes back is checked by a kernel on the compute
// stream; released device memory is poisoned and reused by later
// allocations, so a missing wait shows up as wrong bytes (or a TSan/ASan
// report).

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <random>
#include <vector>

#include "runtime/fake_test_util.h"
#include "spillway/runtime.h"

namespace spillway {
namespace {

struct Schedule {
  std::uint64_t seed;
  int layers;
  int values_per_layer;
  int wait_lag;   // forward wait this many layers after the offload
  int prefetch;   // reloads started this many layers ahead in backward
  int steps;
};

std::size_t run_schedule(const Schedule& s) {
  std::mt19937_64 rng(s.seed);
  RuntimeOptions options;
  options.copy.chunk_bytes = std::size_t{64} * 1024;
  options.copy.max_inflight_bytes = std::size_t{128} * 1024;
  options.verify_before_release = rng() % 4 == 0;
  options.pool.class_bits = static_cast<int>(rng() % 5);
  Runtime rt(options);
  FakeControls& fake = *rt.fake_controls();
  StreamHandle compute = fake.create_compute_stream();
  // Delay one, two or all three streams.
  const int mask = 1 + static_cast<int>(rng() % 7);
  if (mask & 1) fake.set_delay(FakeControls::Role::kCompute, 0, 150, rng());
  if (mask & 2) fake.set_delay(FakeControls::Role::kD2H, 0, 150, rng());
  if (mask & 4) fake.set_delay(FakeControls::Role::kH2D, 0, 150, rng());

  auto bad = std::make_shared<std::atomic<std::size_t>>(0);
  std::uniform_int_distribution<std::size_t> size_dist(1, std::size_t{200} * 1024);
  for (int step = 0; step < s.steps; ++step) {
    struct Saved {
      DeviceValue value;
      HostHandle host;
      std::uint64_t seed;
      bool waited = false;
    };
    std::vector<std::vector<Saved>> layers(s.layers);
    // Forward.
    for (int l = 0; l < s.layers; ++l) {
      for (int k = 0; k < s.values_per_layer; ++k) {
        std::size_t bytes = size_dist(rng);
        std::uint64_t seed = rng();
        DeviceValue v = rt.allocate(bytes, compute);
        testing::launch_fill(fake, compute, v.data, bytes, seed);
        HostHandle h = rt.offload(v.storage, compute);
        // A later kernel of this layer still reads the value (keepalive).
        testing::launch_check(fake, compute, v.data, bytes, seed, bad);
        layers[l].push_back({v, h, seed});
      }
      int due = l - s.wait_lag;
      if (due >= 0) {
        for (Saved& saved : layers[due]) {
          rt.wait_offload(saved.host, saved.value.storage, compute);
          saved.waited = true;
        }
      }
      // Scratch work that reuses released device memory.
      std::size_t scratch_bytes = size_dist(rng);
      DeviceValue scratch = rt.allocate(scratch_bytes, compute);
      testing::launch_fill(fake, compute, scratch.data, scratch_bytes, rng());
      rt.release(scratch.storage, compute);
    }
    for (auto& layer : layers) {
      for (Saved& saved : layer) {
        if (!saved.waited) rt.wait_offload(saved.host, saved.value.storage, compute);
        saved.waited = true;
      }
    }
    // Backward: reload `prefetch` layers ahead, wait right before use.
    std::vector<std::vector<DeviceValue>> reloaded(s.layers);
    auto start_reload = [&](int l) {
      for (Saved& saved : layers[l]) {
        reloaded[l].push_back(rt.reload(saved.host, /*priority=*/l, compute));
      }
    };
    for (int l = s.layers - 1; l >= std::max(0, s.layers - 1 - s.prefetch); --l) start_reload(l);
    for (int l = s.layers - 1; l >= 0; --l) {
      int ahead = l - 1 - s.prefetch;
      if (ahead >= 0) start_reload(ahead);
      for (std::size_t k = 0; k < layers[l].size(); ++k) {
        const DeviceValue& r = reloaded[l][k];
        rt.wait_reload(r.storage, compute);
        testing::launch_check(fake, compute, r.data, r.bytes, layers[l][k].seed, bad);
        rt.release(r.storage, compute);
        rt.release_host(layers[l][k].host);
        rt.release(layers[l][k].value.storage, compute);
      }
    }
  }
  fake.synchronize(compute);
  rt.synchronize();
  PinnedPoolStats pool = rt.pool_stats();
  EXPECT_EQ(pool.bytes_live, 0u);
  return bad->load();
}

TEST(ResidencyRace, RandomSchedulesReturnEveryByte) {
  std::mt19937_64 rng(20261129);
  constexpr int kSchedules = 120;
  for (int i = 0; i < kSchedules; ++i) {
    Schedule s{rng(),
               2 + static_cast<int>(rng() % 4),
               1 + static_cast<int>(rng() % 3),
               static_cast<int>(rng() % 3),
               static_cast<int>(rng() % 3),
               1 + static_cast<int>(rng() % 2)};
    SCOPED_TRACE("schedule " + std::to_string(i) + " seed " + std::to_string(s.seed));
    ASSERT_EQ(run_schedule(s), 0u);
  }
}

// Several threads drive their own storages through one Runtime at once.
TEST(ResidencyRace, ConcurrentCallersOnOneRuntime) {
  RuntimeOptions options;
  options.copy.chunk_bytes = std::size_t{32} * 1024;
  options.copy.max_inflight_bytes = std::size_t{64} * 1024;
  Runtime rt(options);
  FakeControls& fake = *rt.fake_controls();
  fake.set_delay(FakeControls::Role::kD2H, 0, 100, 1);
  fake.set_delay(FakeControls::Role::kH2D, 0, 100, 2);
  auto bad = std::make_shared<std::atomic<std::size_t>>(0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    StreamHandle compute = fake.create_compute_stream();
    threads.emplace_back([&rt, &fake, compute, bad, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 25; ++i) {
        std::size_t bytes = 1 + rng() % (std::size_t{100} * 1024);
        std::uint64_t seed = rng();
        DeviceValue v = rt.allocate(bytes, compute);
        testing::launch_fill(fake, compute, v.data, bytes, seed);
        HostHandle h = rt.offload(v.storage, compute);
        rt.wait_offload(h, v.storage, compute);
        DeviceValue r = rt.reload(h, 0, compute);
        rt.wait_reload(r.storage, compute);
        testing::launch_check(fake, compute, r.data, bytes, seed, bad);
        rt.release(r.storage, compute);
        rt.release(v.storage, compute);
        rt.release_host(h);
      }
      fake.synchronize(compute);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad->load(), 0u);
}

}  // namespace
}  // namespace spillway
