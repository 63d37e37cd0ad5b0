#pragma once
// The copy engine: one device-to-host and one host-to-device stream, so both
// directions run at once, each fed by a dispatcher thread.
//
// Invariants:
//   1. A transfer is split into chunks of at most chunk_bytes. Between two
//      chunks the dispatcher picks the most urgent pending transfer (highest
//      priority, then oldest), so a later urgent transfer waits for at most
//      the chunks already enqueued, not for a whole large transfer.
//   2. At most max_inflight_bytes are enqueued on a stream and not complete,
//      chunks of awaited transfers aside (Note [Awaited transfers]). Before
//      enqueuing more, the dispatcher polls the oldest chunk's event (never
//      holding mu_), and gives way at once to a transfer someone starts
//      waiting for. This bounds how long an urgent transfer waits.
//   3. Before a transfer's first chunk, its stream waits for each `after`
//      event; after its last chunk, `done` is recorded, and `enqueued` is set.
//      `done` is recorded once and never re-recorded while anyone holds it
//      (Note [Event reuse]), so anyone may wait on it.
//   4. A failure to enqueue marks the transfer failed; its remaining chunks
//      are skipped and every later wait on it throws TransferError.
//   5. Each transfer keeps the events recorded after each of its chunks, so a
//      failure attached to any chunk is found by poll()/synchronize() of the
//      transfer. Enqueued transfers stay on their lane's `outstanding` list
//      (in stream order) until seen complete; check_failures() walks it from
//      the front, so a failure of a transfer nobody waits on is still
//      reported, once, at the next check. A transfer is seen complete by
//      querying its chunk events, or wholesale by drain() (Note [Drain]).
//
// Note [Drain]
// ~~~~~~~~~~~~
// At the end of a batch of a thousand 1 MiB transfers per direction, drain()
// used to walk each lane's outstanding list querying every chunk event (a
// driver call each, and mu_ taken twice), lane after lane, while the last
// max_inflight_bytes ran: on an H100 the walks ended after the copies, and
// the batch's wall time was ~5 % above raw copies'. Instead, for each lane,
// drain() notes how many transfers had been put on the list (each after all
// its chunks were enqueued), synchronizes the stream, and if that returns
// (Backend: then everything enqueued on it before ran without failure)
// forgets those transfers in one pass under mu_, with no backend call, except
// a failure not yet reported, which stays for check_failures(). Transfers
// enqueued by other threads meanwhile are past the count and stay. If the
// synchronize throws, some work on the stream failed: drain() walks the list
// querying each transfer, as check_failures() does, so the failure lands on
// its transfer. Nothing is queried before the synchronize any more: one way
// the old walk fitted in the last copies' time, both ways it did not. The
// pass costs ~120 ns a transfer on an H100's host, after the copies (0.13 ms
// for 1024 one way, 0.25 ms both ways): 1 MiB both ways went from 94.5 to
// 98.9 % of raw, one way from 99.9 to 99.3 %.
//
// Note [Awaited transfers]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A wait (wait_enqueued, make_wait, synchronize, finish) makes its transfer
// the most urgent and blocks until all its chunks are on the stream. Under
// invariant 2 that meant until all but max_inflight_bytes of the transfer,
// and of whatever its lane had in flight, had been copied: the caller, the
// thread that launches the compute, stood still for most of the copy. In an
// eager step that thread waits at every block end for the offloads due
// there and at every reloaded tensor's first use; each such wait emptied the
// compute stream's queue, which the step never filled again (on an H100,
// T1's 15 GiB plan idled its compute stream 44.7 ms of 340 in 410 gaps with
// the CPU behind, after 266 event synchronizes of 169 ms). The bound exists
// so that a later, more urgent transfer can get ahead of chunks not yet on
// the stream; nothing gets ahead of an awaited transfer (it is the most
// urgent, and a wait for another one comes after it on that thread), so its
// chunks are enqueued as fast as the dispatcher takes them, and the wait
// returns once they are, to make the compute stream wait on the device.
//
// That alone was not enough: a dispatcher already blocked on the bound, in an
// event synchronize for the oldest chunk in flight, took the awaited transfer
// only once that chunk had run. A chunk's stream first waits for its
// transfer's `after` events, recorded on the compute stream when the copy was
// asked for; the launching thread runs ahead of the device, so those chunks
// waited for the compute stream to get there, and so did the thread in the
// wait (on an H100, T1's 7.1 GiB plan: 108 waits held it 108 ms of a 359 ms
// step, the longest 17.7 ms, while the H2D dispatcher sat in event
// synchronizes). So the dispatcher waits for the bound by polling the oldest
// chunk's event every kBoundPoll (far below a chunk's time on the link, with
// max_inflight_bytes - chunk_bytes still queued on the stream), on its lane's
// `work` condition, which await_enqueued notifies.
//
// Note [Dispatch cost]
// ~~~~~~~~~~~~~~~~~~~~
// At 1 MiB a transfer holds the link for 20-25 us per direction, and one
// submitting thread may feed both lanes: the engine's host work per transfer
// must stay a small part of that however many are pending. So a lane keeps
// its pending transfers ordered by urgency (the next chunk is taken in
// O(log pending)); each lane has its own condition variables (a submit wakes
// only its lane's dispatcher, an enqueued transfer only the waiters on its
// lane); events are recycled (Note [Event reuse] in event_pool.h); drain()
// forgets a lane's finished transfers in one pass (Note [Drain]); and mu_ is
// never held across a backend call.
//
// Thread-safety: all methods may be called from any thread.

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/backend/backend.h"
#include "runtime/thread_annotations.h"
#include "spillway/error.h"
#include "spillway/runtime.h"

namespace spillway::runtime {

class CopyEngine;
class EventPool;

// One requested copy. Created by CopyEngine::submit; shared by its users.
class Transfer {
 public:
  CopyKind kind() const { return kind_; }
  std::size_t bytes() const { return bytes_; }
  // Recorded after the last chunk once wait_enqueued() returned.
  const std::shared_ptr<Event>& done() const { return done_; }

 private:
  friend class CopyEngine;
  CopyKind kind_ = CopyKind::kDeviceToHost;
  char* dst_ = nullptr;
  const char* src_ = nullptr;
  std::size_t bytes_ = 0;
  std::uint64_t seq_ = 0;
  std::vector<std::shared_ptr<Event>> after_;
  std::shared_ptr<Event> done_;
  // Written by the dispatcher before enqueued_ is set; read after.
  std::vector<std::shared_ptr<Event>> chunk_events_;
  // Guarded by the engine's mu_.
  int priority_ = 0;
  std::size_t next_offset_ = 0;
  bool enqueued_ = false;
  // Its place on its lane's outstanding list, in enqueue order (Note [Drain]).
  std::uint64_t enqueue_number_ = 0;
  bool reported_ = false;
  std::exception_ptr error_;
};
using TransferPtr = std::shared_ptr<Transfer>;

class CopyEngine {
 public:
  // `backend` must outlive the engine. Throws InvalidArgument for bad options.
  CopyEngine(Backend& backend, const CopyEngineOptions& options);
  // Enqueues what is pending, waits for both streams, stops the dispatchers.
  // Never throws.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues a copy of `bytes` from `src` to `dst`; it starts on the stream of
  // `kind` after every event in `after` (each already recorded). Higher
  // `priority` goes first. Never blocks on the device.
  TransferPtr submit(CopyKind kind, void* dst, const void* src, std::size_t bytes, int priority,
                     std::vector<std::shared_ptr<Event>> after);

  // Makes `transfer` the most urgent and blocks until all its chunks are
  // enqueued. Throws TransferError if enqueuing failed. Being made the most
  // urgent, `transfer` may overtake transfers submitted before it: when this
  // returns, they may still be pending, so an event recorded on the stream
  // now covers `transfer` but not necessarily them. To put a whole batch on
  // the stream, wait for each transfer oldest first (which reorders nothing);
  // to wait for everything, use drain().
  void wait_enqueued(const TransferPtr& transfer);
  // Makes `stream` wait for `transfer` (wait_enqueued first). Throws
  // TransferError for a failure known now.
  void make_wait(Stream& stream, const TransferPtr& transfer);
  // True when `transfer` has completed; throws TransferError if it failed.
  // Does not block on the device.
  bool poll(const TransferPtr& transfer);
  // Blocks until `transfer` completed; throws TransferError if it failed.
  void synchronize(const TransferPtr& transfer);
  // Throws TransferError for the first failed transfer not yet reported (by
  // a wait on it or an earlier check), marking it reported. Does not block.
  // A failure of `spare` is not reported here: it stays for a later check
  // (a wait that has already acted on its own transfer passes that transfer,
  // so a failure it can no longer undo is not blamed on it).
  void check_failures(const Transfer* spare = nullptr);
  // Blocks until every chunk of `transfer` that was enqueued has run,
  // failed or not; raises nothing. For error paths that must not free
  // memory a copy still touches.
  void finish(const TransferPtr& transfer) noexcept;
  // Blocks until every transfer submitted so far has completed. Never
  // reports copy failures: one not yet reported stays for check_failures().
  // Costs no backend call per transfer unless a copy failed (Note [Drain]).
  void drain();

  Stream& stream(CopyKind kind);
  CopyEngineStats stats() const;

 private:
  struct Lane;
  Lane& lane_of(CopyKind kind);
  void dispatch(Lane& lane);
  // For the dispatcher, holding `lock` on mu_: waits until the lane's most
  // urgent pending transfer may enqueue its next chunk (invariant 2, Note
  // [Awaited transfers]). False once stopping with nothing pending.
  bool await_room(Lane& lane, std::unique_lock<std::mutex>& lock);
  // Makes `t` the most urgent of its lane and blocks until all its chunks
  // are enqueued (or it failed).
  void await_enqueued(const TransferPtr& t);
  TransferError failure(const Transfer& t, const std::exception_ptr& e) const;
  // Queries every chunk event of an enqueued transfer; true when all ran.
  // Records a failure in t->error_ (and throws nothing).
  bool probe(const TransferPtr& t);
  // Throws t's failure, marking it reported, if it has one.
  void raise_if_failed(const TransferPtr& t);
  // What a walk of an outstanding list does with the transfer it probed.
  enum class Step {
    kStop,    // leave it and the rest: later transfers on the lane run after it
    kKeep,    // leave it on the list, look at the next
    kForget,  // take it off the list
    kReport,  // take it off, mark it reported and throw its failure
  };
  // Walks `lane`'s outstanding list from the front, probing each transfer
  // (mu_ not held), and does what `decide(transfer, complete)`, called with
  // mu_ held, returns. Does not block on the device.
  template <typename Decide>
  void walk_outstanding(Lane& lane, Decide decide);
  // Drops the transfers at the front of `lane`'s outstanding list that
  // completed, up to the first not complete; a failure not yet reported
  // stays for check_failures(). Does not block.
  void forget_completed(Lane& lane);
  // Drops the first `enqueued` transfers ever put on `lane`'s outstanding
  // list that are still there, once a synchronize of the lane's stream made
  // after they were put there returned (Note [Drain]); a failure not yet
  // reported stays. One pass under mu_, no backend call.
  void forget_synchronized(Lane& lane, std::uint64_t enqueued);

  Backend& backend_;
  const CopyEngineOptions options_;

  const std::shared_ptr<EventPool> events_;
  mutable std::mutex mu_;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::uint64_t next_seq_ GUARDED_BY(mu_) = 0;
  CopyEngineStats stats_ GUARDED_BY(mu_);
  std::unique_ptr<Lane> lanes_[2];
};

}  // namespace spillway::runtime
