// The weight-stream simulator (include/spillway/weights.h).
//
// Note [Weight stream]
// ~~~~~~~~~~~~~~~~~~~~
// The rules spillway.offload_weights follows, and this file replays on two
// streams (compute and H2D):
//
//   - A resident block's weights stay on the device; it computes and moves
//     nothing. The streamed blocks form a ring in the order the call runs
//     them (each block's successor is the next streamed block after its last
//     occurrence, the last one's is the first's).
//   - At most `slots` streamed buffers are allocated at once: the running
//     block's, and those of the blocks copying ahead of it.
//   - Before a streamed block runs, the compute stream waits for its copy
//     (started now if it was not started ahead), then the ring is filled:
//     the next slots - 1 blocks along the ring get their copies started, in
//     order, and a block copying ahead that is not among them is dropped
//     (the compute stream waits for its copy first). After the block ran its
//     buffer is freed and the ring is filled again with the next `slots`
//     blocks after it: one more copy starts there, so a copy can run behind
//     the resident blocks that follow. (Walking the ring stops where it
//     comes back to a block whose weights are on the device now; a block
//     that just ran may be the next one again, its own next call's copy.)
//   - A copy is enqueued behind the compute stream's current point (its
//     buffer may be memory the compute stream just freed) and behind the
//     H2D stream's previous copy; it takes CostModel::h2d_ms of its bytes.
//   - The copies started ahead by a call's last blocks are the next call's
//     first blocks (the ring's handover); nothing waits for them at the end
//     of the call, so the link stays busy across the boundary.
//
// Three calls run in a row; the forecast is the third's, by then in steady
// state (the second already starts from the first's handover). The peak
// counts the buffers allocated at once in stream order: a buffer is
// allocated when its copy is started and freed after its block.

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "spillway/error.h"
#include "spillway/weights.h"

namespace spillway {
namespace {

[[noreturn]] void bad(const std::string& message) { throw InvalidArgument("sim", message); }

void check(const WeightModel& model, const WeightPlan& plan) {
  const auto blocks = static_cast<std::int64_t>(model.block_bytes.size());
  for (std::size_t i = 0; i < model.block_bytes.size(); ++i) {
    if (model.block_bytes[i] < 0) {
      bad("weight model: block_bytes[" + std::to_string(i) + "] is negative");
    }
  }
  for (std::size_t i = 0; i < model.steps.size(); ++i) {
    const WeightStep& step = model.steps[i];
    if (step.block < -1 || step.block >= blocks) {
      bad("weight model: steps[" + std::to_string(i) + "].block is " +
          std::to_string(step.block) + ", not -1 or a block index below " +
          std::to_string(blocks));
    }
    if (!(step.compute_ms >= 0)) {
      bad("weight model: steps[" + std::to_string(i) + "].compute_ms must be >= 0");
    }
  }
  if (model.fixed_bytes < 0) bad("weight model: fixed_bytes is negative");
  if (plan.resident.size() != model.block_bytes.size()) {
    bad("weight plan: resident has " + std::to_string(plan.resident.size()) +
        " entries for " + std::to_string(blocks) + " blocks");
  }
  if (plan.slots < 1) bad("weight plan: slots must be >= 1, got " + std::to_string(plan.slots));
}

class WeightReplay {
 public:
  WeightReplay(const WeightModel& model, const WeightPlan& plan, const CostModel& cost)
      : model_(model), plan_(plan), cost_(cost) {
    std::vector<int> ring;
    for (const WeightStep& step : model.steps) {
      if (streamed(step.block)) ring.push_back(step.block);
    }
    for (std::size_t p = 0; p < ring.size(); ++p) {  // the last occurrence wins
      following_[ring[p]] = ring[(p + 1) % ring.size()];
    }
  }

  bool streamed(int block) const {
    return block >= 0 && !plan_.resident[block] && model_.block_bytes[block] > 0;
  }

  // One call; returns nothing, the clocks and counters move on.
  void call() {
    for (const WeightStep& step : model_.steps) {
      if (!streamed(step.block)) {
        compute_ += step.compute_ms;
        compute_total_ += step.compute_ms;
        continue;
      }
      before(step.block);
      compute_ += step.compute_ms;
      compute_total_ += step.compute_ms;
      after(step.block);
    }
  }

  double compute_clock() const { return compute_; }
  double stall() const { return stall_; }
  double link() const { return link_; }
  double compute_total() const { return compute_total_; }
  std::int64_t moved() const { return moved_; }
  std::int64_t peak_buffers() const { return peak_buffers_; }

 private:
  void wait_for(double done) {
    if (done > compute_) {
      stall_ += done - compute_;
      compute_ = done;
    }
  }

  double start_copy(int block) {
    const std::int64_t bytes = model_.block_bytes[block];
    const double begin = std::max(h2d_, compute_);
    const double took = cost_.h2d_ms(bytes);
    h2d_ = begin + took;
    link_ += took;
    moved_ += bytes;
    allocated_ += round_allocation(bytes, cost_.profile());
    peak_buffers_ = std::max(peak_buffers_, allocated_);
    return h2d_;
  }

  void before(int block) {
    if (live_.contains(block)) return;  // re-entrant: its weights are here
    double done;
    if (auto it = ahead_.find(block); it != ahead_.end()) {
      done = it->second;
      ahead_.erase(it);
    } else {
      done = start_copy(block);  // on demand
    }
    wait_for(done);
    live_.insert(block);
    fill(block);
  }

  void after(int block) {
    if (!live_.erase(block)) return;
    allocated_ -= round_allocation(model_.block_bytes[block], cost_.profile());
    fill(block);
  }

  // The next slots - live blocks after `block` along the ring, nearest first.
  std::vector<int> wanted(int block) const {
    std::vector<int> out;
    const int room = plan_.slots - static_cast<int>(live_.size());
    int k = block;
    for (std::size_t i = 0; i < following_.size() && static_cast<int>(out.size()) < room; ++i) {
      auto next = following_.find(k);
      if (next == following_.end()) break;
      k = next->second;
      if (std::find(out.begin(), out.end(), k) != out.end()) break;
      if (live_.contains(k)) {
        if (k == block) break;  // round the ring to the running block
        continue;
      }
      out.push_back(k);
    }
    return out;
  }

  void fill(int block) {
    const std::vector<int> want = wanted(block);
    for (auto it = ahead_.begin(); it != ahead_.end();) {  // mispredicted
      if (std::find(want.begin(), want.end(), it->first) == want.end()) {
        wait_for(it->second);
        allocated_ -= round_allocation(model_.block_bytes[it->first], cost_.profile());
        it = ahead_.erase(it);
      } else {
        ++it;
      }
    }
    for (int k : want) {
      if (!ahead_.contains(k)) ahead_[k] = start_copy(k);
    }
  }

  const WeightModel& model_;
  const WeightPlan& plan_;
  const CostModel& cost_;
  std::unordered_map<int, int> following_;
  std::unordered_map<int, double> ahead_;  // block -> when its copy is done
  std::unordered_set<int> live_;
  double compute_ = 0, h2d_ = 0, stall_ = 0, link_ = 0, compute_total_ = 0;
  std::int64_t moved_ = 0, allocated_ = 0, peak_buffers_ = 0;
};

}  // namespace

WeightForecast simulate_weight_stream(const WeightModel& model, const WeightPlan& plan,
                                      const CostModel& cost) {
  check(model, plan);
  WeightReplay replay(model, plan, cost);
  replay.call();
  replay.call();
  const double clock = replay.compute_clock(), stall = replay.stall(), link = replay.link();
  const double compute = replay.compute_total();
  const std::int64_t moved = replay.moved();
  replay.call();

  WeightForecast out;
  out.call_ms = replay.compute_clock() - clock;
  out.compute_ms = replay.compute_total() - compute;
  out.stall_ms = replay.stall() - stall;
  out.link_ms = replay.link() - link;
  out.bytes_moved = replay.moved() - moved;
  out.resident_bytes = model.fixed_bytes;
  for (std::size_t b = 0; b < model.block_bytes.size(); ++b) {
    if (plan.resident[b]) out.resident_bytes += round_allocation(model.block_bytes[b], cost.profile());
  }
  out.peak_bytes = out.resident_bytes + replay.peak_buffers();
  return out;
}

}  // namespace spillway
