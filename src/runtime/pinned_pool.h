#pragma once
// A pool of pinned host blocks, reused across steps, bounded by a host budget.
//
// Note [Pinned pool reuse]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Size classes. A request of n bytes is served by a block of class(n): n
// rounded up to a multiple of 2^(floor(log2 n) - class_bits), and to at least
// 4 KiB (a page). With class_bits = 4 each power of two has 16 classes, so a
// block is at most 1/16 (6.25 %) larger than its request; power-of-two
// rounding wastes up to 100 % (a 176 MiB MLP activation would pin 256 MiB).
// The reference activations of BENCHMARKS.md T1 (64 MiB, 176 MiB, 1 MiB,
// 64 KiB) are exact class sizes. Blocks are never split or merged: a class is
// reused only by requests of the same class, so a workload that repeats its
// multiset of sizes every step reaches a steady state in which every request
// is a reuse, and pinned bytes equal the peak of live class bytes.
//
// Stream order. release(block, streams) records one event on each stream that
// used the block (after the copies that read or wrote it were enqueued) and
// parks the block on its class's FIFO. allocate() hands out the oldest parked
// block of the class only once all its events have completed; no
// record_stream. If that block is still in use, allocate() blocks on its
// events rather than pinning a new block: the copy still touching it ends
// within a chunk or so, while page-locking a new block costs more (and would
// let pinned bytes creep above the peak of live bytes step after step).
// Blocks of a class are released after their last reload, so in a training
// step the wait is rare and short.
//
// Budget. pinned bytes (live + parked) never exceed host_budget_bytes. When a
// new block would exceed it, parked blocks of other classes are freed first
// (oldest first, after their events); if that is not enough the request fails
// with OutOfMemory and nothing changes.
//
// Note [Exact blocks]
// ~~~~~~~~~~~~~~~~~~
// A long-lived host copy (a block's weights, kept until the model is detached)
// gains nothing from size classes: it is never released step after step, and
// its class would pin up to 1/2^class_bits more than it holds. HostFit::kExact
// pins the request rounded up to a page (at most 4095 bytes more) and, when
// released, frees the block once the streams that used it have passed,
// instead of parking it: a class of its own would hardly ever be asked for
// again. Such blocks count in the statistics as any other and obey the budget.
//
// Locking. mu_ guards the free lists and statistics. The backend (event
// record/query/synchronize, pinned allocate/free) is never called with mu_
// held: a block being checked or allocated is taken out of the lists first and
// its bytes are reserved in the statistics.
//
// Thread-safety: all methods may be called from any thread.

#include <atomic>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/backend/backend.h"
#include "runtime/thread_annotations.h"
#include "spillway/runtime.h"

namespace spillway::runtime {

// The class size serving a request of `bytes` (see the note above).
std::size_t pinned_class_size(std::size_t bytes, int class_bits);

// A pinned block handed out by the pool. Owned by the caller until release().
struct PinnedBlock {
  void* data = nullptr;
  std::size_t bytes = 0;      // the class size (HostFit::kExact: requested rounded to a page)
  std::size_t requested = 0;  // what the caller asked for
  bool exact = false;         // HostFit::kExact: freed, not parked, when released
};

class PinnedPool {
 public:
  // `backend` must outlive the pool. Throws InvalidArgument for class_bits
  // outside [0, 10].
  PinnedPool(Backend& backend, const PinnedPoolOptions& options);
  // Waits for the events of parked blocks and frees every block. Blocks still
  // handed out are leaked deliberately (someone may still read them). Never
  // throws.
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A block of at least `bytes`: its size class, or with HostFit::kExact
  // `bytes` rounded up to a page (Note [Exact blocks]). Throws OutOfMemory
  // when the budget or the backend refuses; the pool is then unchanged except
  // for the refusal count.
  PinnedBlock allocate(std::size_t bytes, HostFit fit = HostFit::kSizeClass);
  // Returns `block`; it is reused (an exact block: freed) after every stream
  // in `used_on` has passed the point it has reached now. Never throws (on a
  // backend failure while recording, the block is waited for at reuse by
  // synchronising its streams).
  void release(PinnedBlock block, const std::vector<Stream*>& used_on) noexcept;
  // Frees every parked block whose uses have completed, and every released
  // exact block whose uses have.
  void trim();

  PinnedPoolStats stats() const;

 private:
  struct Parked {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::vector<std::unique_ptr<Event>> events;
  };

  // True when all of `block`'s events have completed; a failed copy counts as
  // completed (its failure is reported on the value it fed).
  bool ready(Parked& block);
  void await(Parked& block);
  void recycle(std::vector<std::unique_ptr<Event>> events);
  // Frees parked blocks of classes other than `keep_class` until `need` more
  // bytes fit the budget; returns whether they do.
  bool make_room(std::size_t need, std::size_t keep_class);
  // Frees the released exact blocks whose uses have completed (all of them,
  // waiting, when `wait`).
  void free_retired(bool wait);

  Backend& backend_;
  const PinnedPoolOptions options_;
  int numa_node_ = -1;  // resolved target node, -1 = none

  mutable std::mutex mu_;
  std::map<std::size_t, std::deque<Parked>> parked_ GUARDED_BY(mu_);
  std::vector<Parked> retired_ GUARDED_BY(mu_);  // released exact blocks, not yet freed
  // Whether retired_ may hold blocks (set under mu_): lets allocate() skip mu_ on the
  // hot path when there are none, as there never are without exact blocks.
  std::atomic<bool> any_retired_{false};
  std::vector<std::unique_ptr<Event>> spare_events_ GUARDED_BY(mu_);
  PinnedPoolStats stats_ GUARDED_BY(mu_);
};

}  // namespace spillway::runtime
