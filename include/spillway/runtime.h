#pragma once
// The runtime that moves bytes: a pinned host pool, a copy engine with one
// device-to-host and one host-to-device stream, and a residency manager with
// the semantics of PyTorch's ao::offload / reload / wait_tensor ops, on raw
// device buffers.
//
//   Runtime rt(RuntimeOptions{.backend = BackendKind::kCuda});
//   StorageId s = rt.adopt(ptr, bytes, release_fn);   // a live activation
//   HostHandle h = rt.offload(s);                      // D2H after compute's current point
//   rt.wait_offload(h, s);                             // forward: compute waits, s released
//   DeviceValue v = rt.reload(h);                      // allocation on compute, copy on H2D
//   rt.wait_reload(v.storage);                         // backward: compute waits for H2D
//   rt.release(v.storage); rt.release_host(h);
//
// Storage states (each StorageId):
//
//   kResident --offload--> kOffloading --wait_offload--> kOnHost (device storage released)
//   kReloading --wait_reload--> kResident        (a value made by reload/reload_into)
//
// Misuse raises StateError and changes nothing: a wait with no transfer in
// flight, a reload of a handle that no offload produced, a second offload of a
// storage, a release while a copy into or out of the storage is in flight.
//
// Faults lose nothing:
//   * offload() when the pinned pool cannot supply a block (host budget
//     exhausted, pinned allocation failed) throws OutOfMemory; the storage stays
//     kResident on the device with its bytes untouched and no copy is started.
//     Callers that prefer a fallback catch OutOfMemory and keep the value.
//   * reload() when the device allocator fails throws OutOfMemory; the host copy
//     is unchanged and may be reloaded later.
//   * a copy that fails raises TransferError at its own wait when the failure
//     is known by then: wait_offload (the storage then stays kResident and is
//     not released, the host copy is dropped) or wait_reload (the reloaded
//     bytes are undefined; the host copy stays and can be reloaded again).
//     Waits do not block the host, so a copy may fail after its wait
//     returned; that failure is raised, once, by the next wait or
//     synchronize() of any value, after that call has done its own work
//     (its storage is in its new state; the error names the failed copy). With
//     `RuntimeOptions::verify_before_release` the waits block the host until
//     the copy is complete, so every failure is raised at its own wait and no
//     device storage is released after a failed D2H.
//
// Stream order without record_stream: a released device storage is handed to
// the device allocator on the compute stream after the compute stream waited
// for every copy that read it; a host block returns to the pinned pool only
// after every stream that used it has passed an event recorded after the use.
//
// Thread-safety: a Runtime may be called from several threads at once; calls
// on one storage or one host handle are ordered by the caller (as a graph
// orders the ops of one tensor).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace spillway {

// A stream as the caller knows it. StreamHandle{} means
// RuntimeOptions::compute_stream. For the CUDA backend `native` is a
// cudaStream_t (nullptr there: the legacy default stream). For the fake
// backend `native` is a pointer returned by
// FakeControls::create_compute_stream(), and nullptr is the calling host
// thread, which runs "kernels" synchronously (torch CPU ops).
struct StreamHandle {
  void* native = nullptr;
};

// Supplies device memory. The default is cudaMallocAsync / cudaFreeAsync on the
// CUDA backend and a bounded arena on the fake one; the torch extension plugs
// in PyTorch's caching allocator so that released memory is reusable by the
// model.
//
// Thread-safety: implementations must accept calls from several threads.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // Returns `bytes` of device memory usable in order on `stream` (a native
  // stream handle of the backend). Throws OutOfMemory, changing nothing, when
  // it cannot.
  virtual void* allocate(std::size_t bytes, void* stream) = 0;
  // Returns memory from allocate(); later work on `stream` may reuse it. Never
  // throws.
  virtual void deallocate(void* ptr, std::size_t bytes, void* stream) noexcept = 0;
};

enum class BackendKind {
  kFake,  // worker threads and a bounded arena; always built
  kCuda,  // the CUDA runtime; throws InvalidArgument when not built
};

// Pinned-host pool options.
struct PinnedPoolOptions {
  // Most pinned bytes the pool may hold (live + cached); 0 = unlimited.
  std::size_t host_budget_bytes = 0;
  // Size-class resolution: each power of two is split into 2^class_bits
  // steps (see Note [Pinned pool reuse] in src/runtime/pinned_pool.h).
  int class_bits = 4;
  // NUMA node for pinned pages: -1 none, -2 the node nearest the GPU, >= 0 that
  // node. Honoured only when built with libnuma; otherwise ignored (the
  // pages land where the OS puts them) and PinnedPoolStats::numa_node is -1.
  int numa_node = -1;
};

// How offload() sizes the pinned block of a host copy.
enum class HostFit {
  // The pool's size class (Note [Pinned pool reuse] in src/runtime/pinned_pool.h):
  // up to 1/2^class_bits larger than the copy, parked for reuse when released.
  kSizeClass,
  // The copy's bytes rounded up to a page, freed (not parked) once released and
  // its streams have passed: for long-lived copies such as weights, whose pinned
  // bytes must match their size.
  kExact,
};

// Copy-engine options.
struct CopyEngineOptions {
  // Transfers larger than this are split into chunks of this size so a later,
  // more urgent transfer can start between chunks. Must be > 0.
  std::size_t chunk_bytes = std::size_t{32} << 20;
  // Most bytes enqueued on one copy stream and not yet complete. Must be >=
  // chunk_bytes.
  std::size_t max_inflight_bytes = std::size_t{96} << 20;
};

// Options of the fake backend (ignored by the CUDA backend).
struct FakeBackendOptions {
  // Capacity of the bounded "device" arena.
  std::size_t device_bytes = std::size_t{1} << 30;
  // Pinned allocations only reserve address space (PROT_NONE); for pool
  // accounting runs at real sizes that never touch the bytes.
  bool unbacked_pinned = false;
};

struct RuntimeOptions {
  BackendKind backend = BackendKind::kFake;
  int device = 0;  // CUDA device ordinal
  // The compute stream used when a call passes StreamHandle{} (CUDA: a
  // cudaStream_t, nullptr = the legacy default stream).
  void* compute_stream = nullptr;
  // Device memory source; nullptr = the backend's default. Not owned; must
  // outlive the Runtime.
  DeviceAllocator* device_allocator = nullptr;
  PinnedPoolOptions pool;
  CopyEngineOptions copy;
  FakeBackendOptions fake;
  // When true, wait_offload / wait_reload block the host until their copy
  // completed, so a copy failure is raised at its own wait and before any
  // device storage is released. Default false: waits only order streams.
  bool verify_before_release = false;
};

using StorageId = std::uint64_t;
inline constexpr StorageId kNoStorage = 0;

enum class StorageState { kResident, kOffloading, kOnHost, kReloading };
const char* to_string(StorageState state);

// A pinned host copy made by offload(). Copyable; the copy lives until
// release_host(). `data` is readable by the host only after wait_offload (or
// synchronize()).
struct HostHandle {
  std::uint64_t id = 0;  // 0 = no handle
  StorageId source = kNoStorage;
  void* data = nullptr;
  std::size_t bytes = 0;
};

// A device storage produced by reload().
struct DeviceValue {
  StorageId storage = kNoStorage;
  void* data = nullptr;
  std::size_t bytes = 0;
};

// Called once when the runtime gives up a device storage it did not allocate:
// `stream` is the native compute stream after whose current point the memory
// is no longer read by any copy. Must not throw; must not call the Runtime.
using ReleaseFn = std::function<void(void* data, std::size_t bytes, void* stream)>;

struct PinnedPoolStats {
  std::size_t bytes_pinned = 0;       // pinned now (live + cached)
  std::size_t bytes_live = 0;         // handed out now (rounded to the class)
  std::size_t bytes_requested = 0;    // handed out now (as requested)
  std::size_t peak_bytes_live = 0;    // max of bytes_live
  std::size_t peak_bytes_requested = 0;
  std::size_t peak_bytes_pinned = 0;
  std::uint64_t pinned_allocations = 0;  // backend pinned allocations so far
  std::uint64_t pinned_frees = 0;
  std::uint64_t reuses = 0;              // requests served from cached blocks
  std::uint64_t requests = 0;
  std::uint64_t budget_refusals = 0;
  int numa_node = -1;  // node the pages were placed on, -1 = not placed
};

struct CopyEngineStats {
  std::uint64_t transfers = 0;
  std::uint64_t chunks = 0;
  std::uint64_t bytes_d2h = 0;
  std::uint64_t bytes_h2d = 0;
};

// Test hooks of the fake backend. Thread-safe.
class FakeControls {
 public:
  virtual ~FakeControls() = default;
  // Role of a fake stream: the runtime's copy streams or a compute stream.
  enum class Role { kCompute, kD2H, kH2D };
  // Before each task, the streams of `role` sleep a random time in
  // [min_us, max_us] drawn from a generator seeded with `seed`.
  virtual void set_delay(Role role, int min_us, int max_us, std::uint64_t seed) = 0;
  // The next `n` device / pinned allocations fail with OutOfMemory.
  virtual void fail_next_device_allocations(int n) = 0;
  virtual void fail_next_pinned_allocations(int n) = 0;
  // The next `n` copies fail when they execute on their stream (their target
  // bytes are scribbled), reported as TransferError at the next sync point.
  virtual void fail_next_copies(int n) = 0;
  // A worker-thread stream that plays a GPU compute stream; owned by the
  // backend, lives as long as the Runtime.
  virtual StreamHandle create_compute_stream() = 0;
  // Enqueues `kernel` on a compute stream (nullptr = run it now).
  virtual void launch(StreamHandle stream, std::function<void()> kernel) = 0;
  // Blocks until everything enqueued on `stream` has run.
  virtual void synchronize(StreamHandle stream) = 0;
  virtual std::size_t device_bytes_in_use() const = 0;
};

// Owns one backend, its pinned pool, copy engine and residency manager.
class Runtime {
 public:
  // Throws InvalidArgument for options out of range or a backend not built,
  // CudaError when the device cannot be set up.
  explicit Runtime(const RuntimeOptions& options);
  // Waits for every copy it started, then frees what it owns. Never throws.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Tracks a caller-owned device storage as kResident. The memory must stay
  // valid until the runtime releases it (this is the `keepalive` of the ao
  // ops): `release` is called once, at wait_offload, release() or the
  // Runtime's destruction; null = the caller frees it after that point.
  StorageId adopt(void* data, std::size_t bytes, ReleaseFn release);
  // Allocates a device storage from the device allocator on `compute`.
  // Throws OutOfMemory.
  DeviceValue allocate(std::size_t bytes, StreamHandle compute = {});

  // Starts the D2H copy of `storage` after `compute`'s current point. The
  // storage becomes kOffloading; `fit` sizes its pinned block. Throws
  // StateError (not kResident), OutOfMemory (no pinned block; storage
  // unchanged), TransferError (enqueue failed; storage unchanged).
  HostHandle offload(StorageId storage, StreamHandle compute = {},
                     HostFit fit = HostFit::kSizeClass);
  // Forward wait: `compute` waits for the D2H, then the device storage of
  // `keepalive` (== handle.source) is released on `compute` and becomes
  // kOnHost. Throws StateError when no D2H is in flight, InvalidArgument when
  // keepalive is not the source, TransferError when the copy failed (storage
  // back to kResident, still on the device, host copy dropped).
  void wait_offload(const HostHandle& handle, StorageId keepalive, StreamHandle compute = {});
  // Allocates a device storage on `compute` and copies the host copy into it on
  // the H2D stream (after the D2H, and after `compute`'s current point).
  // Higher `priority` goes first (a reload needed sooner). A host copy may be
  // reloaded more than once (retain_graph). Throws StateError for an unknown
  // or released handle, OutOfMemory when the allocator fails, TransferError
  // when its D2H is known to have failed (nothing changed in each case).
  DeviceValue reload(const HostHandle& handle, int priority = 0, StreamHandle compute = {});
  // As reload() into caller memory `dst` (>= handle.bytes, usable on
  // `compute`), released through `release` as for adopt().
  DeviceValue reload_into(const HostHandle& handle, void* dst, ReleaseFn release,
                          int priority = 0, StreamHandle compute = {});
  // Backward wait: `compute` waits for the H2D into `storage`, which becomes
  // kResident. Throws StateError when no H2D is in flight, TransferError when
  // the copy (or the D2H that fed it) failed.
  void wait_reload(StorageId storage, StreamHandle compute = {});

  // Releases a device storage now (kResident or kOnHost); it is forgotten.
  // Throws StateError while a copy is in flight.
  void release(StorageId storage, StreamHandle compute = {});
  // Drops a host copy; its pinned block returns to the pool once every copy
  // that used it has completed. Throws StateError for an unknown handle.
  void release_host(const HostHandle& handle);

  StorageState state(StorageId storage) const;  // throws StateError if unknown
  // Blocks until every copy started so far has completed. Throws
  // TransferError for a copy failure no wait has reported yet.
  void synchronize();

  PinnedPoolStats pool_stats() const;
  // Frees the pool's cached blocks, and its released exact blocks, whose copies
  // have completed (what is in use stays). Never throws.
  void trim_pool() noexcept;
  CopyEngineStats copy_stats() const;
  // The fake backend's hooks; nullptr on the CUDA backend.
  FakeControls* fake_controls();
  // Whether this build has the CUDA backend.
  static bool cuda_available();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway
