#include "plan/node_sequence.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace spillway::plan {
namespace {

using ::testing::ElementsAre;

TEST(NodeSequenceTest, AfterRunKeepsEditOrderWhileFxAfterGoesFirst) {
  NodeSequence plan_rules({1, 2, 3});
  plan_rules.insert_after_run(1, 10);
  plan_rules.insert_after_run(1, 11);
  EXPECT_THAT(plan_rules.order(), ElementsAre(1, 10, 11, 2, 3));

  NodeSequence fx({1, 2, 3});
  fx.insert_right_after(1, 10);
  fx.insert_right_after(1, 11);
  EXPECT_THAT(fx.order(), ElementsAre(1, 11, 10, 2, 3));
}

TEST(NodeSequenceTest, BeforeAppendsToWhatIsAlreadyBeforeTheAnchor) {
  NodeSequence s({1, 2});
  s.insert_before(2, 10);
  s.insert_before(2, 11);
  s.move_before(10, 11);
  EXPECT_THAT(s.order(), ElementsAre(1, 11, 10, 2));
  s.move_before(1, 2);
  EXPECT_THAT(s.order(), ElementsAre(2, 1, 11, 10));
  EXPECT_EQ(s.previous(2), -1);
  EXPECT_EQ(s.next(10), -1);
  EXPECT_EQ(s.last(), 10);
}

TEST(NodeSequenceTest, MoveRightAfterGoesAheadOfWhatFollowsTheAnchor) {
  NodeSequence s({1, 2, 3, 4});
  s.move_right_after(1, 4);
  EXPECT_THAT(s.order(), ElementsAre(1, 4, 2, 3));
  s.move_right_after(3, 1);  // the head moves to the tail
  EXPECT_THAT(s.order(), ElementsAre(4, 2, 3, 1));
  EXPECT_EQ(s.previous(4), -1);
  EXPECT_EQ(s.last(), 1);
  s.move_right_after(3, 1);  // already there
  EXPECT_THAT(s.order(), ElementsAre(4, 2, 3, 1));
}

}  // namespace
}  // namespace spillway::plan
