// GPU benchmark of the runtime's copy engine and pinned pool (run on the H200
// through scripts/device-check).
//
// Part 1, the link: achieved GB/s of batches of 1, 4, 64 and 1024 MiB
// transfers, device-to-host, host-to-device and both at once, through the
// copy engine and through raw cudaMemcpyAsync on two plain streams, in the
// same run, interleaved. Pinned host memory. A batch is max(2, batch / size)
// transfers (batch = 1 GiB per direction by default), so launch costs are
// noise and small sizes measure a stream of transfers, as offload produces.
//
// How a batch is timed (the same for raw and engine): host wall clock
// (steady_clock) from just before the first submit to just after a full
// synchronize of every stream that did work (raw: cudaStreamSynchronize of
// both streams; engine: CopyEngine::drain, which waits until nothing is
// pending and then synchronizes both copy streams). CUDA events are recorded
// too, as a cross-check: start before the first copy, stop on each stream
// once every copy of the batch is on it (engine: after wait_enqueued of every
// transfer, in submission order). Each configuration is warmed up once and
// timed `repeats` times; the median is kept.
//
// Where the wall time goes: each batch also notes, on the same clock from the
// same start, when its three host phases ended: `submitted` (the loop of
// cudaMemcpyAsync / CopyEngine::submit), `enqueued` (raw: the stop events
// recorded, right after; engine: the wait_enqueued loop and its stop events)
// and `synchronized` (= the wall time: both cudaStreamSynchronize / drain).
// Medians of each, and of wall minus events (the host time on either side of
// the copies), go into the JSON; the per-row lines print them in ms.
//
// Every batch is verified (bench/gpu/link_check.h): destination samples are
// poisoned before it and compared with the source pattern after it; the
// engine's byte counters must grow by exactly the batch. A row is INVALID,
// and the program exits 1, when a batch fails verification, when any one-way
// figure exceeds 60 GB/s or a both-ways figure 120 GB/s (beyond a PCIe Gen5
// x16 link), or when the event time and the wall time disagree by > 15 %.
//
// Part 2, the pool: the attention-scope activations of BENCHMARKS.md T1 (16
// layers x {q, k, v, attention output: 64 MiB each; logsumexp: 1 MiB}) go
// through the pinned pool for 1,000 steps with events on the real copy
// streams, then through the whole Runtime (offload, wait, reload, wait, real
// copies) for a few steps. Reported: pinned allocations after the first step
// and pinned bytes over peak live bytes.
//
// Usage: spillway_bench_gpu [--repeats N] [--max-mib M] [--batch-mib B]
//                           [--sweep] [--pool-steps N] [--runtime-steps N]
//                           [--json PATH]
// --sweep adds engine-only runs with other chunk / in-flight options.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "link_check.h"
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
// Ceilings of the link, PCIe Gen5 x16: 63 GB/s per direction before packet
// overhead, so more than 60 one way or 2 x 60 both ways is a timing bug. (The
// H200 measures ~55 one way; both ways raw cudaMemcpyAsync reaches ~101 GB/s
// by this wall clock with every batch verified, so a 100 GB/s ceiling would
// reject the raw baseline itself.)
constexpr double kMaxOneWayGbs = 60.0;
constexpr double kMaxBothGbs = 2 * kMaxOneWayGbs;
// Events and wall clock must agree within this fraction.
constexpr double kMaxClockDisagreement = 0.15;

struct Args {
  int repeats = 7;
  std::size_t max_mib = 1024;
  std::size_t batch_mib = 1024;
  bool sweep = false;
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
    else if (k == "--batch-mib") a.batch_mib = std::stoull(next());
    else if (k == "--sweep") a.sweep = true;
    else if (k == "--pool-steps") a.pool_steps = std::stoi(next());
    else if (k == "--runtime-steps") a.runtime_steps = std::stoi(next());
    else if (k == "--json") a.json = next();
    else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (a.repeats < 1 || a.batch_mib < 1) {
    std::fprintf(stderr, "--repeats and --batch-mib must be >= 1\n");
    std::exit(2);
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

enum class Mode { kD2H, kH2D, kBoth };
const char* mode_name(Mode m) {
  return m == Mode::kD2H ? "D2H" : m == Mode::kH2D ? "H2D" : "both";
}
bool has_d2h(Mode m) { return m != Mode::kH2D; }
bool has_h2d(Mode m) { return m != Mode::kD2H; }

// The buffers of part 1 and their verification. device[0] (D2H source) and
// host[1] (H2D source) hold patterns; host[0] and device[1] are destinations.
struct Buffers {
  void* device[2] = {};
  void* host[2] = {};
  std::size_t bytes = 0;
  LinkCheck* d2h_check = nullptr;  // pattern of device[0]
  LinkCheck* h2d_check = nullptr;  // pattern of host[1]
};

std::size_t offset_of(std::size_t i, std::size_t size, std::size_t total) {
  return (i * size) % (total - size + 1) / size * size;
}

// Timing-enabled events: a start on the first stream, one stop per stream.
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
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  // Starts on `a`; `b` (if any) waits for the start.
  void start(cudaStream_t a, cudaStream_t b) {
    SPILLWAY_CUDA_CHECK(cudaEventRecord(start_, a));
    if (b) SPILLWAY_CUDA_CHECK(cudaStreamWaitEvent(b, start_, 0));
  }
  void stop(int i, cudaStream_t s) { SPILLWAY_CUDA_CHECK(cudaEventRecord(stop_[i], s)); }
  // Seconds from the start to the later of the first `stops` stops.
  double elapsed_s(int stops) {
    double ms = 0;
    for (int i = 0; i < stops; ++i) {
      SPILLWAY_CUDA_CHECK(cudaEventSynchronize(stop_[i]));
      float t = 0;
      SPILLWAY_CUDA_CHECK(cudaEventElapsedTime(&t, start_, stop_[i]));
      ms = std::max(ms, static_cast<double>(t));
    }
    return ms * 1e-3;
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_[2] = {};
};

// One batch's measurement.
struct Sample {
  double wall_s = 0;
  double event_s = 0;
  double submitted_s = 0;  // host phases, from the same start as wall_s
  double enqueued_s = 0;
  std::size_t bad_words = 0;  // sampled destination words not as the source
  bool counted = true;        // engine: byte counters grew by the batch
};

using Clock = std::chrono::steady_clock;

void poison(Mode mode, const Buffers& b) {
  if (has_d2h(mode)) b.d2h_check->poison_host(b.host[0]);
  if (has_h2d(mode)) b.h2d_check->poison_device(b.device[1]);
}

std::size_t verify(Mode mode, const Buffers& b) {
  std::size_t bad = 0;
  if (has_d2h(mode)) bad += b.d2h_check->mismatches_host(b.host[0]);
  if (has_h2d(mode)) bad += b.h2d_check->mismatches_device(b.device[1]);
  return bad;
}

Sample raw_batch(Mode mode, std::size_t size, int count, const Buffers& b, cudaStream_t s[2],
                 Timer& timer) {
  poison(mode, b);
  cudaStream_t d2h = s[0];
  cudaStream_t h2d = mode == Mode::kH2D ? s[0] : s[1];
  Sample out;
  const auto t0 = Clock::now();
  timer.start(s[0], mode == Mode::kBoth ? s[1] : nullptr);
  for (int i = 0; i < count; ++i) {
    const std::size_t at = offset_of(i, size, b.bytes);
    if (has_d2h(mode)) {
      SPILLWAY_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(b.host[0]) + at,
                                          static_cast<char*>(b.device[0]) + at, size,
                                          cudaMemcpyDeviceToHost, d2h));
    }
    if (has_h2d(mode)) {
      SPILLWAY_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(b.device[1]) + at,
                                          static_cast<char*>(b.host[1]) + at, size,
                                          cudaMemcpyHostToDevice, h2d));
    }
  }
  out.submitted_s = std::chrono::duration<double>(Clock::now() - t0).count();
  timer.stop(0, s[0]);
  if (mode == Mode::kBoth) timer.stop(1, s[1]);
  out.enqueued_s = std::chrono::duration<double>(Clock::now() - t0).count();
  SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(s[0]));
  SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(s[1]));
  out.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  out.event_s = timer.elapsed_s(mode == Mode::kBoth ? 2 : 1);
  out.bad_words = verify(mode, b);
  return out;
}

Sample engine_batch(Mode mode, std::size_t size, int count, const Buffers& b, CopyEngine& engine,
                    Timer& timer) {
  poison(mode, b);
  auto d2h = static_cast<cudaStream_t>(engine.stream(CopyKind::kDeviceToHost).native());
  auto h2d = static_cast<cudaStream_t>(engine.stream(CopyKind::kHostToDevice).native());
  const CopyEngineStats before = engine.stats();
  std::vector<TransferPtr> transfers;
  transfers.reserve(static_cast<std::size_t>(count) * 2);
  Sample out;
  const auto t0 = Clock::now();
  timer.start(mode == Mode::kH2D ? h2d : d2h, mode == Mode::kBoth ? h2d : nullptr);
  for (int i = 0; i < count; ++i) {
    const std::size_t at = offset_of(i, size, b.bytes);
    if (has_d2h(mode)) {
      transfers.push_back(engine.submit(CopyKind::kDeviceToHost,
                                        static_cast<char*>(b.host[0]) + at,
                                        static_cast<char*>(b.device[0]) + at, size, 0, {}));
    }
    if (has_h2d(mode)) {
      transfers.push_back(engine.submit(CopyKind::kHostToDevice,
                                        static_cast<char*>(b.device[1]) + at,
                                        static_cast<char*>(b.host[1]) + at, size, 0, {}));
    }
  }
  out.submitted_s = std::chrono::duration<double>(Clock::now() - t0).count();
  // wait_enqueued(t) only says t's chunks are on the stream: it makes t the
  // most urgent, so t can overtake earlier transfers. Waiting for every
  // transfer, oldest first, puts the whole batch before the stop events
  // (and, the oldest being first anyway, reorders nothing).
  for (const TransferPtr& t : transfers) engine.wait_enqueued(t);
  int stops = 0;
  if (has_d2h(mode)) timer.stop(stops++, d2h);
  if (has_h2d(mode)) timer.stop(stops++, h2d);
  out.enqueued_s = std::chrono::duration<double>(Clock::now() - t0).count();
  engine.drain();
  out.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  out.event_s = timer.elapsed_s(stops);
  for (const TransferPtr& t : transfers) engine.synchronize(t);  // throws on a failed copy
  const CopyEngineStats after = engine.stats();
  const std::uint64_t batch = static_cast<std::uint64_t>(size) * count;
  out.counted = after.bytes_d2h - before.bytes_d2h == (has_d2h(mode) ? batch : 0) &&
                after.bytes_h2d - before.bytes_h2d == (has_h2d(mode) ? batch : 0);
  out.bad_words = verify(mode, b);
  return out;
}

// Medians and validity of one configuration (raw or engine).
struct Figures {
  double gbs = 0;        // median, wall clock
  double event_gbs = 0;  // median, CUDA events
  double max_gbs = 0;    // the fastest repeat, either clock
  // Medians of the host phases' ends (Sample), ms from the batch's start, and
  // of wall minus events.
  double submitted_ms = 0;
  double enqueued_ms = 0;
  double synchronized_ms = 0;
  double wall_minus_events_ms = 0;
  std::size_t bad_words = 0;
  bool counted = true;
  std::vector<std::string> problems;
};

Figures summarize(Mode mode, double bytes, const std::vector<Sample>& samples) {
  Figures f;
  std::vector<double> wall, event, submitted, enqueued, synchronized, wall_minus_events;
  for (const Sample& s : samples) {
    wall.push_back(bytes / s.wall_s / 1e9);
    event.push_back(bytes / s.event_s / 1e9);
    submitted.push_back(1e3 * s.submitted_s);
    enqueued.push_back(1e3 * s.enqueued_s);
    synchronized.push_back(1e3 * s.wall_s);
    wall_minus_events.push_back(1e3 * (s.wall_s - s.event_s));
    f.max_gbs = std::max({f.max_gbs, wall.back(), event.back()});
    f.bad_words += s.bad_words;
    f.counted = f.counted && s.counted;
  }
  f.gbs = median(wall);
  f.event_gbs = median(event);
  f.submitted_ms = median(submitted);
  f.enqueued_ms = median(enqueued);
  f.synchronized_ms = median(synchronized);
  f.wall_minus_events_ms = median(wall_minus_events);
  const double limit = mode == Mode::kBoth ? kMaxBothGbs : kMaxOneWayGbs;
  char buf[160];
  if (f.max_gbs > limit) {
    std::snprintf(buf, sizeof(buf), "%.1f GB/s exceeds the %.0f GB/s ceiling", f.max_gbs, limit);
    f.problems.push_back(buf);
  }
  if (f.bad_words > 0) {
    std::snprintf(buf, sizeof(buf), "%zu sampled words wrong", f.bad_words);
    f.problems.push_back(buf);
  }
  if (!f.counted) f.problems.push_back("engine byte counters do not match the batch");
  const double disagreement = std::abs(f.event_gbs - f.gbs) / f.gbs;
  if (disagreement > kMaxClockDisagreement) {
    std::snprintf(buf, sizeof(buf), "events %.1f vs wall %.1f GB/s", f.event_gbs, f.gbs);
    f.problems.push_back(buf);
  }
  return f;
}

struct Row {
  std::size_t mib = 0;
  Mode mode = Mode::kD2H;
  int count = 0;
  Figures raw;
  Figures engine;
  bool valid() const { return raw.problems.empty() && engine.problems.empty(); }
};

// An engine-only configuration of the sweep.
struct SweepRow {
  std::size_t chunk_mib = 0;
  std::size_t inflight_mib = 0;
  std::size_t mib = 0;
  Mode mode = Mode::kD2H;
  Figures engine;
};

int batch_count(std::size_t mib, const Args& args) {
  return static_cast<int>(std::max<std::size_t>(2, args.batch_mib / mib));
}

void set_coverage(const Buffers& b, std::size_t size, int count) {
  for (LinkCheck* c : {b.d2h_check, b.h2d_check}) {
    c->clear_coverage();
    for (int i = 0; i < count; ++i) c->cover(offset_of(i, size, b.bytes), size);
  }
}

std::string describe(const Figures& f) {
  std::string s;
  for (const std::string& p : f.problems) s += (s.empty() ? "" : "; ") + p;
  return s;
}

void print_row(const Row& r) {
  std::printf(
      "  %5zu MiB %-4s x%-4d raw %6.1f GB/s (events %6.1f)  engine %6.1f GB/s (events %6.1f)"
      "  %6.1f %%%s%s\n",
      r.mib, mode_name(r.mode), r.count, r.raw.gbs, r.raw.event_gbs, r.engine.gbs,
      r.engine.event_gbs, 100.0 * r.engine.gbs / r.raw.gbs, r.valid() ? "" : "  INVALID: ",
      r.valid() ? "" : (describe(r.raw) + (r.raw.problems.empty() ? "" : " (raw) ") +
                        describe(r.engine) + (r.engine.problems.empty() ? "" : " (engine)"))
                           .c_str());
  std::printf(
      "             phases ms: raw submitted %.2f enqueued %.2f synchronized %.2f (wall-events "
      "%.2f); engine submitted %.2f enqueued %.2f drained %.2f (wall-events %.2f)\n",
      r.raw.submitted_ms, r.raw.enqueued_ms, r.raw.synchronized_ms, r.raw.wall_minus_events_ms,
      r.engine.submitted_ms, r.engine.enqueued_ms, r.engine.synchronized_ms,
      r.engine.wall_minus_events_ms);
  std::fflush(stdout);
}

struct LinkResults {
  std::vector<Row> rows;
  std::vector<SweepRow> sweep;
};

LinkResults bench_link(const Args& args) {
  auto backend = runtime::make_cuda_backend(0);
  Buffers b;
  b.bytes = std::max(args.max_mib, args.batch_mib) * kMiB;
  b.bytes = (b.bytes + LinkCheck::kStride - 1) / LinkCheck::kStride * LinkCheck::kStride;
  for (int i = 0; i < 2; ++i) {
    SPILLWAY_CUDA_CHECK(cudaMalloc(&b.device[i], b.bytes));
    SPILLWAY_CUDA_CHECK(cudaHostAlloc(&b.host[i], b.bytes, cudaHostAllocDefault));
  }
  LinkCheck d2h_check(b.bytes, 1), h2d_check(b.bytes, 2);
  b.d2h_check = &d2h_check;
  b.h2d_check = &h2d_check;
  // device[0] := pattern 1 (staged through host[0], then host[0] is wiped);
  // host[1] := pattern 2; device[1] := zeros.
  fill_pattern(b.host[0], b.bytes, d2h_check.seed());
  SPILLWAY_CUDA_CHECK(cudaMemcpy(b.device[0], b.host[0], b.bytes, cudaMemcpyHostToDevice));
  std::memset(b.host[0], 0, b.bytes);
  fill_pattern(b.host[1], b.bytes, h2d_check.seed());
  SPILLWAY_CUDA_CHECK(cudaMemset(b.device[1], 0, b.bytes));
  SPILLWAY_CUDA_CHECK(cudaDeviceSynchronize());

  cudaStream_t raw[2];
  for (auto& s : raw) SPILLWAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Timer timer;
  LinkResults out;
  {
    CopyEngine engine(*backend, CopyEngineOptions{});
    for (std::size_t mib : {std::size_t{1}, std::size_t{4}, std::size_t{64}, std::size_t{1024}}) {
      if (mib > args.max_mib) continue;
      const std::size_t size = mib * kMiB;
      const int count = batch_count(mib, args);
      set_coverage(b, size, count);
      for (Mode mode : {Mode::kD2H, Mode::kH2D, Mode::kBoth}) {
        std::vector<Sample> raw_s, engine_s;
        raw_batch(mode, size, count, b, raw, timer);  // warm-up
        engine_batch(mode, size, count, b, engine, timer);
        for (int r = 0; r < args.repeats; ++r) {  // interleaved, so drift hits both
          raw_s.push_back(raw_batch(mode, size, count, b, raw, timer));
          engine_s.push_back(engine_batch(mode, size, count, b, engine, timer));
        }
        const double bytes = static_cast<double>(size) * count * (mode == Mode::kBoth ? 2 : 1);
        Row row{mib, mode, count, summarize(mode, bytes, raw_s), summarize(mode, bytes, engine_s)};
        print_row(row);
        out.rows.push_back(std::move(row));
      }
    }
  }
  if (args.sweep) {
    // Engine options other than the defaults (32 MiB chunks, 96 MiB in flight).
    const std::pair<std::size_t, std::size_t> options[] = {{8, 32}, {16, 64}, {32, 192}, {64, 256}};
    for (auto [chunk, inflight] : options) {
      CopyEngine engine(*backend, CopyEngineOptions{.chunk_bytes = chunk * kMiB,
                                                    .max_inflight_bytes = inflight * kMiB});
      for (std::size_t mib : {std::size_t{4}, std::size_t{64}, std::size_t{1024}}) {
        if (mib > args.max_mib) continue;
        const std::size_t size = mib * kMiB;
        const int count = batch_count(mib, args);
        set_coverage(b, size, count);
        for (Mode mode : {Mode::kD2H, Mode::kBoth}) {
          std::vector<Sample> samples;
          engine_batch(mode, size, count, b, engine, timer);  // warm-up
          for (int r = 0; r < std::max(3, args.repeats / 2); ++r) {
            samples.push_back(engine_batch(mode, size, count, b, engine, timer));
          }
          const double bytes = static_cast<double>(size) * count * (mode == Mode::kBoth ? 2 : 1);
          SweepRow row{chunk, inflight, mib, mode, summarize(mode, bytes, samples)};
          std::printf("  sweep chunk %2zu MiB in-flight %3zu MiB: %5zu MiB %-4s engine %6.1f GB/s%s%s\n",
                      chunk, inflight, mib, mode_name(mode), row.engine.gbs,
                      row.engine.problems.empty() ? "" : "  INVALID: ",
                      describe(row.engine).c_str());
          std::fflush(stdout);
          out.sweep.push_back(std::move(row));
        }
      }
    }
  }
  for (auto& s : raw) SPILLWAY_CUDA_CHECK(cudaStreamDestroy(s));
  for (int i = 0; i < 2; ++i) {
    SPILLWAY_CUDA_CHECK(cudaFree(b.device[i]));
    SPILLWAY_CUDA_CHECK(cudaFreeHost(b.host[i]));
  }
  return out;
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

void write_figures(FILE* out, const char* name, const Figures& f) {
  std::fprintf(out,
               "\"%s_gbs\": %.2f, \"%s_event_gbs\": %.2f, \"%s_max_gbs\": %.2f, "
               "\"%s_bad_words\": %zu, \"%s_problems\": \"%s\", "
               "\"%s_submitted_ms\": %.3f, \"%s_enqueued_ms\": %.3f, "
               "\"%s_synchronized_ms\": %.3f, \"%s_wall_minus_events_ms\": %.3f",
               name, f.gbs, name, f.event_gbs, name, f.max_gbs, name, f.bad_words, name,
               describe(f).c_str(), name, f.submitted_ms, name, f.enqueued_ms, name,
               f.synchronized_ms, name, f.wall_minus_events_ms);
}

void write_json(const std::string& path, const LinkResults& link, const PoolFigures& pool,
                const PoolFigures& rt, const Args& args) {
  FILE* out = std::fopen(path.c_str(), "w");
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  cudaDeviceProp prop{};
  SPILLWAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::fprintf(out,
               "{\n  \"device\": \"%s\",\n  \"repeats\": %d,\n  \"batch_mib\": %zu,\n"
               "  \"timing\": \"host steady_clock from before the first submit to after a full "
               "synchronize of the streams used; CUDA events as a cross-check\",\n"
               "  \"max_one_way_gbs\": %.0f,\n  \"max_both_gbs\": %.0f,\n  \"link\": [\n",
               prop.name, args.repeats, args.batch_mib, kMaxOneWayGbs, kMaxBothGbs);
  for (std::size_t i = 0; i < link.rows.size(); ++i) {
    const Row& r = link.rows[i];
    std::fprintf(out, "    {\"mib\": %zu, \"direction\": \"%s\", \"count\": %d, \"valid\": %s, ",
                 r.mib, mode_name(r.mode), r.count, r.valid() ? "true" : "false");
    write_figures(out, "raw", r.raw);
    std::fprintf(out, ", ");
    write_figures(out, "engine", r.engine);
    std::fprintf(out, "}%s\n", i + 1 < link.rows.size() ? "," : "");
  }
  std::fprintf(out, "  ],\n  \"sweep\": [\n");
  for (std::size_t i = 0; i < link.sweep.size(); ++i) {
    const SweepRow& r = link.sweep[i];
    std::fprintf(out,
                 "    {\"chunk_mib\": %zu, \"inflight_mib\": %zu, \"mib\": %zu, "
                 "\"direction\": \"%s\", \"valid\": %s, ",
                 r.chunk_mib, r.inflight_mib, r.mib, mode_name(r.mode),
                 r.engine.problems.empty() ? "true" : "false");
    write_figures(out, "engine", r.engine);
    std::fprintf(out, "}%s\n", i + 1 < link.sweep.size() ? "," : "");
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
  std::printf(
      "[bench_gpu] %s; batches of max(2, %zu MiB/size) transfers per direction, median of %d; "
      "wall clock to a full synchronize, events cross-checked, every batch verified\n",
      prop.name, args.batch_mib, args.repeats);
  LinkResults link = bench_link(args);
  PoolFigures pool = pool_loop(args.pool_steps);
  print_pool("pool", pool);
  PoolFigures rt = runtime_loop(args.runtime_steps);
  print_pool("runtime", rt);
  if (!args.json.empty()) write_json(args.json, link, pool, rt, args);

  // The summary table, last.
  std::printf("\n%-6s %-5s %10s %10s %8s  %s\n", "MiB", "dir", "raw GB/s", "engine", "engine%",
              "status");
  int invalid = 0;
  for (const Row& r : link.rows) {
    std::printf("%-6zu %-5s %10.1f %10.1f %7.1f%%  %s\n", r.mib, mode_name(r.mode), r.raw.gbs,
                r.engine.gbs, 100.0 * r.engine.gbs / r.raw.gbs, r.valid() ? "ok" : "INVALID");
    invalid += r.valid() ? 0 : 1;
  }
  for (const SweepRow& r : link.sweep) invalid += r.engine.problems.empty() ? 0 : 1;
  for (std::size_t mib : {std::size_t{1}, std::size_t{4}, std::size_t{64}, std::size_t{1024}}) {
    const Row* by[3] = {};
    for (const Row& r : link.rows) {
      if (r.mib == mib) by[static_cast<int>(r.mode)] = &r;
    }
    if (!by[0] || !by[1] || !by[2]) continue;
    const double engine_one = std::max(by[0]->engine.gbs, by[1]->engine.gbs);
    const double raw_one = std::max(by[0]->raw.gbs, by[1]->raw.gbs);
    std::printf("both/one-way at %zu MiB: engine %.2fx, raw %.2fx\n", mib,
                by[2]->engine.gbs / engine_one, by[2]->raw.gbs / raw_one);
  }
  std::printf("pool 1000-step: %llu pinned allocations after step 1, pinned/peak-live %.3f\n",
              static_cast<unsigned long long>(pool.allocations_total -
                                              pool.allocations_first_step),
              pool.peak_live_gib > 0 ? pool.pinned_gib / pool.peak_live_gib : 0.0);
  if (invalid > 0) {
    std::printf("[bench_gpu] %d INVALID row(s): the figures above cannot be trusted\n", invalid);
    return 1;
  }
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
