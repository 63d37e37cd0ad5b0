// The fake backend: streams are worker threads that run queued tasks in order,
// events are completion markers, "device" memory is host memory bounded by a
// capacity. It exists to test ordering, races and faults on CPU under TSan;
// it proves nothing about CUDA.
//
// Invariants:
//   1. A task runs only after every task enqueued before it on its stream.
//   2. A Marker completes after the tasks enqueued before its record().
//   3. A failure in a task is kept on its stream and attached to the next
//      marker completed there; a stream that waits for a failed marker
//      inherits the failure (as CUDA's sticky errors reach later work). The
//      stream's first failure stays: every later synchronize(Stream&) of it
//      throws (FakeControls::synchronize, which only waits, does not).
//   4. Device memory is stream-ordered like cudaMallocAsync: a block freed on
//      stream S is reusable at once by allocations on S, by other streams
//      only after S ran the free point; at that point it is poisoned (0xDD).

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <mutex>
#include <random>
#include <sys/mman.h>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/backend/backend.h"
#include "runtime/thread_annotations.h"
#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr char kFakeComponent[] = "fake";

struct Marker {
  std::mutex mu;
  std::condition_variable cv;
  bool done GUARDED_BY(mu) = false;
  std::exception_ptr error GUARDED_BY(mu);

  void complete(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
  // Blocks until done; returns its failure, if any.
  std::exception_ptr await() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return error;
  }
  bool poll(std::exception_ptr* e) {
    std::lock_guard<std::mutex> lock(mu);
    if (done) *e = error;
    return done;
  }
};

struct Delay {
  int min_us = 0;
  int max_us = 0;
  std::uint64_t seed = 0;
};

class FakeBackend;

std::atomic<std::uint64_t> next_stream_id{1};  // ids outlive streams, unlike addresses

// A stream run by one worker thread (or, for the host stream, by the caller).
class FakeStream final : public Stream {
 public:
  FakeStream(FakeBackend* backend, FakeControls::Role role, bool on_host)
      : backend_(backend), role_(role), on_host_(on_host), id_(next_stream_id++) {
    if (!on_host_) worker_ = std::thread([this] { run(); });
  }
  ~FakeStream() override;
  void* native() const override { return const_cast<FakeStream*>(this); }
  FakeControls::Role role() const { return role_; }
  std::uint64_t id() const { return id_; }
  bool on_host() const { return on_host_; }

  // Runs `task` in stream order; on the host stream, now.
  void enqueue(std::function<void()> task) {
    if (on_host_) {
      task();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
  }
  void set_failure(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_failure_) first_failure_ = e;
    if (!failure_) failure_ = std::move(e);
  }
  // The first failure ever on this stream (invariant 3), or null.
  std::exception_ptr first_failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_failure_;
  }
  std::exception_ptr take_failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(failure_, nullptr);
  }
  void set_delay(const Delay& delay) {
    std::lock_guard<std::mutex> lock(mu_);
    delay_ = delay;
    rng_.seed(delay.seed);
  }

 private:
  void run();

  FakeBackend* backend_;
  FakeControls::Role role_;
  bool on_host_;
  std::uint64_t id_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::exception_ptr failure_ GUARDED_BY(mu_);        // for the next marker
  std::exception_ptr first_failure_ GUARDED_BY(mu_);  // for synchronize(Stream&)
  Delay delay_ GUARDED_BY(mu_);
  std::mt19937_64 rng_ GUARDED_BY(mu_);
  std::thread worker_;
};

void FakeStream::run() {
  for (;;) {
    std::function<void()> task;
    int sleep_us = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      if (delay_.max_us > 0) {
        std::uniform_int_distribution<int> dist(delay_.min_us, delay_.max_us);
        sleep_us = dist(rng_);
      }
    }
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    try {
      task();
    } catch (...) {
      set_failure(std::current_exception());
    }
  }
}

class FakeEvent final : public Event {
 public:
  std::shared_ptr<Marker> current() {
    std::lock_guard<std::mutex> lock(mu_);
    return marker_;
  }
  void set(std::shared_ptr<Marker> m) {
    std::lock_guard<std::mutex> lock(mu_);
    marker_ = std::move(m);
  }

 private:
  std::mutex mu_;
  std::shared_ptr<Marker> marker_ GUARDED_BY(mu_);
};

FakeStream& as_fake(Stream& s) { return static_cast<FakeStream&>(s); }
FakeEvent& as_fake(Event& e) { return static_cast<FakeEvent&>(e); }

// A non-owning view of a FakeStream.
class BorrowedStream final : public Stream {
 public:
  explicit BorrowedStream(FakeStream* s) : stream_(s) {}
  void* native() const override { return stream_; }
  FakeStream* stream() const { return stream_; }

 private:
  FakeStream* stream_;
};

FakeStream& resolve(Stream& s) {
  if (auto* b = dynamic_cast<BorrowedStream*>(&s)) return *b->stream();
  return as_fake(s);
}

void raise_transfer(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const TransferError&) {
    throw;
  } catch (const std::exception& ex) {
    throw TransferError(kFakeComponent, std::string("work on a stream failed: ") + ex.what());
  }
}

class FakeBackend final : public Backend, public DeviceAllocator, public FakeControls {
 public:
  explicit FakeBackend(const FakeBackendOptions& options)
      : capacity_(options.device_bytes),
        unbacked_pinned_(options.unbacked_pinned),
        host_stream_(this, Role::kCompute, /*on_host=*/true) {}

  ~FakeBackend() override {
    // Compute streams first: their tasks may free device memory.
    std::list<std::unique_ptr<FakeStream>> doomed;
    {
      std::lock_guard<std::mutex> lock(streams_mu_);
      doomed.swap(compute_streams_);
    }
    doomed.clear();
    std::lock_guard<std::mutex> lock(arena_mu_);
    for (Freed& f : freed_) delete[] f.data;
  }

  std::string_view name() const override { return "fake"; }

  std::unique_ptr<Stream> create_stream(Role role) override {
    auto stream = std::make_unique<FakeStream>(this, role, false);
    register_stream(stream.get());
    return stream;
  }
  std::unique_ptr<Stream> wrap_stream(void* native) override {
    return std::make_unique<BorrowedStream>(native ? static_cast<FakeStream*>(native)
                                                   : &host_stream_);
  }

  std::unique_ptr<Event> create_event() override { return std::make_unique<FakeEvent>(); }

  void record(Event& event, Stream& s) override {
    FakeStream& stream = resolve(s);
    auto marker = std::make_shared<Marker>();
    as_fake(event).set(marker);
    stream.enqueue([marker, &stream] { marker->complete(stream.take_failure()); });
  }
  void wait(Stream& s, Event& event) override {
    FakeStream& stream = resolve(s);
    std::shared_ptr<Marker> marker = as_fake(event).current();
    if (!marker) return;
    if (stream.on_host()) {
      if (auto e = marker->await()) raise_transfer(e);
      return;
    }
    stream.enqueue([marker, &stream] {
      if (auto e = marker->await()) stream.set_failure(e);
    });
  }
  bool query(Event& event) override {
    std::shared_ptr<Marker> marker = as_fake(event).current();
    if (!marker) return true;
    std::exception_ptr e;
    bool done = marker->poll(&e);
    if (e) raise_transfer(e);
    return done;
  }
  void synchronize(Event& event) override {
    std::shared_ptr<Marker> marker = as_fake(event).current();
    if (!marker) return;
    if (auto e = marker->await()) raise_transfer(e);
  }
  void synchronize(Stream& s) override {
    FakeStream& stream = resolve(s);
    if (stream.on_host()) return;
    auto marker = std::make_shared<Marker>();
    stream.enqueue([marker] { marker->complete(nullptr); });
    marker->await();
    if (auto e = stream.first_failure()) raise_transfer(e);
  }

  void* allocate_pinned(std::size_t bytes, int /*numa_node*/, int* placed_node) override {
    if (placed_node) *placed_node = -1;
    if (take_one(fail_pinned_)) {
      throw OutOfMemory(kFakeComponent, "injected pinned allocation failure of " +
                                        std::to_string(bytes) + " bytes");
    }
    if (unbacked_pinned_) {
      void* p = mmap(nullptr, bytes == 0 ? 1 : bytes, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw OutOfMemory(kFakeComponent, "cannot reserve pinned address space");
      return p;
    }
    return new char[bytes == 0 ? 1 : bytes];
  }
  void free_pinned(void* ptr, std::size_t bytes) noexcept override {
    if (unbacked_pinned_) {
      munmap(ptr, bytes == 0 ? 1 : bytes);
      return;
    }
    delete[] static_cast<char*>(ptr);
  }
  int device_numa_node() const override { return -1; }

  DeviceAllocator& default_allocator() override { return *this; }

  // Stream-ordered like cudaMallocAsync (invariant 4): a block freed on
  // stream S may be handed out again at once to an allocation on S (whose
  // work runs after the free point), and to other streams only once S has
  // passed the free point.
  void* allocate(std::size_t bytes, void* stream) override {
    if (take_one(fail_device_)) {
      throw OutOfMemory(kFakeComponent, "injected device allocation failure of " +
                                        std::to_string(bytes) + " bytes");
    }
    const std::size_t rounded = bytes == 0 ? 1 : bytes;
    const std::uint64_t stream_id = stream_of(stream)->id();
    {
      std::lock_guard<std::mutex> lock(arena_mu_);
      if (used_ + rounded > capacity_) {
        throw OutOfMemory(kFakeComponent, "device arena of " + std::to_string(capacity_) +
                                          " bytes cannot hold " + std::to_string(bytes) +
                                          " more (" + std::to_string(used_) + " in use)");
      }
      used_ += rounded;
      for (auto it = freed_.begin(); it != freed_.end(); ++it) {
        if (it->bytes == rounded && (it->stream_id == stream_id || it->passed->load())) {
          char* p = it->data;
          freed_bytes_ -= it->bytes;
          freed_.erase(it);
          return p;
        }
      }
    }
    char* p = new char[rounded];
    std::memset(p, 0xCD, rounded);
    return p;
  }
  void deallocate(void* ptr, std::size_t bytes, void* stream) noexcept override {
    const std::size_t rounded = bytes == 0 ? 1 : bytes;
    FakeStream* s = stream_of(stream);
    auto passed = std::make_shared<std::atomic<bool>>(false);
    std::vector<char*> doomed;
    {
      std::lock_guard<std::mutex> lock(arena_mu_);
      used_ -= rounded;
      freed_.push_back(Freed{static_cast<char*>(ptr), rounded, s->id(), passed});
      freed_bytes_ += rounded;
      // Keep the cache of freed blocks bounded: drop the oldest passed ones.
      for (auto it = freed_.begin(); it != freed_.end() && freed_bytes_ > kFreedCacheBytes;) {
        if (it->passed->load()) {
          doomed.push_back(it->data);
          freed_bytes_ -= it->bytes;
          it = freed_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (char* p : doomed) delete[] p;
    // At the free point in stream order the bytes become poison: a reader
    // that was not ordered before the free sees 0xDD (and TSan sees a race).
    auto poison = [ptr, rounded, passed] {
      std::memset(ptr, 0xDD, rounded);
      passed->store(true);
    };
    try {
      s->enqueue(poison);
    } catch (...) {
      poison();
    }
  }

  void copy(void* dst, const void* src, std::size_t bytes, CopyKind, Stream& s) override {
    bool fail = take_one(fail_copies_);
    resolve(s).enqueue([dst, src, bytes, fail] {
      if (fail) {
        std::memset(dst, 0xEE, bytes / 2);
        throw TransferError(kFakeComponent, "injected copy failure of " + std::to_string(bytes) +
                                            " bytes");
      }
      std::memcpy(dst, src, bytes);
    });
  }

  void bind_thread() override {}

  FakeControls* fake_controls() override { return this; }

  // FakeControls
  void set_delay(Role role, int min_us, int max_us, std::uint64_t seed) override {
    std::lock_guard<std::mutex> lock(streams_mu_);
    delays_[static_cast<int>(role)] = Delay{min_us, max_us, seed};
    std::uint64_t n = 0;
    for (FakeStream* s : streams_) {
      if (s->role() == role) s->set_delay(Delay{min_us, max_us, seed + 7919 * n++});
    }
  }
  void fail_next_device_allocations(int n) override { fail_device_ = n; }
  void fail_next_pinned_allocations(int n) override { fail_pinned_ = n; }
  void fail_next_copies(int n) override { fail_copies_ = n; }
  StreamHandle create_compute_stream() override {
    auto stream = std::make_unique<FakeStream>(this, Role::kCompute, false);
    register_stream(stream.get());
    std::lock_guard<std::mutex> lock(streams_mu_);
    compute_streams_.push_back(std::move(stream));
    return StreamHandle{compute_streams_.back().get()};
  }
  void launch(StreamHandle stream, std::function<void()> kernel) override {
    FakeStream* s = stream.native ? static_cast<FakeStream*>(stream.native) : &host_stream_;
    s->enqueue(std::move(kernel));
  }
  void synchronize(StreamHandle stream) override {
    BorrowedStream s(stream.native ? static_cast<FakeStream*>(stream.native) : &host_stream_);
    try {
      synchronize(static_cast<Stream&>(s));
    } catch (const TransferError&) {
      // Only waits (invariant 3): failures are for the events to report.
    }
  }
  std::size_t device_bytes_in_use() const override {
    std::lock_guard<std::mutex> lock(arena_mu_);
    return used_;
  }

  void unregister_stream(FakeStream* s) {
    std::lock_guard<std::mutex> lock(streams_mu_);
    std::erase(streams_, s);
  }

 private:
  static bool take_one(std::atomic<int>& counter) {
    int n = counter.load();
    while (n > 0) {
      if (counter.compare_exchange_weak(n, n - 1)) return true;
    }
    return false;
  }
  void register_stream(FakeStream* s) {
    std::lock_guard<std::mutex> lock(streams_mu_);
    streams_.push_back(s);
    const Delay& d = delays_[static_cast<int>(s->role())];
    if (d.max_us > 0) s->set_delay(Delay{d.min_us, d.max_us, d.seed + 104729 * streams_.size()});
  }

  const std::size_t capacity_;
  const bool unbacked_pinned_;
  struct Freed {
    char* data;
    std::size_t bytes;
    std::uint64_t stream_id;
    std::shared_ptr<std::atomic<bool>> passed;  // the stream ran the free point
  };
  static constexpr std::size_t kFreedCacheBytes = std::size_t{64} << 20;

  FakeStream* stream_of(void* native) {
    return native ? static_cast<FakeStream*>(native) : &host_stream_;
  }

  mutable std::mutex arena_mu_;
  std::size_t used_ GUARDED_BY(arena_mu_) = 0;
  std::vector<Freed> freed_ GUARDED_BY(arena_mu_);
  std::size_t freed_bytes_ GUARDED_BY(arena_mu_) = 0;
  std::atomic<int> fail_device_{0};
  std::atomic<int> fail_pinned_{0};
  std::atomic<int> fail_copies_{0};
  std::mutex streams_mu_;
  std::vector<FakeStream*> streams_ GUARDED_BY(streams_mu_);  // live worker streams
  Delay delays_[3] GUARDED_BY(streams_mu_);
  FakeStream host_stream_;
  std::list<std::unique_ptr<FakeStream>> compute_streams_ GUARDED_BY(streams_mu_);
};

FakeStream::~FakeStream() {
  if (on_host_) return;
  backend_->unregister_stream(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

}  // namespace

std::unique_ptr<Backend> make_fake_backend(const FakeBackendOptions& options) {
  return std::make_unique<FakeBackend>(options);
}

}  // namespace spillway::runtime
