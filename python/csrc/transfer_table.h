#pragma once
// The state behind the custom ops spillway::offload / reload / wait_tensor:
// one Runtime per device and the transfers whose wait has not run yet. Torch-
// free: the op kernels (offload_ops.cc) translate tensors into pointers,
// byte counts, streams and release callbacks.
//
// A transfer is found again by the data pointer of the tensor the op returned
// (the host copy of an offload, the device tensor of a reload), like PyTorch's
// ao:: ops, because wait_tensor receives only that tensor.
//
// Invariants:
//   1. Each entry of pending_ is one offload or reload whose wait has not run;
//      its key is the start of the returned tensor's bytes.
//   2. Each entry of hosts_ is a host copy made by offload and not yet dropped;
//      its key is HostHandle::data.
//   3. Runtimes are created on first use and never destroyed: the CUDA driver
//      may be gone before static destructors run, and pinned memory goes back
//      to the OS at exit anyway.
//
// Thread-safety: every method may be called from any thread; mu_ guards the
// maps and is never held while a Runtime is called. Calls concerning one
// tensor are ordered by the caller (as a graph orders the ops of one value).

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "runtime/thread_annotations.h"
#include "spillway/runtime.h"

namespace spillway::python {

// Where an op's "device" memory lives: a CUDA device, or (cuda == false) the
// CPU, served by the fake backend so that CPU tensors take the same path
// through the runtime as CUDA tensors do.
struct DeviceKey {
  bool cuda = false;
  int index = 0;
  bool operator<(const DeviceKey& other) const {
    return cuda != other.cuda ? cuda < other.cuda : index < other.index;
  }
  std::string name() const;  // "cpu" or "cuda:N"
};

class TransferTable {
 public:
  // The process-wide table. Never destroyed.
  static TransferTable& instance();

  // The device allocator of CUDA runtimes created from now on (PyTorch's
  // caching allocator in a CUDA build); null = the backend's default. Not
  // owned; must live forever. Call before the first CUDA op.
  void set_cuda_allocator(DeviceAllocator* allocator);

  // The runtime of `device`, created on first use. Throws InvalidArgument
  // when `device` is CUDA and the build has no CUDA backend.
  Runtime& runtime(DeviceKey device);

  // Starts the D2H copy of `bytes` at `data` after `compute`'s current point.
  // `keep` holds the source storage until the forward wait releases it (the
  // runtime calls it once). Returns the host copy; its wait is pending under
  // handle.data. `fit` sizes the pinned block (HostFit::kExact: a long-lived
  // copy, such as a block's weights). Throws OutOfMemory (no pinned block) or
  // TransferError; then nothing is pending and `keep` has been called.
  HostHandle start_offload(DeviceKey device, void* data, std::size_t bytes, ReleaseFn keep,
                           StreamHandle compute, HostFit fit = HostFit::kSizeClass);

  // Starts the H2D copy of the host copy at `host_data` (made by
  // start_offload, `bytes` long) into `dst` on `device`, after `compute`'s
  // current point; `keep` holds `dst` until the backward wait. The wait is
  // pending under `dst`. Throws StateError when `host_data` is not a live host
  // copy of `bytes` bytes, TransferError when its D2H failed.
  void start_reload(DeviceKey device, const void* host_data, std::size_t bytes, void* dst,
                    ReleaseFn keep, StreamHandle compute);

  // The device of the transfer pending under `data`; throws StateError when
  // there is none.
  DeviceKey pending_device(const void* data) const;

  // Runs the wait pending under `data` on `compute` and forgets it:
  //   offload: compute waits for the D2H; the source storage is released.
  //   reload:  compute waits for the H2D; the destination is left to its
  //            tensor (the runtime's hold on it is dropped).
  // Throws StateError when nothing is pending, TransferError when the copy
  // failed (an offload's source then stays alive, held by its tensor).
  void wait(const void* data, StreamHandle compute);

  // The host copy at `host_data` is no longer referenced (its tensor died): its
  // pending wait, if any, runs on the device's default compute stream, then its
  // pinned block goes back to the pool. Never throws.
  void drop_host(DeviceKey device, const void* host_data) noexcept;

  // Blocks until every copy started so far completed, on every device.
  void synchronize();
  // Number of transfers whose wait has not run.
  std::size_t pending_count() const;
  // Runtime statistics of `device` (zeros if never used).
  PinnedPoolStats pool_stats(DeviceKey device) const;
  // Runtime::trim_pool of `device`'s runtime, if it exists.
  void trim_pool(DeviceKey device);
  CopyEngineStats copy_stats(DeviceKey device) const;

 private:
  TransferTable() = default;

  enum class Kind { kOffload, kReload };
  struct Pending {
    Kind kind = Kind::kOffload;
    DeviceKey device;
    HostHandle host;            // kOffload: the copy being made
    StorageId storage = kNoStorage;  // kOffload: the source; kReload: the destination
  };
  struct Host {
    DeviceKey device;
    HostHandle handle;
  };

  Runtime* find_runtime(DeviceKey device) const;

  mutable std::mutex mu_;
  DeviceAllocator* cuda_allocator_ GUARDED_BY(mu_) = nullptr;
  std::map<DeviceKey, std::unique_ptr<Runtime>> runtimes_ GUARDED_BY(mu_);
  std::unordered_map<const void*, Pending> pending_ GUARDED_BY(mu_);
  std::unordered_map<const void*, Host> hosts_ GUARDED_BY(mu_);
};

}  // namespace spillway::python
