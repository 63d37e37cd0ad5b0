// The copy engine's host cost per transfer on the fake backend (Google
// Benchmark): one batch of bench/gpu/copy_bandwidth.cc's engine rows, 1024
// transfers per direction submitted at once, every one waited for with
// wait_enqueued oldest first, then drain(); the wall clock covers all of it.
// Args: transfer bytes, directions (1: device-to-host only, 2: both at once).
// At 4 KiB the fake streams' memcpy is negligible and the figure is the
// engine's dispatch path; at 1 MiB it is the memcpy on two cores plus it.
// BM_CopyEngineDrain times drain() alone, after such a batch has run: the
// host cost that ends a batch once its copies are done (Note [Drain] in
// copy_engine.h), per transfer.
//   build/release/bench/runtime/spillway_bench_runtime --benchmark_filter=CopyEngine

#include <benchmark/benchmark.h>

#include <chrono>
#include <vector>

#include "runtime/backend/backend.h"
#include "runtime/copy_engine.h"
#include "spillway/runtime.h"

namespace spillway {
namespace {

using runtime::CopyEngine;
using runtime::CopyKind;
using runtime::TransferPtr;

constexpr int kTransfersPerDirection = 1024;
// Transfers cycle through buffers of this size, as copy_bandwidth's do
// through theirs; one stream's copies into one buffer run in order.
constexpr std::size_t kBufferBytes = std::size_t{64} << 20;

// A batch's source and destination buffers: device and host both played by CPU memory.
struct Buffers {
  std::vector<char> device_src = std::vector<char>(kBufferBytes, 1);
  std::vector<char> host_dst = std::vector<char>(kBufferBytes);
  std::vector<char> host_src = std::vector<char>(kBufferBytes, 2);
  std::vector<char> device_dst = std::vector<char>(kBufferBytes);
};

// An engine on the fake backend with a batch's buffers.
struct Rig {
  std::unique_ptr<runtime::Backend> backend = runtime::make_fake_backend({});
  CopyEngine engine{*backend, CopyEngineOptions{}};
  Buffers buffers;
  std::vector<TransferPtr> transfers;

  Rig() { transfers.reserve(2 * kTransfersPerDirection); }
  void submit_batch(std::size_t bytes, bool both);
};

// Submits kTransfersPerDirection transfers of `bytes` D2H (and as many H2D when
// `both`), then waits until all of them are enqueued.
void Rig::submit_batch(std::size_t bytes, bool both) {
  Buffers& b = buffers;
  for (int i = 0; i < kTransfersPerDirection; ++i) {
    const std::size_t at = i * bytes % (kBufferBytes - bytes + 1) / bytes * bytes;
    transfers.push_back(engine.submit(CopyKind::kDeviceToHost, b.host_dst.data() + at,
                                      b.device_src.data() + at, bytes, 0, {}));
    if (both) {
      transfers.push_back(engine.submit(CopyKind::kHostToDevice, b.device_dst.data() + at,
                                        b.host_src.data() + at, bytes, 0, {}));
    }
  }
  for (const TransferPtr& t : transfers) engine.wait_enqueued(t);
}

void BM_CopyEngineBatch(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const bool both = state.range(1) == 2;
  Rig rig;
  for (auto _ : state) {
    rig.submit_batch(bytes, both);
    rig.engine.drain();
    rig.transfers.clear();
  }
  const double per_batch = kTransfersPerDirection * (both ? 2.0 : 1.0);
  state.counters["transfers_per_s"] =
      benchmark::Counter(per_batch * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * per_batch * bytes));
}
BENCHMARK(BM_CopyEngineBatch)
    ->ArgNames({"bytes", "directions"})
    ->ArgsProduct({{4 << 10, 1 << 20}, {1, 2}})
    ->UseRealTime()
    ->MeasureProcessCPUTime()
    ->Unit(benchmark::kMillisecond);

void BM_CopyEngineDrain(benchmark::State& state) {
  constexpr std::size_t kBytes = 4 << 10;
  const bool both = state.range(0) == 2;
  Rig rig;
  for (auto _ : state) {
    rig.submit_batch(kBytes, both);
    // Every copy has run: what drain() costs now is its own host work.
    rig.backend->synchronize(rig.engine.stream(CopyKind::kDeviceToHost));
    rig.backend->synchronize(rig.engine.stream(CopyKind::kHostToDevice));
    const auto start = std::chrono::steady_clock::now();
    rig.engine.drain();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    rig.transfers.clear();
  }
  const double per_batch = kTransfersPerDirection * (both ? 2.0 : 1.0);
  state.counters["drain_ns_per_transfer"] = benchmark::Counter(
      per_batch * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_CopyEngineDrain)
    ->ArgNames({"directions"})
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace spillway
