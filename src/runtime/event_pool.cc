#include "runtime/event_pool.h"

#include "spillway/error.h"

namespace spillway::runtime {

std::shared_ptr<EventPool> EventPool::create(Backend& backend) {
  return std::shared_ptr<EventPool>(new EventPool(backend));
}

std::shared_ptr<Event> EventPool::take() {
  std::unique_ptr<Event> event;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      event = std::move(idle_.front());
      idle_.pop_front();
    }
  }
  if (event) {
    bool pending = false;
    try {
      pending = !backend_.query(*event);
    } catch (const Error&) {
      // Its recording ran and failed (Note [Event reuse]).
    }
    if (pending) give_back(std::move(event));
  }
  if (!event) event = backend_.create_event();
  // The deleter holds the pool weakly: an event outliving it is destroyed.
  return std::shared_ptr<Event>(event.release(),
                                [pool = weak_from_this()](Event* e) {
                                  std::unique_ptr<Event> owned(e);
                                  if (auto p = pool.lock()) p->give_back(std::move(owned));
                                });
}

void EventPool::give_back(std::unique_ptr<Event> event) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(event));
  } catch (...) {
    // Out of memory: `event` is destroyed instead of kept.
  }
}

std::size_t EventPool::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_.size();
}

}  // namespace spillway::runtime
