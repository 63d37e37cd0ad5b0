// CPU-side costs of the runtime on the fake backend (Google Benchmark; the
// copy engine's are in copy_engine_bench.cc):
//   * one pinned-pool allocate/release in steady state;
//   * one step of BENCHMARKS.md T1's saved activations (16 layers x 15
//     tensors: 8 x 64 MiB, 4 x 176 MiB, 1 MiB, 2 x 64 KiB per layer) through
//     the pool, with the figures of a 1,000-step loop as counters: pinned
//     allocations after the first step, pinned bytes / peak live bytes;
//   * one offload / wait / reload / wait / release cycle of a small value on
//     the host-thread compute stream (the bookkeeping, not the copy).
// The fake backend's pinned memory is address space only here
// (unbacked_pinned), so the T1 sizes cost no RAM.

#include <benchmark/benchmark.h>

#include <vector>

#include "runtime/backend/backend.h"
#include "runtime/pinned_pool.h"
#include "spillway/runtime.h"

namespace spillway {
namespace {

using runtime::PinnedBlock;
using runtime::PinnedPool;

std::vector<std::size_t> t1_layer_activation_bytes() {
  const std::size_t tokens = 4 * 4096;
  const std::size_t hidden = tokens * 2048 * 2;  // 64 MiB
  const std::size_t mlp = tokens * 5632 * 2;     // 176 MiB
  const std::size_t rstd = tokens * 4;           // 64 KiB
  const std::size_t lse = 4 * 16 * 4096 * 4;     // 1 MiB
  return {hidden, rstd, hidden, hidden, hidden, hidden, hidden, lse,
          hidden, rstd, hidden, mlp,    mlp,    mlp,    mlp};
}

void BM_PoolAllocateRelease(benchmark::State& state) {
  auto backend = runtime::make_fake_backend(FakeBackendOptions{.unbacked_pinned = true});
  PinnedPool pool(*backend, {});
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  pool.release(pool.allocate(bytes), {});
  for (auto _ : state) {
    PinnedBlock b = pool.allocate(bytes);
    benchmark::DoNotOptimize(b.data);
    pool.release(b, {});
  }
  state.counters["pinned_allocations"] =
      static_cast<double>(pool.stats().pinned_allocations);
}
BENCHMARK(BM_PoolAllocateRelease)->Arg(64 << 10)->Arg(64 << 20)->Arg(176 << 20);

void BM_PoolT1Step(benchmark::State& state) {
  auto backend = runtime::make_fake_backend(FakeBackendOptions{.unbacked_pinned = true});
  PinnedPool pool(*backend, {});
  auto d2h = backend->create_stream(FakeControls::Role::kD2H);
  auto h2d = backend->create_stream(FakeControls::Role::kH2D);
  const auto layer = t1_layer_activation_bytes();
  std::uint64_t after_first = 0;
  int steps = 0;
  auto step = [&] {
    std::vector<PinnedBlock> saved;
    saved.reserve(16 * layer.size());
    for (int l = 0; l < 16; ++l) {
      for (std::size_t bytes : layer) saved.push_back(pool.allocate(bytes));
    }
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      pool.release(*it, {d2h.get(), h2d.get()});
    }
    if (steps++ == 0) after_first = pool.stats().pinned_allocations;
  };
  for (auto _ : state) step();
  while (steps < 1000) step();  // the figures are those of >= 1,000 steps
  PinnedPoolStats s = pool.stats();
  state.counters["steps"] = steps;
  state.counters["pinned_allocs_step1"] = static_cast<double>(after_first);
  state.counters["pinned_allocs_after_step1"] =
      static_cast<double>(s.pinned_allocations - after_first);
  state.counters["pinned_GiB"] = static_cast<double>(s.bytes_pinned) / (1 << 30);
  state.counters["peak_live_GiB"] = static_cast<double>(s.peak_bytes_requested) / (1 << 30);
  state.counters["pinned_over_peak_live"] =
      static_cast<double>(s.bytes_pinned) / static_cast<double>(s.peak_bytes_requested);
  state.counters["tensors_per_step"] = static_cast<double>(16 * layer.size());
}
BENCHMARK(BM_PoolT1Step)->Unit(benchmark::kMicrosecond);

void BM_ResidencyCycle(benchmark::State& state) {
  Runtime rt(RuntimeOptions{});
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    DeviceValue v = rt.allocate(bytes);
    HostHandle h = rt.offload(v.storage);
    rt.wait_offload(h, v.storage);
    DeviceValue r = rt.reload(h);
    rt.wait_reload(r.storage);
    rt.release(r.storage);
    rt.release(v.storage);
    rt.release_host(h);
  }
}
BENCHMARK(BM_ResidencyCycle)->Arg(4096)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace spillway

BENCHMARK_MAIN();
