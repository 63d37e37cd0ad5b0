#pragma once
// The residency manager: per-storage state machine of offload / wait / reload
// / wait on raw device buffers (see include/spillway/runtime.h for the
// contract the public Runtime forwards to it).
//
// Invariants:
//   1. A storage in kOffloading has exactly one host copy whose D2H is in
//      flight; its device bytes stay allocated until wait_offload.
//   2. A storage in kOnHost holds no device memory.
//   3. A storage in kReloading has one H2D in flight into its device memory.
//   4. A host copy's pinned block returns to the pool only through
//      PinnedPool::release, after every transfer that used it was enqueued,
//      with events on both copy streams.
//   5. Device memory is released (ReleaseFn or DeviceAllocator) on the compute
//      stream of the call, after that stream waited for every copy reading it.
//   6. mu_ guards the maps and every record's fields; the backend, the pool,
//      the engine, allocators and release callbacks are called without mu_.
//
// Thread-safety: all methods may be called from any thread; the caller orders
// the calls on one storage.

#include <memory>
#include <mutex>
#include <unordered_map>

#include "runtime/backend/backend.h"
#include "runtime/copy_engine.h"
#include "runtime/pinned_pool.h"
#include "runtime/thread_annotations.h"
#include "spillway/runtime.h"

namespace spillway::runtime {

class ResidencyManager {
 public:
  // All references must outlive the manager.
  ResidencyManager(Backend& backend, PinnedPool& pool, CopyEngine& engine,
                   DeviceAllocator& allocator, void* default_compute, bool verify_before_release);
  // Waits for every copy, releases every tracked storage and host copy.
  ~ResidencyManager();

  StorageId adopt(void* data, std::size_t bytes, ReleaseFn release);
  DeviceValue allocate(std::size_t bytes, StreamHandle compute);
  HostHandle offload(StorageId storage, StreamHandle compute, HostFit fit = HostFit::kSizeClass);
  void wait_offload(const HostHandle& handle, StorageId keepalive, StreamHandle compute);
  DeviceValue reload(const HostHandle& handle, void* dst, ReleaseFn release, int priority,
                     StreamHandle compute);
  void wait_reload(StorageId storage, StreamHandle compute);
  void release(StorageId storage, StreamHandle compute);
  void release_host(const HostHandle& handle);
  StorageState state(StorageId storage) const;
  void synchronize();

 private:
  struct HostCopy;
  struct Record {
    void* data = nullptr;
    std::size_t bytes = 0;
    ReleaseFn release;        // null with owned_by_allocator: use allocator_
    bool owned_by_allocator = false;
    StorageState state = StorageState::kResident;
    TransferPtr transfer;     // the D2H out of it (kOffloading) or H2D into it (kReloading)
    std::uint64_t host = 0;   // the host copy being made (kOffloading)
    void* last_stream = nullptr;  // native compute stream of the last call on it
  };
  struct HostCopy {
    StorageId source = kNoStorage;
    PinnedBlock block;
    std::size_t bytes = 0;
    TransferPtr d2h;
    std::vector<TransferPtr> h2d;  // reloads that read this copy
  };

  std::unique_ptr<Stream> compute_stream(StreamHandle compute);
  void free_device(Record& record, void* stream) noexcept;
  void return_block(HostCopy& copy) noexcept;
  // Raises (as TransferError) a copy failure no wait has reported yet,
  // except one of `own` (see CopyEngine::check_failures).
  void check_earlier_failures(const Transfer* own = nullptr);

  Backend& backend_;
  PinnedPool& pool_;
  CopyEngine& engine_;
  DeviceAllocator& allocator_;
  void* default_compute_;
  const bool verify_before_release_;

  mutable std::mutex mu_;
  StorageId next_storage_ GUARDED_BY(mu_) = 1;
  std::uint64_t next_host_ GUARDED_BY(mu_) = 1;
  std::unordered_map<StorageId, std::shared_ptr<Record>> storages_ GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, std::shared_ptr<HostCopy>> hosts_ GUARDED_BY(mu_);
};

}  // namespace spillway::runtime
