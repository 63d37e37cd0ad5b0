#pragma once
// Recycled backend events for the copy engine.
//
// Note [Event reuse]
// ~~~~~~~~~~~~~~~~~~
// Every transfer needs a `done` event, and every chunk but its last one more.
// Creating each is a driver call (cudaEventCreate; PyTorch pools its events
// for the cost of creating them from several threads at once) made on the
// submitting thread while the dispatchers enqueue copies. take() hands out a
// shared event that comes back to the pool when its last holder drops it, so
// nobody who holds an event ever sees it re-recorded. It goes out again only
// once query() says its last recording has run (a failed one has run too:
// the failure was for its holders to find), so a recording still pending is
// never overwritten either; one that has not run waits at the back of the
// line and a new event is created meanwhile.
//
// Locking. mu_ guards the idle events; the backend (create_event, query) is
// never called with mu_ held.
//
// Thread-safety: all methods may be called from any thread. Events outliving
// the pool are destroyed by their last holder instead of coming back.

#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>

#include "runtime/backend/backend.h"
#include "runtime/thread_annotations.h"

namespace spillway::runtime {

class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  // `backend` must outlive the pool and every event it hands out. Owned
  // through a shared_ptr (take() needs it).
  static std::shared_ptr<EventPool> create(Backend& backend);
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // An event that has no recording pending: a recycled one, else a new one.
  // Throws what Backend::create_event throws.
  std::shared_ptr<Event> take();
  // Events waiting for reuse.
  std::size_t idle() const;

 private:
  explicit EventPool(Backend& backend) : backend_(backend) {}
  void give_back(std::unique_ptr<Event> event) noexcept;

  Backend& backend_;
  mutable std::mutex mu_;
  std::deque<std::unique_ptr<Event>> idle_ GUARDED_BY(mu_);  // oldest given back first
};

}  // namespace spillway::runtime
