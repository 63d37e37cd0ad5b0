// The event pool: events come back once nobody holds them and go out again
// only once their recording has run.

#include "runtime/event_pool.h"

#include <gtest/gtest.h>

#include <future>

#include "spillway/runtime.h"

namespace spillway::runtime {
namespace {

TEST(EventPool, AnEventComesBackWhenItsLastHolderDropsIt) {
  auto backend = make_fake_backend({});
  auto stream = backend->create_stream(FakeControls::Role::kD2H);
  auto pool = EventPool::create(*backend);
  std::shared_ptr<Event> event = pool->take();
  backend->record(*event, *stream);
  backend->synchronize(*event);
  const Event* address = event.get();
  std::shared_ptr<Event> holder = event;
  event.reset();
  EXPECT_EQ(pool->idle(), 0u) << "given back while still held";
  holder.reset();
  EXPECT_EQ(pool->idle(), 1u);
  EXPECT_EQ(pool->take().get(), address) << "not reused";
}

TEST(EventPool, AnEventWhoseRecordingIsPendingIsNotHandedOut) {
  auto backend = make_fake_backend({});
  FakeControls& fake = *backend->fake_controls();
  StreamHandle compute = fake.create_compute_stream();
  auto stream = backend->wrap_stream(compute.native);
  auto gate = std::make_shared<std::promise<void>>();
  std::shared_future<void> open = gate->get_future().share();
  fake.launch(compute, [open] { open.wait(); });
  auto pool = EventPool::create(*backend);

  std::shared_ptr<Event> pending = pool->take();
  backend->record(*pending, *stream);
  const Event* pending_address = pending.get();
  pending.reset();
  EXPECT_EQ(pool->idle(), 1u);
  std::shared_ptr<Event> other = pool->take();
  EXPECT_NE(other.get(), pending_address) << "handed out while its recording is pending";
  EXPECT_TRUE(backend->query(*other));

  gate->set_value();
  fake.synchronize(compute);
  other.reset();
  EXPECT_EQ(pool->take().get(), pending_address) << "reused once its recording ran";
}

TEST(EventPool, AnEventOutlivingThePoolIsDestroyedByItsHolder) {
  auto backend = make_fake_backend({});
  auto pool = EventPool::create(*backend);
  std::shared_ptr<Event> event = pool->take();
  pool.reset();
  EXPECT_TRUE(backend->query(*event));
  event.reset();  // ASan: neither leaked nor freed twice
}

}  // namespace
}  // namespace spillway::runtime
