#pragma once
// Weights on the host: a model call's blocks streamed through a few device
// buffers, simulated (src/sim/weight_stream.cc, Note [Weight stream]), and
// the resident-set scheduler that chooses which blocks stay on the device
// under a budget and how many buffers the rest stream through
// (src/plan/resident_set.cc). spillway.offload_weights(gpu_budget=...) runs
// what the scheduler chooses, with the same rules the simulator follows.
//
// Thread-safety: pure functions; a CostModel is immutable.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "spillway/sim.h"

namespace spillway {

// One step of a model call, in the order it runs: a block (an index into
// WeightModel::block_bytes) computing for compute_ms, or compute outside
// every block (block == -1).
struct WeightStep {
  int block = -1;
  double compute_ms = 0;
};

// What the simulator needs to know of a model whose blocks' weights live on
// the host.
struct WeightModel {
  std::vector<std::int64_t> block_bytes;  // each block's slab: one device buffer
  std::vector<WeightStep> steps;          // one call, in the order it runs
  // Device bytes the model's other weights hold for good (outside the blocks).
  std::int64_t fixed_bytes = 0;
};

struct WeightPlan {
  std::vector<bool> resident;  // per block: its weights stay on the device
  // Streamed blocks' buffers allocated at once (the running block's and those
  // copying ahead), >= 1.
  int slots = 2;
};

// The simulated steady state of one call (the third of three in a row).
struct WeightForecast {
  double call_ms = 0;           // one call, the ring's handover wait included
  double compute_ms = 0;        // the steps' time
  double stall_ms = 0;          // the compute stream waiting for copies
  double link_ms = 0;           // the H2D stream busy
  std::int64_t bytes_moved = 0; // host to device per call
  // Weights on the device at most: fixed + resident + streamed buffers, each
  // buffer rounded as the caching allocator rounds it.
  std::int64_t peak_bytes = 0;
  std::int64_t resident_bytes = 0;  // fixed + the resident blocks'
};

// Replays calls of the model under the plan (Note [Weight stream]). Throws
// InvalidArgument naming the field on a malformed model or plan (a step's
// block out of range, a negative time or size, slots < 1, a resident vector
// of another length).
WeightForecast simulate_weight_stream(const WeightModel& model, const WeightPlan& plan,
                                      const CostModel& cost);

enum class ResidentStrategy {
  kBest,     // the fastest plan of the three below (the default)
  kNothing,  // no block resident; the slot count that is fastest
  kGreedy,   // add the block that saves the most time per byte, while one fits and
             // the call gets no slower
  kExact,    // every subset of the blocks (at most exact_max_blocks of them)
};
std::string_view to_string(ResidentStrategy strategy);

struct ResidentSetOptions {
  std::int64_t budget_bytes = 0;  // weights on the device at most (> 0)
  ResidentStrategy strategy = ResidentStrategy::kBest;
  int min_slots = 1;  // the slot counts tried: min_slots..max_slots
  int max_slots = 4;
  int exact_max_blocks = 12;  // kBest skips kExact above this many blocks
};

struct ResidentSetResult {
  WeightPlan plan;
  WeightForecast forecast;
  std::string strategy;  // the strategy whose plan this is
  // Each strategy run, with the forecast of its plan (kBest: all it ran).
  std::vector<std::pair<std::string, WeightForecast>> candidates;
};

// The least simulated call time whose simulated peak fits the budget; ties go
// to more resident bytes, then fewer slots. Throws InvalidArgument when no
// plan fits: the message names the smallest budget that does
// (smallest_weight_budget), or when kExact is asked for more blocks than
// exact_max_blocks.
ResidentSetResult plan_resident_set(const WeightModel& model, const ResidentSetOptions& options,
                                    const CostModel& cost);

// Fixed bytes plus the largest block's buffer: nothing resident, one slot.
std::int64_t smallest_weight_budget(const WeightModel& model, const CostModel& cost);

}  // namespace spillway
