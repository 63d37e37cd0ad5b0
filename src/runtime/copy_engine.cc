#include "runtime/copy_engine.h"

#include <algorithm>
#include <climits>
#include <string>

#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr char kEngineComponent[] = "copy_engine";

const char* direction(CopyKind kind) {
  return kind == CopyKind::kDeviceToHost ? "device-to-host" : "host-to-device";
}

}  // namespace

// One direction: its stream, its queue and its dispatcher thread.
struct CopyEngine::Lane {
  CopyKind kind;
  std::unique_ptr<Stream> stream;
  std::vector<TransferPtr> pending;  // guarded by CopyEngine::mu_
  std::size_t busy = 0;              // transfers taken by the dispatcher, guarded by mu_
  std::deque<TransferPtr> outstanding;  // enqueued, not seen complete; guarded by mu_
  std::thread worker;
};

CopyEngine::CopyEngine(Backend& backend, const CopyEngineOptions& options)
    : backend_(backend), options_(options) {
  if (options.chunk_bytes == 0) {
    throw InvalidArgument(kEngineComponent, "chunk_bytes must be > 0");
  }
  if (options.max_inflight_bytes < options.chunk_bytes) {
    throw InvalidArgument(kEngineComponent, "max_inflight_bytes " +
                                          std::to_string(options.max_inflight_bytes) +
                                          " is below chunk_bytes " +
                                          std::to_string(options.chunk_bytes));
  }
  const CopyKind kinds[2] = {CopyKind::kDeviceToHost, CopyKind::kHostToDevice};
  for (int i = 0; i < 2; ++i) {
    lanes_[i] = std::make_unique<Lane>();
    lanes_[i]->kind = kinds[i];
    lanes_[i]->stream = backend_.create_stream(
        i == 0 ? FakeControls::Role::kD2H : FakeControls::Role::kH2D);
  }
  for (auto& lane : lanes_) {
    Lane* l = lane.get();
    l->worker = std::thread([this, l] { dispatch(*l); });
  }
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& lane : lanes_) lane->worker.join();
  for (auto& lane : lanes_) {
    try {
      backend_.synchronize(*lane->stream);
    } catch (...) {
    }
  }
}

Stream& CopyEngine::stream(CopyKind kind) {
  return *lanes_[kind == CopyKind::kDeviceToHost ? 0 : 1]->stream;
}

TransferPtr CopyEngine::submit(CopyKind kind, void* dst, const void* src, std::size_t bytes,
                               int priority, std::vector<std::shared_ptr<Event>> after) {
  auto t = std::make_shared<Transfer>();
  t->kind_ = kind;
  t->dst_ = static_cast<char*>(dst);
  t->src_ = static_cast<const char*>(src);
  t->bytes_ = bytes;
  t->after_ = std::move(after);
  t->done_ = backend_.create_event();
  Lane& lane = *lanes_[kind == CopyKind::kDeviceToHost ? 0 : 1];
  {
    std::lock_guard<std::mutex> lock(mu_);
    t->priority_ = priority;
    t->seq_ = next_seq_++;
    lane.pending.push_back(t);
    stats_.transfers++;
  }
  cv_.notify_all();
  return t;
}

void CopyEngine::dispatch(Lane& lane) {
  try {
    backend_.bind_thread();
  } catch (...) {
    // Enqueues below fail and mark their transfers failed.
  }
  struct InFlight {
    std::shared_ptr<Event> event;
    std::size_t bytes;
  };
  std::deque<InFlight> inflight;
  std::size_t inflight_bytes = 0;
  for (;;) {
    TransferPtr t;
    std::size_t offset = 0, length = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !lane.pending.empty(); });
      if (lane.pending.empty()) break;  // stopping and drained
      auto best = std::min_element(lane.pending.begin(), lane.pending.end(),
                                   [](const TransferPtr& a, const TransferPtr& b) {
                                     if (a->priority_ != b->priority_)
                                       return a->priority_ > b->priority_;
                                     return a->seq_ < b->seq_;
                                   });
      t = *best;
      offset = t->next_offset_;
      length = std::min(options_.chunk_bytes, t->bytes_ - offset);
      t->next_offset_ = offset + length;
      if (t->next_offset_ >= t->bytes_) lane.pending.erase(best);
      lane.busy++;
    }
    // Invariant 2: bound the bytes in flight before adding this chunk.
    while (!inflight.empty() && inflight_bytes + length > options_.max_inflight_bytes) {
      try {
        backend_.synchronize(*inflight.front().event);
      } catch (...) {
        // The failure belongs to the transfer; it surfaces at its wait.
      }
      inflight_bytes -= inflight.front().bytes;
      inflight.pop_front();
    }
    std::exception_ptr error;
    bool last = offset + length >= t->bytes_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      error = t->error_;
    }
    if (!error) {
      try {
        if (offset == 0) {
          for (auto& e : t->after_) backend_.wait(*lane.stream, *e);
        }
        if (length > 0) {
          backend_.copy(t->dst_ + offset, t->src_ + offset, length, lane.kind, *lane.stream);
        }
        std::shared_ptr<Event> event = last ? t->done_ : backend_.create_event();
        backend_.record(*event, *lane.stream);
        t->chunk_events_.push_back(event);
        if (length > 0) {
          inflight.push_back({std::move(event), length});
          inflight_bytes += length;
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      lane.busy--;
      if (error && !t->error_) t->error_ = error;
      if (error || last) {
        if (!t->enqueued_) {
          std::erase(lane.pending, t);  // skip the rest of a failed transfer
          t->enqueued_ = true;
          lane.outstanding.push_back(t);
        }
      }
      stats_.chunks++;
      (lane.kind == CopyKind::kDeviceToHost ? stats_.bytes_d2h : stats_.bytes_h2d) += length;
    }
    cv_.notify_all();
  }
}

TransferError CopyEngine::failure(const Transfer& t, const std::exception_ptr& e) const {
  std::string what = "unknown error";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    what = ex.what();
  } catch (...) {
  }
  return TransferError(kEngineComponent, std::string(direction(t.kind_)) + " copy of " +
                                       std::to_string(t.bytes_) + " bytes failed: " + what);
}

void CopyEngine::wait_enqueued(const TransferPtr& t) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!t->enqueued_) {
      t->priority_ = INT_MAX;
      cv_.notify_all();
      cv_.wait(lock, [&] { return t->enqueued_; });
    }
  }
  raise_if_failed(t);
}

bool CopyEngine::probe(const TransferPtr& t) {
  bool complete = true;
  for (const auto& event : t->chunk_events_) {
    try {
      if (!backend_.query(*event)) complete = false;
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!t->error_) t->error_ = std::current_exception();
    }
  }
  return complete;
}

void CopyEngine::raise_if_failed(const TransferPtr& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!t->error_) return;
  t->reported_ = true;
  throw failure(*t, t->error_);
}

void CopyEngine::make_wait(Stream& stream, const TransferPtr& t) {
  wait_enqueued(t);
  poll(t);  // raise a failure already known
  try {
    backend_.wait(stream, *t->done_);
  } catch (const TransferError&) {
    throw;
  } catch (...) {
    throw failure(*t, std::current_exception());
  }
}

bool CopyEngine::poll(const TransferPtr& t) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!t->enqueued_ && !t->error_) return false;
  }
  bool complete = probe(t);
  raise_if_failed(t);
  return complete;
}

void CopyEngine::synchronize(const TransferPtr& t) {
  wait_enqueued(t);
  for (const auto& event : t->chunk_events_) {
    try {
      backend_.synchronize(*event);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!t->error_) t->error_ = std::current_exception();
    }
  }
  raise_if_failed(t);
}

void CopyEngine::finish(const TransferPtr& t) noexcept {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!t->enqueued_) {
      t->priority_ = INT_MAX;
      cv_.notify_all();
      cv_.wait(lock, [&] { return t->enqueued_; });
    }
  }
  for (const auto& event : t->chunk_events_) {
    try {
      backend_.synchronize(*event);
    } catch (...) {
    }
  }
}

void CopyEngine::check_failures(const Transfer* spare) {
  for (auto& lane : lanes_) {
    // Index walk: a skipped `spare` stays on the list. If another thread
    // removes an entry meanwhile, one transfer may be looked at only by a
    // later check; none is ever dropped unreported.
    for (std::size_t i = 0;;) {
      TransferPtr t;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (i >= lane->outstanding.size()) break;
        t = lane->outstanding[i];
      }
      bool complete = probe(t);
      bool failed = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        failed = t->error_ != nullptr;
        if (failed && !t->reported_ && t.get() == spare) {
          ++i;  // kept for a later check
          continue;
        }
        if (complete || failed) {
          auto it = std::find(lane->outstanding.begin(), lane->outstanding.end(), t);
          if (it != lane->outstanding.end()) lane->outstanding.erase(it);
        }
        if (failed && !t->reported_) {
          t->reported_ = true;
          throw failure(*t, t->error_);
        }
      }
      if (!complete && !failed) break;  // later transfers on this lane run after it
    }
  }
}

void CopyEngine::drain() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      return std::all_of(std::begin(lanes_), std::end(lanes_), [](const auto& lane) {
        return lane->pending.empty() && lane->busy == 0;
      });
    });
  }
  for (auto& lane : lanes_) {
    try {
      backend_.synchronize(*lane->stream);
    } catch (...) {
    }
    // Forget transfers that completed cleanly; failed ones wait for
    // check_failures().
    std::vector<TransferPtr> outstanding;
    {
      std::lock_guard<std::mutex> lock(mu_);
      outstanding.assign(lane->outstanding.begin(), lane->outstanding.end());
    }
    std::vector<TransferPtr> keep;
    for (auto& t : outstanding) {
      bool complete = probe(t);
      std::lock_guard<std::mutex> lock(mu_);
      if (!complete || (t->error_ && !t->reported_)) keep.push_back(t);
    }
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(lane->outstanding, [&](const TransferPtr& t) {
      return std::find(outstanding.begin(), outstanding.end(), t) != outstanding.end() &&
             std::find(keep.begin(), keep.end(), t) == keep.end();
    });
  }
}

CopyEngineStats CopyEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace spillway::runtime
