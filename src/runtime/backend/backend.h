#pragma once
// The backend vocabulary (after ggml's): buffer type -> buffer -> stream ->
// event. A Backend makes streams and events, pinned host buffers and (through
// its default DeviceAllocator) device buffers, and enqueues copies. Two
// implementations: backend/cuda (the only code that includes CUDA headers) and
// backend/fake (worker threads, for tests under TSan).
//
// Semantics follow CUDA: work enqueued on one stream runs in order; record()
// captures the stream's work so far; wait() makes a stream wait for the last
// record() of an event, made before the call; an event never recorded counts
// as complete.
//
// Errors: a failure while enqueuing throws at once (TransferError for copies,
// OutOfMemory for allocations). A failure while executing is kept and raised
// as TransferError by query()/synchronize() of an event recorded after it on
// the same stream, or on a stream that waited for such an event. It is also
// sticky for the stream: synchronize(Stream&) throws TransferError at every
// call once any work on the stream has failed (CUDA's errors are sticky for
// the whole context, which is stricter). So a synchronize(Stream&) that
// returns means everything enqueued on the stream before it ran cleanly.
//
// Thread-safety: every method may be called from any thread. Streams and
// events are owned by their unique_ptr and must outlive the work that uses
// them; destroying them never throws.

#include <cstddef>
#include <memory>
#include <string_view>

#include "spillway/runtime.h"

namespace spillway::runtime {

enum class CopyKind { kDeviceToHost, kHostToDevice };

class Stream {
 public:
  virtual ~Stream() = default;
  // The backend's handle (cudaStream_t, or the fake stream itself).
  virtual void* native() const = 0;
};

class Event {
 public:
  virtual ~Event() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // A new stream owned by the caller. `role` names its use (the fake backend
  // applies injected delays by role).
  virtual std::unique_ptr<Stream> create_stream(FakeControls::Role role) = 0;
  // A non-owning view of a native stream (nullptr: see StreamHandle).
  virtual std::unique_ptr<Stream> wrap_stream(void* native) = 0;

  virtual std::unique_ptr<Event> create_event() = 0;
  virtual void record(Event& event, Stream& stream) = 0;
  virtual void wait(Stream& stream, Event& event) = 0;
  // True once the work captured by the event has run; throws TransferError if
  // it failed.
  virtual bool query(Event& event) = 0;
  virtual void synchronize(Event& event) = 0;
  virtual void synchronize(Stream& stream) = 0;

  // Page-locked host memory; throws OutOfMemory. `numa_node` >= 0 asks for
  // that node when the build supports it; returns the node used (-1 = none)
  // through `placed_node`.
  virtual void* allocate_pinned(std::size_t bytes, int numa_node, int* placed_node) = 0;
  virtual void free_pinned(void* ptr, std::size_t bytes) noexcept = 0;
  // The NUMA node nearest the device, -1 when unknown.
  virtual int device_numa_node() const = 0;

  virtual DeviceAllocator& default_allocator() = 0;

  // Enqueues a copy of `bytes` on `stream`; throws TransferError if it cannot
  // be enqueued.
  virtual void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                    Stream& stream) = 0;

  // Makes the calling thread ready to call this backend (CUDA: cudaSetDevice).
  virtual void bind_thread() = 0;

  // Test hooks; nullptr except on the fake backend.
  virtual FakeControls* fake_controls() { return nullptr; }
};

std::unique_ptr<Backend> make_fake_backend(const FakeBackendOptions& options);
// Throws InvalidArgument when the build has no CUDA backend.
std::unique_ptr<Backend> make_cuda_backend(int device);
bool cuda_backend_built();

}  // namespace spillway::runtime
