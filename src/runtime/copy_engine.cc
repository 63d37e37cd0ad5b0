#include "runtime/copy_engine.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <deque>
#include <set>
#include <string>
#include <thread>

#include "runtime/event_pool.h"
#include "spillway/error.h"

namespace spillway::runtime {
namespace {

constexpr char kEngineComponent[] = "copy_engine";
// The priority of a transfer someone waits for: above any a caller gives.
constexpr int kAwaited = INT_MAX;
// How often a dispatcher held by invariant 2 looks whether the oldest chunk in
// flight has run (Note [Awaited transfers]). Far below a chunk's time on the
// link (32 MiB: ~0.6 ms), so the stream never runs dry behind the poll.
constexpr std::chrono::microseconds kBoundPoll{50};

const char* direction(CopyKind kind) {
  return kind == CopyKind::kDeviceToHost ? "device-to-host" : "host-to-device";
}

}  // namespace

// One direction: its stream, its queue and its dispatcher thread.
struct CopyEngine::Lane {
  // The most urgent first (invariant 1): highest priority, then oldest. A
  // transfer's priority changes only while it is out of the set.
  struct MoreUrgent {
    bool operator()(const TransferPtr& a, const TransferPtr& b) const {
      if (a->priority_ != b->priority_) return a->priority_ > b->priority_;
      return a->seq_ < b->seq_;
    }
  };

  CopyKind kind;
  std::unique_ptr<Stream> stream;
  // Guarded by CopyEngine::mu_:
  std::set<TransferPtr, MoreUrgent> pending;  // with chunks not yet taken
  std::size_t busy = 0;                       // transfers taken by the dispatcher
  std::deque<TransferPtr> outstanding;        // enqueued, not seen complete
  std::uint64_t enqueued = 0;                 // transfers ever put on `outstanding`
  // Waited on with mu_ (Note [Dispatch cost]). The dispatcher waits on
  // `work` for pending transfers or shutdown. wait_enqueued, finish and drain
  // wait on `progress`, notified when a transfer is enqueued: the lane goes
  // idle only then (the chunk just done was its transfer's last, or failed).
  std::condition_variable work;
  std::condition_variable progress;
  std::thread worker;
  // Touched by the dispatcher alone: its chunks on the stream not yet seen
  // complete, oldest first, and their bytes (invariant 2).
  struct InFlight {
    std::shared_ptr<Event> event;
    std::size_t bytes;
  };
  std::deque<InFlight> inflight;
  std::size_t inflight_bytes = 0;
};

CopyEngine::CopyEngine(Backend& backend, const CopyEngineOptions& options)
    : backend_(backend), options_(options), events_(EventPool::create(backend)) {
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
  for (auto& lane : lanes_) lane->work.notify_one();
  for (auto& lane : lanes_) lane->worker.join();
  for (auto& lane : lanes_) {
    try {
      backend_.synchronize(*lane->stream);
    } catch (...) {
    }
  }
}

CopyEngine::Lane& CopyEngine::lane_of(CopyKind kind) {
  return *lanes_[kind == CopyKind::kDeviceToHost ? 0 : 1];
}

Stream& CopyEngine::stream(CopyKind kind) { return *lane_of(kind).stream; }

TransferPtr CopyEngine::submit(CopyKind kind, void* dst, const void* src, std::size_t bytes,
                               int priority, std::vector<std::shared_ptr<Event>> after) {
  auto t = std::make_shared<Transfer>();
  t->kind_ = kind;
  t->dst_ = static_cast<char*>(dst);
  t->src_ = static_cast<const char*>(src);
  t->bytes_ = bytes;
  t->after_ = std::move(after);
  t->done_ = events_->take();
  Lane& its_lane = lane_of(kind);
  {
    std::lock_guard<std::mutex> lock(mu_);
    t->priority_ = priority;
    t->seq_ = next_seq_++;
    its_lane.pending.insert(t);
    stats_.transfers++;
  }
  its_lane.work.notify_one();
  return t;
}

bool CopyEngine::await_room(Lane& lane, std::unique_lock<std::mutex>& lock) {
  for (;;) {
    lane.work.wait(lock, [&] { return stopping_ || !lane.pending.empty(); });
    if (lane.pending.empty()) return false;
    const Transfer& best = **lane.pending.begin();
    const std::size_t next = std::min(options_.chunk_bytes, best.bytes_ - best.next_offset_);
    // Invariant 2: bound the bytes in flight before adding this chunk, unless
    // someone waits for its transfer; and while waiting for the bound, give
    // way to a transfer someone starts waiting for (Note [Awaited transfers]).
    if (best.priority_ == kAwaited || lane.inflight.empty() ||
        lane.inflight_bytes + next <= options_.max_inflight_bytes) {
      return true;
    }
    lock.unlock();
    bool ran = true;
    try {
      ran = backend_.query(*lane.inflight.front().event);
    } catch (...) {
      // The failure belongs to the transfer; it surfaces at its wait.
    }
    lock.lock();
    if (ran) {
      lane.inflight_bytes -= lane.inflight.front().bytes;
      lane.inflight.pop_front();
      continue;
    }
    lane.work.wait_for(lock, kBoundPoll, [&] {
      return !lane.pending.empty() && (*lane.pending.begin())->priority_ == kAwaited;
    });
  }
}

void CopyEngine::dispatch(Lane& lane) {
  try {
    backend_.bind_thread();
  } catch (...) {
    // Enqueues below fail and mark their transfers failed.
  }
  for (;;) {
    TransferPtr t;
    std::size_t offset = 0, length = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!await_room(lane, lock)) break;  // stopping and drained
      auto best = lane.pending.begin();
      t = *best;
      offset = t->next_offset_;
      length = std::min(options_.chunk_bytes, t->bytes_ - offset);
      t->next_offset_ = offset + length;
      if (t->next_offset_ >= t->bytes_) lane.pending.erase(best);
      lane.busy++;
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
        std::shared_ptr<Event> event = last ? t->done_ : events_->take();
        backend_.record(*event, *lane.stream);
        t->chunk_events_.push_back(event);
        if (length > 0) {
          lane.inflight.push_back({std::move(event), length});
          lane.inflight_bytes += length;
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    bool enqueued = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      lane.busy--;
      if (error && !t->error_) t->error_ = error;
      if ((error || last) && !t->enqueued_) {
        if (error) lane.pending.erase(t);  // skip the rest of a failed transfer
        t->enqueued_ = true;
        t->enqueue_number_ = lane.enqueued++;
        lane.outstanding.push_back(t);
        enqueued = true;
      }
      stats_.chunks++;
      (lane.kind == CopyKind::kDeviceToHost ? stats_.bytes_d2h : stats_.bytes_h2d) += length;
    }
    if (enqueued) lane.progress.notify_all();
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

void CopyEngine::await_enqueued(const TransferPtr& t) {
  Lane& its_lane = lane_of(t->kind_);
  std::unique_lock<std::mutex> lock(mu_);
  if (t->enqueued_) return;
  // Out of the set while its key changes; not there once all chunks are taken.
  auto node = its_lane.pending.extract(t);
  t->priority_ = kAwaited;
  if (node) its_lane.pending.insert(std::move(node));
  its_lane.work.notify_one();  // a dispatcher held by invariant 2 takes it now
  its_lane.progress.wait(lock, [&] { return t->enqueued_; });
}

void CopyEngine::wait_enqueued(const TransferPtr& t) {
  await_enqueued(t);
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
  await_enqueued(t);
  for (const auto& event : t->chunk_events_) {
    try {
      backend_.synchronize(*event);
    } catch (...) {
    }
  }
}

template <typename Decide>
void CopyEngine::walk_outstanding(Lane& lane, Decide decide) {
  // Index walk: a kept transfer stays on the list. If another thread removes
  // an entry meanwhile, one transfer may be looked at only by a later walk;
  // none is ever dropped unreported.
  for (std::size_t i = 0;;) {
    TransferPtr t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (i >= lane.outstanding.size()) return;
      t = lane.outstanding[i];
    }
    const bool complete = probe(t);
    std::lock_guard<std::mutex> lock(mu_);
    const Step step = decide(*t, complete);
    if (step == Step::kStop) return;
    if (step == Step::kKeep) {
      ++i;
      continue;
    }
    auto it = std::find(lane.outstanding.begin(), lane.outstanding.end(), t);
    if (it != lane.outstanding.end()) lane.outstanding.erase(it);
    if (step == Step::kReport) {
      t->reported_ = true;
      throw failure(*t, t->error_);
    }
  }
}

void CopyEngine::check_failures(const Transfer* spare) {
  for (auto& lane : lanes_) {
    walk_outstanding(*lane, [spare](const Transfer& t, bool complete) {
      const bool unreported = t.error_ && !t.reported_;
      if (unreported) return &t == spare ? Step::kKeep : Step::kReport;
      return complete || t.error_ ? Step::kForget : Step::kStop;
    });
  }
}

void CopyEngine::forget_completed(Lane& lane) {
  walk_outstanding(lane, [](const Transfer& t, bool complete) {
    if (!complete) return Step::kStop;
    return t.error_ && !t.reported_ ? Step::kKeep : Step::kForget;
  });
}

void CopyEngine::forget_synchronized(Lane& lane, std::uint64_t enqueued) {
  std::vector<TransferPtr> forgotten;  // destroyed once mu_ is released
  std::lock_guard<std::mutex> lock(mu_);
  auto& list = lane.outstanding;
  forgotten.reserve(list.size());  // nothing below throws once the list changes
  auto kept_end = list.begin();
  auto it = list.begin();
  // The list is in enqueue order: those covered by the synchronize come first.
  for (; it != list.end() && (*it)->enqueue_number_ < enqueued; ++it) {
    if ((*it)->error_ && !(*it)->reported_) {
      if (kept_end != it) *kept_end = std::move(*it);
      ++kept_end;
    } else {
      forgotten.push_back(std::move(*it));
    }
  }
  list.erase(kept_end, it);
}

void CopyEngine::drain() {
  // How many transfers each lane had enqueued once it went idle: each was
  // put on the list after its chunks were on the stream (Note [Drain]).
  std::uint64_t enqueued[2] = {};
  for (int i = 0; i < 2; ++i) {
    Lane& lane = *lanes_[i];
    std::unique_lock<std::mutex> lock(mu_);
    lane.progress.wait(lock, [&] { return lane.pending.empty() && lane.busy == 0; });
    enqueued[i] = lane.enqueued;
  }
  for (int i = 0; i < 2; ++i) {
    Lane& lane = *lanes_[i];
    bool ran_cleanly = true;
    try {
      backend_.synchronize(*lane.stream);
    } catch (...) {
      ran_cleanly = false;  // the failure belongs to a transfer: find it
    }
    if (ran_cleanly) {
      forget_synchronized(lane, enqueued[i]);
    } else {
      forget_completed(lane);
    }
  }
}

CopyEngineStats CopyEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace spillway::runtime
