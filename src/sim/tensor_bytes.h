#pragma once
// Byte counts of tensor values from their size hints, for the cost model and
// the simulator. Internal to spillway_sim. An unbacked size (no hint) makes a
// count 0; counts saturate at INT64_MAX instead of overflowing.

#include <cstdint>
#include <string_view>
#include <utility>

#include "spillway/graph.h"

namespace spillway::sim {

// Elements of the tensor (product of the size hints).
std::int64_t hinted_numel(const TensorInfo& info);
// numel * element_size.
std::int64_t hinted_nbytes(const TensorInfo& info);
// nbytes summed over a value's tensors (a tuple/list counts every element).
std::int64_t value_nbytes(const Value& value);

// What one tensor needs, from one walk over its dims.
struct TensorBytes {
  std::int64_t nbytes = 0;  // hinted_nbytes
  // The furthest byte the tensor reaches from its storage's start: (1 + sum
  // of (size - 1) * stride) * element_size when the strides are known, else
  // nbytes; 0 for an empty tensor. What the value needs of its storage
  // (execution model (6)): an expanded view reaches no further than its base.
  std::int64_t extent = 0;
};
TensorBytes tensor_bytes(const TensorInfo& info);

// Whether an op name or target names a scaled-dot-product attention, forward
// or backward (flash, efficient, cuDNN, math: they all contain
// "scaled_dot_product" and "attention").
bool is_attention(std::string_view op);

// The two scratch allocations a kernel makes while it runs (execution model
// (7)), unrounded; {0, 0} for a node that makes none. Only attention
// backwards (is_attention, and a target containing "_backward") have any:
// the query gradient's elements (the first output's, or, with no output
// shape, nothing) times 4, and its rows (all sizes but the last) times 4.
std::pair<std::int64_t, std::int64_t> scratch_bytes(const Node& node);

// a + b for byte counts >= 0, saturating at INT64_MAX.
std::int64_t add_bytes(std::int64_t a, std::int64_t b);

}  // namespace spillway::sim
