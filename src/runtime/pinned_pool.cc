#include "runtime/pinned_pool.h"

#include <algorithm>
#include <bit>
#include <string>

#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr char kPoolComponent[] = "pinned_pool";
constexpr std::size_t kPage = 4096;

std::size_t round_up(std::size_t n, std::size_t step) { return (n + step - 1) / step * step; }

}  // namespace

std::size_t pinned_class_size(std::size_t bytes, int class_bits) {
  if (bytes <= kPage) return kPage;
  const int log2 = static_cast<int>(std::bit_width(bytes)) - 1;
  std::size_t step = std::size_t{1} << std::max(0, log2 - class_bits);
  return round_up(round_up(bytes, step), kPage);
}

PinnedPool::PinnedPool(Backend& backend, const PinnedPoolOptions& options)
    : backend_(backend), options_(options) {
  if (options.class_bits < 0 || options.class_bits > 10) {
    throw InvalidArgument(kPoolComponent, "class_bits " + std::to_string(options.class_bits) +
                                          " is outside [0, 10]");
  }
  if (options.numa_node < -2) {
    throw InvalidArgument(kPoolComponent,
                          "numa_node " + std::to_string(options.numa_node) + " is below -2");
  }
  numa_node_ = options.numa_node == -2 ? backend.device_numa_node() : options.numa_node;
}

PinnedPool::~PinnedPool() {
  free_retired(/*wait=*/true);
  std::map<std::size_t, std::deque<Parked>> parked;
  {
    std::lock_guard<std::mutex> lock(mu_);
    parked.swap(parked_);
  }
  for (auto& [cls, blocks] : parked) {
    for (Parked& block : blocks) {
      await(block);
      backend_.free_pinned(block.data, block.bytes);
    }
  }
}

bool PinnedPool::ready(Parked& block) {
  for (auto& event : block.events) {
    try {
      if (!backend_.query(*event)) return false;
    } catch (const Error&) {
      // The use failed but is over; the failure belongs to the value it fed.
    }
  }
  return true;
}

void PinnedPool::await(Parked& block) {
  for (auto& event : block.events) {
    try {
      backend_.synchronize(*event);
    } catch (const Error&) {
    }
  }
}

void PinnedPool::recycle(std::vector<std::unique_ptr<Event>> events) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& e : events) spare_events_.push_back(std::move(e));
}

bool PinnedPool::make_room(std::size_t need, std::size_t keep_class) {
  if (options_.host_budget_bytes == 0) return true;
  for (;;) {
    Parked victim;
    bool retired = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stats_.bytes_pinned + need <= options_.host_budget_bytes) return true;
      retired = !retired_.empty();
    }
    if (retired) {  // released exact blocks go first: nobody will ask for them again
      free_retired(/*wait=*/true);
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stats_.bytes_pinned + need <= options_.host_budget_bytes) return true;
      auto it = std::find_if(parked_.begin(), parked_.end(), [&](const auto& entry) {
        return entry.first != keep_class && !entry.second.empty();
      });
      if (it == parked_.end()) {
        // Last resort: parked blocks of our own class are busy (else we would
        // have reused one); nothing more to free.
        return false;
      }
      victim = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) parked_.erase(it);
    }
    await(victim);
    backend_.free_pinned(victim.data, victim.bytes);
    recycle(std::move(victim.events));
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_pinned -= victim.bytes;
    stats_.pinned_frees++;
  }
}

PinnedBlock PinnedPool::allocate(std::size_t bytes, HostFit fit) {
  const bool exact = fit == HostFit::kExact;
  const std::size_t cls =
      exact ? round_up(std::max<std::size_t>(bytes, 1), kPage) : pinned_class_size(bytes, options_.class_bits);
  free_retired(/*wait=*/false);
  Parked candidate;
  bool have_candidate = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.requests++;
    auto it = parked_.find(cls);
    if (it != parked_.end() && !it->second.empty()) {
      candidate = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) parked_.erase(it);
      have_candidate = true;
    }
  }
  if (have_candidate) {
    // Note [Pinned pool reuse]: waiting for a busy block beats pinning a new
    // one (page-locking costs more than the copy still reading the block).
    await(candidate);
    void* data = candidate.data;
    recycle(std::move(candidate.events));
    std::lock_guard<std::mutex> lock(mu_);
    stats_.reuses++;
    stats_.bytes_live += cls;
    stats_.bytes_requested += bytes;
    stats_.peak_bytes_live = std::max(stats_.peak_bytes_live, stats_.bytes_live);
    stats_.peak_bytes_requested = std::max(stats_.peak_bytes_requested, stats_.bytes_requested);
    return PinnedBlock{data, cls, bytes, exact};
  }

  if (options_.host_budget_bytes != 0 && cls > options_.host_budget_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.budget_refusals++;
    throw OutOfMemory(kPoolComponent, "request of " + std::to_string(bytes) +
                                      " bytes exceeds the host budget of " +
                                      std::to_string(options_.host_budget_bytes) + " bytes");
  }
  // Reserve the bytes under the lock so concurrent requests respect the budget.
  for (;;) {
    if (!make_room(cls, cls)) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.budget_refusals++;
      throw OutOfMemory(kPoolComponent,
                        "request of " + std::to_string(bytes) + " bytes (class " +
                            std::to_string(cls) + ") exceeds the host budget of " +
                            std::to_string(options_.host_budget_bytes) + " bytes (" +
                            std::to_string(stats_.bytes_live) + " live)");
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.host_budget_bytes == 0 ||
        stats_.bytes_pinned + cls <= options_.host_budget_bytes) {
      stats_.bytes_pinned += cls;
      break;
    }
  }
  void* data = nullptr;
  int placed = -1;
  try {
    data = backend_.allocate_pinned(cls, numa_node_, &placed);
  } catch (const Error& e) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_pinned -= cls;
    throw OutOfMemory(kPoolComponent, "pinned allocation of " + std::to_string(cls) +
                                      " bytes failed: " + e.what());
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.pinned_allocations++;
  stats_.numa_node = placed;
  stats_.bytes_live += cls;
  stats_.bytes_requested += bytes;
  stats_.peak_bytes_live = std::max(stats_.peak_bytes_live, stats_.bytes_live);
  stats_.peak_bytes_requested = std::max(stats_.peak_bytes_requested, stats_.bytes_requested);
  stats_.peak_bytes_pinned = std::max(stats_.peak_bytes_pinned, stats_.bytes_pinned);
  return PinnedBlock{data, cls, bytes, exact};
}

void PinnedPool::release(PinnedBlock block, const std::vector<Stream*>& used_on) noexcept {
  Parked parked{block.data, block.bytes, {}};
  for (Stream* stream : used_on) {
    std::unique_ptr<Event> event;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!spare_events_.empty()) {
        event = std::move(spare_events_.back());
        spare_events_.pop_back();
      }
    }
    try {
      if (!event) event = backend_.create_event();
      backend_.record(*event, *stream);
      parked.events.push_back(std::move(event));
    } catch (...) {
      // Could not record: wait for the stream now so reuse stays safe.
      try {
        backend_.synchronize(*stream);
      } catch (...) {
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_live -= block.bytes;
    stats_.bytes_requested -= block.requested;
    if (!block.exact) {
      parked_[block.bytes].push_back(std::move(parked));
      return;
    }
    retired_.push_back(std::move(parked));  // Note [Exact blocks]
    any_retired_.store(true, std::memory_order_relaxed);
  }
  free_retired(/*wait=*/false);
}

void PinnedPool::free_retired(bool wait) {
  if (!any_retired_.load(std::memory_order_relaxed)) return;
  std::vector<Parked> candidates;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (retired_.empty()) return;
    candidates.swap(retired_);
    any_retired_.store(false, std::memory_order_relaxed);
  }
  std::vector<Parked> busy;
  for (Parked& block : candidates) {
    if (wait) {
      await(block);
    } else if (!ready(block)) {
      busy.push_back(std::move(block));
      continue;
    }
    backend_.free_pinned(block.data, block.bytes);
    recycle(std::move(block.events));
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_pinned -= block.bytes;
    stats_.pinned_frees++;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (Parked& block : busy) retired_.push_back(std::move(block));
  if (!retired_.empty()) any_retired_.store(true, std::memory_order_relaxed);
}

void PinnedPool::trim() {
  free_retired(/*wait=*/false);
  std::vector<Parked> candidates;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [cls, blocks] : parked_) {
      for (Parked& b : blocks) candidates.push_back(std::move(b));
    }
    parked_.clear();
  }
  for (Parked& block : candidates) {
    if (ready(block)) {
      backend_.free_pinned(block.data, block.bytes);
      recycle(std::move(block.events));
      std::lock_guard<std::mutex> lock(mu_);
      stats_.bytes_pinned -= block.bytes;
      stats_.pinned_frees++;
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      parked_[block.bytes].push_back(std::move(block));
    }
  }
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace spillway::runtime
