// Runtime: assembles a backend, its pinned pool, copy engine and residency
// manager, and forwards the public API to them.

#include "spillway/runtime.h"

#include "runtime/backend/backend.h"
#include "runtime/copy_engine.h"
#include "runtime/pinned_pool.h"
#include "runtime/residency_manager.h"
#include "spillway/error.h"

namespace spillway {

const char* to_string(StorageState state) {
  switch (state) {
    case StorageState::kResident: return "resident";
    case StorageState::kOffloading: return "offloading";
    case StorageState::kOnHost: return "on_host";
    case StorageState::kReloading: return "reloading";
  }
  return "unknown";
}

class Runtime::Impl {
 public:
  explicit Impl(const RuntimeOptions& options)
      : backend_(options.backend == BackendKind::kCuda
                     ? runtime::make_cuda_backend(options.device)
                     : runtime::make_fake_backend(options.fake)),
        pool_(*backend_, options.pool),
        engine_(*backend_, options.copy),
        residency_(*backend_, pool_, engine_,
                   options.device_allocator ? *options.device_allocator
                                            : backend_->default_allocator(),
                   options.compute_stream, options.verify_before_release) {}

  // Member order is destruction order in reverse: the residency manager
  // returns its blocks to the pool and drains the engine before either goes.
  std::unique_ptr<runtime::Backend> backend_;
  runtime::PinnedPool pool_;
  runtime::CopyEngine engine_;
  runtime::ResidencyManager residency_;
};

Runtime::Runtime(const RuntimeOptions& options) : impl_(std::make_unique<Impl>(options)) {}
Runtime::~Runtime() = default;

StorageId Runtime::adopt(void* data, std::size_t bytes, ReleaseFn release) {
  return impl_->residency_.adopt(data, bytes, std::move(release));
}
DeviceValue Runtime::allocate(std::size_t bytes, StreamHandle compute) {
  return impl_->residency_.allocate(bytes, compute);
}
HostHandle Runtime::offload(StorageId storage, StreamHandle compute, HostFit fit) {
  return impl_->residency_.offload(storage, compute, fit);
}
void Runtime::wait_offload(const HostHandle& handle, StorageId keepalive, StreamHandle compute) {
  impl_->residency_.wait_offload(handle, keepalive, compute);
}
DeviceValue Runtime::reload(const HostHandle& handle, int priority, StreamHandle compute) {
  return impl_->residency_.reload(handle, nullptr, nullptr, priority, compute);
}
DeviceValue Runtime::reload_into(const HostHandle& handle, void* dst, ReleaseFn release,
                                 int priority, StreamHandle compute) {
  if (!dst) throw InvalidArgument("residency", "reload_into a null destination");
  return impl_->residency_.reload(handle, dst, std::move(release), priority, compute);
}
void Runtime::wait_reload(StorageId storage, StreamHandle compute) {
  impl_->residency_.wait_reload(storage, compute);
}
void Runtime::release(StorageId storage, StreamHandle compute) {
  impl_->residency_.release(storage, compute);
}
void Runtime::release_host(const HostHandle& handle) { impl_->residency_.release_host(handle); }
StorageState Runtime::state(StorageId storage) const { return impl_->residency_.state(storage); }
void Runtime::synchronize() { impl_->residency_.synchronize(); }
PinnedPoolStats Runtime::pool_stats() const { return impl_->pool_.stats(); }
void Runtime::trim_pool() noexcept {
  try {
    impl_->pool_.trim();
  } catch (...) {  // a backend failure while freeing: the blocks stay cached
  }
}
CopyEngineStats Runtime::copy_stats() const { return impl_->engine_.stats(); }
FakeControls* Runtime::fake_controls() { return impl_->backend_->fake_controls(); }
bool Runtime::cuda_available() { return runtime::cuda_backend_built(); }

}  // namespace spillway
