#include "transfer_table.h"

#include <cstdio>
#include <sstream>
#include <vector>

#include "spillway/error.h"

namespace spillway::python {
namespace {

constexpr char kComponent[] = "ops";

std::string address(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

}  // namespace

std::string DeviceKey::name() const { return cuda ? "cuda:" + std::to_string(index) : "cpu"; }

TransferTable& TransferTable::instance() {
  static TransferTable* table = new TransferTable();  // Invariant 3: never destroyed
  return *table;
}

void TransferTable::set_cuda_allocator(DeviceAllocator* allocator) {
  std::lock_guard<std::mutex> lock(mu_);
  cuda_allocator_ = allocator;
}

Runtime& TransferTable::runtime(DeviceKey device) {
  DeviceAllocator* cuda_allocator = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = runtimes_.find(device);
    if (it != runtimes_.end()) return *it->second;
    cuda_allocator = cuda_allocator_;
  }
  RuntimeOptions options;
  if (device.cuda) {
    options.backend = BackendKind::kCuda;
    options.device = device.index;
    options.device_allocator = cuda_allocator;
  } else {
    // CPU tensors are the "device" memory: the fake backend's arena is unused
    // (sources are adopted, reload targets are torch tensors), so keep it small.
    options.backend = BackendKind::kFake;
    options.fake.device_bytes = std::size_t{1} << 20;
  }
  auto created = std::make_unique<Runtime>(options);  // outside mu_: may call CUDA
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = runtimes_.emplace(device, std::move(created));
  // A second thread that created one meanwhile loses its copy (freed here).
  return *it->second;
}

Runtime* TransferTable::find_runtime(DeviceKey device) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runtimes_.find(device);
  return it == runtimes_.end() ? nullptr : it->second.get();
}

HostHandle TransferTable::start_offload(DeviceKey device, void* data, std::size_t bytes,
                                        ReleaseFn keep, StreamHandle compute, HostFit fit) {
  Runtime& rt = runtime(device);
  StorageId source = rt.adopt(data, bytes, std::move(keep));
  HostHandle handle;
  try {
    handle = rt.offload(source, compute, fit);
  } catch (...) {
    rt.release(source, compute);  // kResident: calls `keep`, nothing else to undo
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  pending_[handle.data] = Pending{Kind::kOffload, device, handle, source};
  hosts_[handle.data] = Host{device, handle};
  return handle;
}

void TransferTable::start_reload(DeviceKey device, const void* host_data, std::size_t bytes,
                                 void* dst, ReleaseFn keep, StreamHandle compute) {
  HostHandle handle;
  DeviceKey source_device;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = hosts_.find(host_data);
    if (it == hosts_.end()) {
      throw StateError(kComponent, "reload of the host tensor at " + address(host_data) +
                                       ": spillway::offload did not make it, or it was freed");
    }
    if (it->second.handle.bytes != bytes) {
      throw StateError(kComponent, "reload of the host tensor at " + address(host_data) +
                                       ": it has " + std::to_string(bytes) +
                                       " bytes but the host copy there has " +
                                       std::to_string(it->second.handle.bytes));
    }
    handle = it->second.handle;
    source_device = it->second.device;
  }
  if (source_device.cuda != device.cuda) {
    throw InvalidArgument(kComponent, "reload to " + device.name() + " of a host copy made from " +
                                          source_device.name() +
                                          ": a host copy returns to the kind of device it left");
  }
  // The copy engine of the runtime that owns the pinned block does the H2D; a
  // copy between two CUDA devices goes through the source device's runtime.
  Runtime& rt = runtime(source_device);
  DeviceValue value = rt.reload_into(handle, dst, std::move(keep), /*priority=*/0, compute);
  std::lock_guard<std::mutex> lock(mu_);
  pending_[dst] = Pending{Kind::kReload, source_device, HostHandle{}, value.storage};
}

DeviceKey TransferTable::pending_device(const void* data) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(data);
  if (it == pending_.end()) {
    throw StateError(kComponent,
                     "wait_tensor on the tensor at " + address(data) +
                         ": no offload or reload into it is in flight (each wait_tensor pairs "
                         "with one spillway::offload or spillway::reload and runs once)");
  }
  return it->second.device;
}

void TransferTable::wait(const void* data, StreamHandle compute) {
  Pending pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(data);
    if (it == pending_.end()) {
      throw StateError(kComponent, "wait_tensor on the tensor at " + address(data) +
                                       ": no offload or reload into it is in flight");
    }
    pending = it->second;
    // Forgotten before the wait: a failed wait is not retried (the runtime has
    // already restored the storage's state and reported the failure).
    pending_.erase(it);
  }
  Runtime* rt = find_runtime(pending.device);
  if (pending.kind == Kind::kOffload) {
    rt->wait_offload(pending.host, pending.storage, compute);
    return;
  }
  try {
    rt->wait_reload(pending.storage, compute);
  } catch (...) {
    rt->release(pending.storage, compute);
    throw;
  }
  rt->release(pending.storage, compute);  // the tensor keeps the memory
}

void TransferTable::drop_host(DeviceKey device, const void* host_data) noexcept {
  Host host;
  bool waiting = false;
  Pending pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto h = hosts_.find(host_data);
    if (h == hosts_.end()) return;
    host = h->second;
    hosts_.erase(h);
    auto p = pending_.find(host_data);
    if (p != pending_.end()) {
      waiting = true;
      pending = p->second;
      pending_.erase(p);
    }
  }
  Runtime* rt = find_runtime(device);
  if (!rt) return;
  try {
    if (waiting) {
      // Its wait never ran: block until the D2H is done so the source is not
      // released under a running copy, then let the runtime release it.
      rt->synchronize();
      rt->wait_offload(pending.host, pending.storage, {});
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[ops] dropping the host copy at %p: %s\n", host_data, e.what());
  }
  try {
    rt->release_host(host.handle);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[ops] dropping the host copy at %p: %s\n", host_data, e.what());
  }
}

void TransferTable::synchronize() {
  std::vector<Runtime*> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, rt] : runtimes_) all.push_back(rt.get());
  }
  for (Runtime* rt : all) rt->synchronize();
}

std::size_t TransferTable::pending_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

void TransferTable::trim_pool(DeviceKey device) {
  if (Runtime* rt = find_runtime(device)) rt->trim_pool();
}

PinnedPoolStats TransferTable::pool_stats(DeviceKey device) const {
  Runtime* rt = find_runtime(device);
  return rt ? rt->pool_stats() : PinnedPoolStats{};
}

CopyEngineStats TransferTable::copy_stats(DeviceKey device) const {
  Runtime* rt = find_runtime(device);
  return rt ? rt->copy_stats() : CopyEngineStats{};
}

}  // namespace spillway::python
