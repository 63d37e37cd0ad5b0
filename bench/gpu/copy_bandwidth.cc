// GPU benchmark of the runtime's copy engine and pinned pool (run on the H200
// through scripts/device-check).
//
// Part 1, the link: achieved GB/s of batches of transfers of 1, 4, 64 and
// 1024 MiB, device-to-host, host-to-device and both at once, through the copy
// engine and through raw cudaMemcpyAsync on two plain streams, in the same
// run. Pinned host memory; each configuration warmed up once, then timed
// `repeats` times with CUDA events on the copy streams; the median is kept.
// A batch is max(2, 256 MiB / size) transfers (so small sizes measure a
// stream of transfers, as offload produces, not one launch).
//
// Part 2, the pool: the attention-scope activations of BENCHMARKS.md T1 (16
// layers x {q, k, v, attention output: 64 MiB each; logsumexp: 1 MiB}) go
// through the pinned pool for 1,000 steps with events on the real copy
// streams, then through the whole Runtime (offload, wait, reload, wait, real
// copies) for a few steps. Reported: pinned allocations after the first step
// and pinned bytes over peak live bytes.
//
// Usage: spillway_bench_gpu [--repeats N] [--max-mib M] [--pool-steps N]
//                           [--runtime-steps N] [--json PATH]

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/backend/backend.h"
#include "runtime/backend/cuda/cuda_check.h"
#include "runtime/copy_engine.h"
#include "runtime/pinned_pool.h"
#include "spillway/runtime.h"

namespace spillway::bench {
namespace {

using runtime::CopyEngine;
using runtime::CopyKind;
using runtime::TransferPtr;

constexpr std::size_t kMiB = std::size_t{1} << 20;

struct Args {
  int repeats = 7;
  std::size_t max_mib = 1024;
  int pool_steps = 1000;
  int runtime_steps = 5;
  std::string json;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--repeats") a.repeats = std::stoi(next());
    else if (k == "--max-mib") a.max_mib = std::stoull(next());
    else if (k == "--pool-steps") a.pool_steps = std::stoi(next());
    else if (k == "--runtime-steps") a.runtime_steps = std::stoi(next());
    else if (k == "--json") a.json = next();
    else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Buffers {
  void* device[2] = {};  // [0] D2H source, [1] H2D destination
  void* host[2] = {};    // [0] D2H destination, [1] H2D source
  std::size_t bytes = 0;
};

class Timer {
 public:
  Timer() {
    SPILLWAY_CUDA_CHECK(cudaEventCreate(&start_));
    for (auto& e : stop_) SPILLWAY_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    for (auto& e : stop_) cudaEventDestroy(e);
  }
  // Starts on `a`; `b` (if any) waits for the start.
  void start(cudaStream_t a, cudaStream_t b) {
    SPILLWAY_CUDA_CHECK(cudaEventRecord(start_, a));
    if (b) SPILLWAY_CUDA_CHECK(cudaStreamWaitEvent(b, start_, 0));
  }
  void stop(int i, cudaStream_t s) { SPILLWAY_CUDA_CHECK(cudaEventRecord(stop_[i], s)); }
  // Milliseconds from start to the later of the stops used.
  double elapsed_ms(int stops) {
    double ms = 0;
    for (int i = 0; i < stops; ++i) {
      SPILLWAY_CUDA_CHECK(cudaEventSynchronize(stop_[i]));
      float t = 0;
      SPILLWAY_CUDA_CHECK(cudaEventElapsedTime(&t, start_, stop_[i]));
      ms = std::max(ms, static_cast<double>(t));
    }
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_[2] = {};
};

enum class Mode { kD2H, kH2D, kBoth };
const char* mode_name(Mode m) {
  return m == Mode::kD2H ? "D2H" : m == Mode::kH2D ? "H2D" : "both";
}

char* offset(void* base, std::size_t i, std::size_t size, std::size_t total) {
  return static_cast<char*>(base) + (i * size) % (total - size + 1) / size * size;
}

// One timed batch of raw cudaMemcpyAsync; returns GB/s (1e9 bytes/s).
double raw_batch(Mode mode, std::size_t size, int count, const Buffers& b, cudaStream_t s[2],
                 Timer& timer) {
  timer.start(s[0], mode == Mode::kBoth ? s[1] : nullptr);
  for (int i = 0; i < count; ++i) {
    if (mode != Mode::kH2D) {
      SPILLWAY_CUDA_CHECK(cudaMemcpyAsync(offset(b.host[0], i, size, b.bytes),
                                          offset(b.device[0], i, size, b.bytes), size,
                                          cudaMemcpyDeviceToHost, s[0]));
    }
    if (mode != Mode::kD2H) {
      cudaStream_t h2d = mode == Mode::kH2D ? s[0] : s[1];
      SPILLWAY_CUDA_CHECK(cudaMemcpyAsync(offset(b.device[1], i, size, b.bytes),
                                          offset(b.host[1], i, size, b.bytes), size,
                                          cudaMemcpyHostToDevice, h2d));
    }
  }
  timer.stop(0, s[0]);
  if (mode == Mode::kBoth) timer.stop(1, s[1]);
  double ms = timer.elapsed_ms(mode == Mode::kBoth ? 2 : 1);
  double bytes = static_cast<double>(size) * count * (mode == Mode::kBoth ? 2 : 1);
  return bytes / (ms * 1e-3) / 1e9;
}

// One timed batch through the copy engine; returns GB/s.
double engine_batch(Mode mode, std::size_t size, int count, const Buffers& b, CopyEngine& engine,
                    Timer& timer) {
  auto d2h = static_cast<cudaStream_t>(engine.stream(CopyKind::kDeviceToHost).native());
  auto h2d = static_cast<cudaStream_t>(engine.stream(CopyKind::kHostToDevice).native());
  cudaStream_t first = mode == Mode::kH2D ? h2d : d2h;
  timer.start(first, mode == Mode::kBoth ? h2d : nullptr);
  TransferPtr last_d2h, last_h2d;
  for (int i = 0; i < count; ++i) {
    if (mode != Mode::kH2D) {
      last_d2h = engine.submit(CopyKind::kDeviceToHost, offset(b.host[0], i, size, b.bytes),
                               offset(b.device[0], i, size, b.bytes), size, 0, {});
    }
    if (mode != Mode::kD2H) {
      last_h2d = engine.submit(CopyKind::kHostToDevice, offset(b.device[1], i, size, b.bytes),
                               offset(b.host[1], i, size, b.bytes), size, 0, {});
    }
  }
  int stops = 0;
  if (last_d2h) {
    engine.wait_enqueued(last_d2h);
    timer.stop(stops++, d2h);
  }
  if (last_h2d) {
    engine.wait_enqueued(last_h2d);
    timer.stop(stops++, h2d);
  }
  double ms = timer.elapsed_ms(stops);
  engine.drain();
  double bytes = static_cast<double>(size) * count * (mode == Mode::kBoth ? 2 : 1);
  return bytes / (ms * 1e-3) / 1e9;
}

struct Row {
  std::size_t mib;
  Mode mode;
  double raw;
  double engine;
};

std::vector<Row> bench_link(const Args& args) {
  auto backend = runtime::make_cuda_backend(0);
  CopyEngine engine(*backend, CopyEngineOptions{});
  Buffers b;
  b.bytes = std::max<std::size_t>(args.max_mib, 256) * kMiB;
  for (int i = 0; i < 2; ++i) {
    SPILLWAY_CUDA_CHECK(cudaMalloc(&b.device[i], b.bytes));
    SPILLWAY_CUDA_CHECK(cudaHostAlloc(&b.host[i], b.bytes, cudaHostAllocDefault));
    SPILLWAY_CUDA_CHECK(cudaMemset(b.device[i], 0x5A + i, b.bytes));
    std::memset(b.host[i], 0xA5 + i, b.bytes);
  }
  cudaStream_t raw[2];
  for (auto& s : raw) SPILLWAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Timer timer;
  std::vector<Row> rows;
  for (std::size_t mib : {std::size_t{1}, std::size_t{4}, std::size_t{64}, std::size_t{1024}}) {
    if (mib > args.max_mib) continue;
    const std::size_t size = mib * kMiB;
    const int count = static_cast<int>(std::max<std::size_t>(2, 256 / mib));
    for (Mode mode : {Mode::kD2H, Mode::kH2D, Mode::kBoth}) {
      std::vector<double> raw_gbs, engine_gbs;
      raw_batch(mode, size, count, b, raw, timer);  // warm-up
      engine_batch(mode, size, count, b, engine, timer);
      for (int r = 0; r < args.repeats; ++r) {  // interleaved, so drift hits both
        raw_gbs.push_back(raw_batch(mode, size, count, b, raw, timer));
        engine_gbs.push_back(engine_batch(mode, size, count, b, engine, timer));
      }
      rows.push_back({mib, mode, median(raw_gbs), median(engine_gbs)});
      std::printf("  %5zu MiB %-4s x%-3d raw %6.1f GB/s  engine %6.1f GB/s  (%.1f %%)\n", mib,
                  mode_name(mode), count, rows.back().raw, rows.back().engine,
                  100.0 * rows.back().engine / rows.back().raw);
      std::fflush(stdout);
    }
  }
  for (auto& s : raw) SPILLWAY_CUDA_CHECK(cudaStreamDestroy(s));
  for (int i = 0; i < 2; ++i) {
    SPILLWAY_CUDA_CHECK(cudaFree(b.device[i]));
    SPILLWAY_CUDA_CHECK(cudaFreeHost(b.host[i]));
  }
  return rows;
}

// The attention-scope saved activations of one T1 layer.
std::vector<std::size_t> t1_attention_activations() {
  const std::size_t hidden = std::size_t{4} * 4096 * 2048 * 2;  // 64 MiB, bf16
  const std::size_t lse = std::size_t{4} * 16 * 4096 * 4;        // 1 MiB, fp32
  return {hidden, hidden, hidden, hidden, lse};                  // q, k, v, out, lse
}

struct PoolFigures {
  int steps = 0;
  std::uint64_t allocations_first_step = 0;
  std::uint64_t allocations_total = 0;
  std::uint64_t reuses = 0;
  double pinned_gib = 0;
  double peak_live_gib = 0;
  double seconds = 0;
};

PoolFigures pool_loop(int steps) {
  auto backend = runtime::make_cuda_backend(0);
  runtime::PinnedPool pool(*backend, PinnedPoolOptions{});
  auto d2h = backend->create_stream(FakeControls::Role::kD2H);
  auto h2d = backend->create_stream(FakeControls::Role::kH2D);
  const auto layer = t1_attention_activations();
  PoolFigures f;
  f.steps = steps;
  auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    std::vector<runtime::PinnedBlock> saved;
    for (int l = 0; l < 16; ++l) {
      for (std::size_t bytes : layer) saved.push_back(pool.allocate(bytes));
    }
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      pool.release(*it, {d2h.get(), h2d.get()});
    }
    if (step == 0) f.allocations_first_step = pool.stats().pinned_allocations;
  }
  f.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  PinnedPoolStats s = pool.stats();
  f.allocations_total = s.pinned_allocations;
  f.reuses = s.reuses;
  f.pinned_gib = static_cast<double>(s.bytes_pinned) / (1 << 30);
  f.peak_live_gib = static_cast<double>(s.peak_bytes_requested) / (1 << 30);
  return f;
}

// The whole runtime with real copies: offload during "forward", release at
// the wait, reload with one layer of prefetch during "backward".
PoolFigures runtime_loop(int steps) {
  cudaStream_t compute;
  SPILLWAY_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  RuntimeOptions options;
  options.backend = BackendKind::kCuda;
  options.compute_stream = compute;
  PoolFigures f;
  f.steps = steps;
  {
    Runtime rt(options);
    const auto layer = t1_attention_activations();
    auto t0 = std::chrono::steady_clock::now();
    for (int step = 0; step < steps; ++step) {
      std::vector<std::vector<HostHandle>> hosts(16);
      for (int l = 0; l < 16; ++l) {
        for (std::size_t bytes : layer) {
          DeviceValue v = rt.allocate(bytes);
          SPILLWAY_CUDA_CHECK(cudaMemsetAsync(v.data, l, bytes, compute));
          HostHandle h = rt.offload(v.storage);
          rt.wait_offload(h, v.storage);
          rt.release(v.storage);
          hosts[l].push_back(h);
        }
      }
      for (int l = 15; l >= 0; --l) {
        for (const HostHandle& h : hosts[l]) {
          DeviceValue r = rt.reload(h, l);
          rt.wait_reload(r.storage);
          rt.release(r.storage);
          rt.release_host(h);
        }
      }
      if (step == 0) {
        SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(compute));
        f.allocations_first_step = rt.pool_stats().pinned_allocations;
      }
    }
    rt.synchronize();
    SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(compute));
    f.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    PinnedPoolStats s = rt.pool_stats();
    f.allocations_total = s.pinned_allocations;
    f.reuses = s.reuses;
    f.pinned_gib = static_cast<double>(s.bytes_pinned) / (1 << 30);
    f.peak_live_gib = static_cast<double>(s.peak_bytes_requested) / (1 << 30);
  }
  SPILLWAY_CUDA_CHECK(cudaStreamDestroy(compute));
  return f;
}

void print_pool(const char* name, const PoolFigures& f) {
  std::printf(
      "  %-8s %4d steps: pinned allocations %llu in step 1, %llu after; reuses %llu; "
      "pinned %.2f GiB / peak live %.2f GiB = %.3f; %.2f s\n",
      name, f.steps, static_cast<unsigned long long>(f.allocations_first_step),
      static_cast<unsigned long long>(f.allocations_total - f.allocations_first_step),
      static_cast<unsigned long long>(f.reuses), f.pinned_gib, f.peak_live_gib,
      f.peak_live_gib > 0 ? f.pinned_gib / f.peak_live_gib : 0.0, f.seconds);
}

void write_json(const std::string& path, const std::vector<Row>& rows, const PoolFigures& pool,
                const PoolFigures& rt, const Args& args) {
  FILE* out = std::fopen(path.c_str(), "w");
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  cudaDeviceProp prop{};
  SPILLWAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::fprintf(out, "{\n  \"device\": \"%s\",\n  \"repeats\": %d,\n  \"link\": [\n", prop.name,
               args.repeats);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::fprintf(out,
                 "    {\"mib\": %zu, \"direction\": \"%s\", \"raw_gbs\": %.2f, "
                 "\"engine_gbs\": %.2f}%s\n",
                 rows[i].mib, mode_name(rows[i].mode), rows[i].raw, rows[i].engine,
                 i + 1 < rows.size() ? "," : "");
  }
  auto pool_json = [&](const PoolFigures& f) {
    std::fprintf(out,
                 "{\"steps\": %d, \"pinned_allocations_first_step\": %llu, "
                 "\"pinned_allocations_after_first_step\": %llu, \"reuses\": %llu, "
                 "\"pinned_gib\": %.4f, \"peak_live_gib\": %.4f, \"seconds\": %.3f}",
                 f.steps, static_cast<unsigned long long>(f.allocations_first_step),
                 static_cast<unsigned long long>(f.allocations_total - f.allocations_first_step),
                 static_cast<unsigned long long>(f.reuses), f.pinned_gib, f.peak_live_gib,
                 f.seconds);
  };
  std::fprintf(out, "  ],\n  \"pool_loop\": ");
  pool_json(pool);
  std::fprintf(out, ",\n  \"runtime_loop\": ");
  pool_json(rt);
  std::fprintf(out, "\n}\n");
  std::fclose(out);
}

int run(int argc, char** argv) {
  Args args = parse(argc, argv);
  cudaDeviceProp prop{};
  SPILLWAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("[bench_gpu] %s; batches of max(2, 256 MiB/size) transfers, median of %d\n",
              prop.name, args.repeats);
  std::vector<Row> rows = bench_link(args);
  PoolFigures pool = pool_loop(args.pool_steps);
  print_pool("pool", pool);
  PoolFigures rt = runtime_loop(args.runtime_steps);
  print_pool("runtime", rt);
  if (!args.json.empty()) write_json(args.json, rows, pool, rt, args);

  // The summary table, last.
  std::printf("\n%-6s %-5s %10s %10s %8s\n", "MiB", "dir", "raw GB/s", "engine", "engine%");
  double one_way = 0, both = 0;
  for (const Row& r : rows) {
    std::printf("%-6zu %-5s %10.1f %10.1f %7.1f%%\n", r.mib, mode_name(r.mode), r.raw, r.engine,
                100.0 * r.engine / r.raw);
    if (r.mib == 64 && r.mode != Mode::kBoth) one_way = std::max(one_way, r.engine);
    if (r.mib == 64 && r.mode == Mode::kBoth) both = r.engine;
  }
  if (one_way > 0) std::printf("both/one-way at 64 MiB (engine): %.2fx\n", both / one_way);
  std::printf("pool 1000-step: %llu pinned allocations after step 1, pinned/peak-live %.3f\n",
              static_cast<unsigned long long>(pool.allocations_total -
                                              pool.allocations_first_step),
              pool.peak_live_gib > 0 ? pool.pinned_gib / pool.peak_live_gib : 0.0);
  return 0;
}

}  // namespace
}  // namespace spillway::bench

int main(int argc, char** argv) {
  try {
    return spillway::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[bench_gpu] failed: %s\n", e.what());
    return 1;
  }
}
