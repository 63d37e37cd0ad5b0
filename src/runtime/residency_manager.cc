#include "runtime/residency_manager.h"

#include <string>

#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr char kResidencyComponent[] = "residency";

std::string storage_name(StorageId id) { return "storage " + std::to_string(id); }
std::string host_name(std::uint64_t id) { return "host copy " + std::to_string(id); }

}  // namespace

ResidencyManager::ResidencyManager(Backend& backend, PinnedPool& pool, CopyEngine& engine,
                                   DeviceAllocator& allocator, void* default_compute,
                                   bool verify_before_release)
    : backend_(backend),
      pool_(pool),
      engine_(engine),
      allocator_(allocator),
      default_compute_(default_compute),
      verify_before_release_(verify_before_release) {}

ResidencyManager::~ResidencyManager() {
  engine_.drain();
  std::unordered_map<StorageId, std::shared_ptr<Record>> storages;
  std::unordered_map<std::uint64_t, std::shared_ptr<HostCopy>> hosts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    storages.swap(storages_);
    hosts.swap(hosts_);
  }
  for (auto& [id, copy] : hosts) return_block(*copy);
  std::unique_ptr<Stream> compute;
  try {
    compute = compute_stream({});
  } catch (...) {
  }
  for (auto& [id, record] : storages) {
    // On the stream that last used it, so the free is ordered after that use.
    free_device(*record, record->last_stream ? record->last_stream
                         : compute            ? compute->native()
                                              : nullptr);
  }
  if (compute) {
    try {
      backend_.synchronize(*compute);
    } catch (...) {
    }
  }
}

std::unique_ptr<Stream> ResidencyManager::compute_stream(StreamHandle compute) {
  return backend_.wrap_stream(compute.native ? compute.native : default_compute_);
}

void ResidencyManager::free_device(Record& record, void* stream) noexcept {
  if (!record.data) return;
  void* data = record.data;
  record.data = nullptr;
  if (record.owned_by_allocator) {
    allocator_.deallocate(data, record.bytes, stream);
  } else if (record.release) {
    try {
      record.release(data, record.bytes, stream);
    } catch (...) {
      // A ReleaseFn must not throw; there is no one to report to here.
    }
  }
}

void ResidencyManager::return_block(HostCopy& copy) noexcept {
  // Invariant 4: every transfer touching the block must be on its stream
  // before the events are recorded.
  auto enqueued = [&](const TransferPtr& t) {
    if (!t) return;
    try {
      engine_.wait_enqueued(t);
    } catch (...) {
    }
  };
  enqueued(copy.d2h);
  for (auto& t : copy.h2d) enqueued(t);
  pool_.release(copy.block, {&engine_.stream(CopyKind::kDeviceToHost),
                             &engine_.stream(CopyKind::kHostToDevice)});
  copy.block = PinnedBlock{};
}

StorageId ResidencyManager::adopt(void* data, std::size_t bytes, ReleaseFn release) {
  if (!data && bytes > 0) {
    throw InvalidArgument(kResidencyComponent, "adopt of " + std::to_string(bytes) +
                                          " bytes at a null pointer");
  }
  auto record = std::make_shared<Record>();
  record->data = data;
  record->bytes = bytes;
  record->release = std::move(release);
  std::lock_guard<std::mutex> lock(mu_);
  StorageId id = next_storage_++;
  storages_[id] = std::move(record);
  return id;
}

DeviceValue ResidencyManager::allocate(std::size_t bytes, StreamHandle compute) {
  auto stream = compute_stream(compute);
  void* data = allocator_.allocate(bytes, stream->native());
  auto record = std::make_shared<Record>();
  record->data = data;
  record->bytes = bytes;
  record->owned_by_allocator = true;
  record->last_stream = stream->native();
  std::lock_guard<std::mutex> lock(mu_);
  StorageId id = next_storage_++;
  storages_[id] = std::move(record);
  return DeviceValue{id, data, bytes};
}

HostHandle ResidencyManager::offload(StorageId storage, StreamHandle compute, HostFit fit) {
  std::shared_ptr<Record> record;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = storages_.find(storage);
    if (it == storages_.end()) {
      throw StateError(kResidencyComponent, "offload of unknown " + storage_name(storage));
    }
    record = it->second;
    if (record->state != StorageState::kResident) {
      throw StateError(kResidencyComponent, "second offload of " + storage_name(storage) + ": it is " +
                                       to_string(record->state));
    }
    record->state = StorageState::kOffloading;  // claimed; restored on failure
  }
  PinnedBlock block;
  try {
    block = pool_.allocate(record->bytes, fit);
    auto stream = compute_stream(compute);
    std::shared_ptr<Event> after = backend_.create_event();
    backend_.record(*after, *stream);  // the compute stream's current point
    TransferPtr t = engine_.submit(CopyKind::kDeviceToHost, block.data, record->data,
                                   record->bytes, /*priority=*/0, {after});
    record->last_stream = stream->native();
    auto copy = std::make_shared<HostCopy>();
    copy->source = storage;
    copy->block = block;
    copy->bytes = record->bytes;
    copy->d2h = t;
    std::lock_guard<std::mutex> lock(mu_);
    std::uint64_t id = next_host_++;
    hosts_[id] = copy;
    record->transfer = t;
    record->host = id;
    return HostHandle{id, storage, block.data, record->bytes};
  } catch (...) {
    if (block.data) pool_.release(block, {});  // nothing was enqueued on it
    std::lock_guard<std::mutex> lock(mu_);
    record->state = StorageState::kResident;
    throw;
  }
}

void ResidencyManager::wait_offload(const HostHandle& handle, StorageId keepalive,
                                    StreamHandle compute) {
  std::shared_ptr<Record> record;
  std::shared_ptr<HostCopy> copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto h = hosts_.find(handle.id);
    if (h == hosts_.end()) {
      throw StateError(kResidencyComponent, "wait on " + host_name(handle.id) +
                                       ": no offload produced it, or it was released");
    }
    copy = h->second;
    if (keepalive != copy->source) {
      throw InvalidArgument(kResidencyComponent, "wait on " + host_name(handle.id) + ": keepalive " +
                                            storage_name(keepalive) + " is not its source " +
                                            storage_name(copy->source));
    }
    auto s = storages_.find(copy->source);
    if (s == storages_.end() || s->second->state != StorageState::kOffloading ||
        s->second->host != handle.id) {
      throw StateError(kResidencyComponent,
                       "wait on " + host_name(handle.id) + " of " + storage_name(copy->source) +
                           ": no offload in flight (" +
                           (s == storages_.end() ? std::string("storage released")
                                                 : std::string("storage is ") +
                                                       to_string(s->second->state)) +
                           ")");
    }
    record = s->second;
  }
  auto stream = compute_stream(compute);
  auto give_up = [&](const TransferError& e) {
    // Nothing is lost: the device storage stays; the host copy is dropped.
    engine_.finish(copy->d2h);  // no chunk reads the storage once we return
    {
      std::lock_guard<std::mutex> lock(mu_);
      record->state = StorageState::kResident;
      record->transfer.reset();
      record->host = 0;
      hosts_.erase(handle.id);
    }
    return_block(*copy);
    return TransferError(kResidencyComponent, "offload of " + storage_name(copy->source) +
                                         " failed; it stays on the device: " + e.what());
  };
  try {
    engine_.wait_enqueued(copy->d2h);
    engine_.poll(copy->d2h);
  } catch (const TransferError& e) {
    throw give_up(e);
  }
  try {
    if (verify_before_release_) engine_.synchronize(copy->d2h);
    engine_.make_wait(*stream, copy->d2h);
  } catch (const TransferError& e) {
    throw give_up(e);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    record->state = StorageState::kOnHost;
    record->transfer.reset();
    record->host = 0;
  }
  free_device(*record, stream->native());
  // This wait is complete; report another copy's failure. Not our own D2H: if
  // it failed after the checks above, the storage is already released, so
  // raising it here would break "a failed wait_offload keeps the storage
  // kResident". It counts as failing after this wait returned and is raised,
  // once, by the next wait, reload or synchronize().
  check_earlier_failures(copy->d2h.get());
}

DeviceValue ResidencyManager::reload(const HostHandle& handle, void* dst, ReleaseFn release,
                                     int priority, StreamHandle compute) {
  std::shared_ptr<HostCopy> copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto h = hosts_.find(handle.id);
    if (h == hosts_.end()) {
      throw StateError(kResidencyComponent, "reload of " + host_name(handle.id) +
                                       ": nothing was offloaded to it, or it was released");
    }
    copy = h->second;
  }
  auto stream = compute_stream(compute);
  const bool own = dst == nullptr;
  if (own) dst = allocator_.allocate(copy->bytes, stream->native());
  auto record = std::make_shared<Record>();
  record->data = dst;
  record->bytes = copy->bytes;
  record->owned_by_allocator = own;
  record->release = std::move(release);
  record->state = StorageState::kReloading;
  record->last_stream = stream->native();
  try {
    engine_.wait_enqueued(copy->d2h);  // its `done` is recorded: the H2D can wait on it
    engine_.poll(copy->d2h);           // a D2H known to have failed feeds nothing
    std::shared_ptr<Event> allocated = backend_.create_event();
    backend_.record(*allocated, *stream);  // the allocation point on compute
    record->transfer = engine_.submit(CopyKind::kHostToDevice, dst, copy->block.data,
                                      copy->bytes, priority, {allocated, copy->d2h->done()});
  } catch (const TransferError& e) {
    record->state = StorageState::kResident;
    free_device(*record, stream->native());
    throw TransferError(kResidencyComponent, "reload of " + host_name(handle.id) + " of " +
                                        storage_name(copy->source) + " failed: " + e.what());
  } catch (...) {
    record->state = StorageState::kResident;
    free_device(*record, stream->native());
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  copy->h2d.push_back(record->transfer);
  StorageId id = next_storage_++;
  storages_[id] = record;
  return DeviceValue{id, dst, copy->bytes};
}

void ResidencyManager::wait_reload(StorageId storage, StreamHandle compute) {
  std::shared_ptr<Record> record;
  TransferPtr t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = storages_.find(storage);
    if (it == storages_.end()) {
      throw StateError(kResidencyComponent, "wait on unknown " + storage_name(storage));
    }
    record = it->second;
    if (record->state != StorageState::kReloading) {
      throw StateError(kResidencyComponent, "wait on " + storage_name(storage) +
                                       ": no reload in flight (it is " +
                                       to_string(record->state) + ")");
    }
    t = record->transfer;
  }
  auto stream = compute_stream(compute);
  auto fail = [&](const TransferError& e) {
    engine_.finish(t);  // no chunk writes the storage once the caller may free it
    {
      std::lock_guard<std::mutex> lock(mu_);
      record->state = StorageState::kResident;
      record->transfer.reset();
    }
    return TransferError(kResidencyComponent, "reload into " + storage_name(storage) +
                                         " failed; its bytes are undefined, release it: " +
                                         e.what());
  };
  try {
    engine_.wait_enqueued(t);
    engine_.poll(t);
  } catch (const TransferError& e) {
    throw fail(e);
  }
  try {
    if (verify_before_release_) engine_.synchronize(t);
    engine_.make_wait(*stream, t);
  } catch (const TransferError& e) {
    throw fail(e);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    record->state = StorageState::kResident;
    record->transfer.reset();
  }
  check_earlier_failures();  // this wait is complete; report another copy's failure
}

void ResidencyManager::release(StorageId storage, StreamHandle compute) {
  std::shared_ptr<Record> record;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = storages_.find(storage);
    if (it == storages_.end()) {
      throw StateError(kResidencyComponent, "release of unknown " + storage_name(storage));
    }
    if (it->second->state == StorageState::kOffloading ||
        it->second->state == StorageState::kReloading) {
      throw StateError(kResidencyComponent, "release of " + storage_name(storage) +
                                       " while its copy is in flight (" +
                                       to_string(it->second->state) + "); wait first");
    }
    record = it->second;
    storages_.erase(it);
  }
  auto stream = compute_stream(compute);
  free_device(*record, stream->native());
}

void ResidencyManager::release_host(const HostHandle& handle) {
  std::shared_ptr<HostCopy> copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto h = hosts_.find(handle.id);
    if (h == hosts_.end()) {
      throw StateError(kResidencyComponent, "release of unknown " + host_name(handle.id));
    }
    auto s = storages_.find(h->second->source);
    if (s != storages_.end() && s->second->state == StorageState::kOffloading &&
        s->second->host == handle.id) {
      throw StateError(kResidencyComponent, "release of " + host_name(handle.id) + " while the copy of " +
                                       storage_name(h->second->source) +
                                       " into it is in flight; wait first");
    }
    copy = h->second;
    hosts_.erase(h);
  }
  return_block(*copy);
}

StorageState ResidencyManager::state(StorageId storage) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = storages_.find(storage);
  if (it == storages_.end()) throw StateError(kResidencyComponent, "unknown " + storage_name(storage));
  return it->second->state;
}

void ResidencyManager::synchronize() {
  engine_.drain();
  check_earlier_failures();
}

void ResidencyManager::check_earlier_failures(const Transfer* own) {
  try {
    engine_.check_failures(own);
  } catch (const TransferError& e) {
    throw TransferError(kResidencyComponent,
                        std::string("an earlier copy failed after its own wait; the value it "
                                    "fed is lost: ") +
                            e.what());
  }
}

}  // namespace spillway::runtime
