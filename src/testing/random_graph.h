#pragma once
// A seeded generator of random joint forward+backward graphs for property
// tests of the planners. The same seed gives the same graph on every platform
// (the generator uses its own integer mapping on top of std::mt19937_64, never
// the implementation-defined std distributions).
//
// Every generated graph passes verify_graph. It contains, at random:
//   * decoder-like blocks, each with a "self_attn" region (distinct per block,
//     nested deeper, or one module reused by several blocks under the same
//     qualified name) and an out-of-scope region ("mlp", "self_attn_norm",
//     "cross_attn");
//   * fresh compute ops with small and large, rank 1-4, contiguous and strided,
//     concrete, symbolic (s0) and unbacked (u<k>) sized tensors, some with an
//     unknown storage or DTensor-like;
//   * views, transposes and `_unsafe_view` (an alias without a view schema),
//     chains of them read only by backward, and `split` with getitem;
//   * in-place writes: a single written argument, a keyword-only `out=`, a
//     Tensor[] list (`_foreach_add_`, returning nothing), a mutable schema whose
//     written argument is absent (unresolvable), call_method and call_module
//     nodes without a schema, and opaque call_functions without a schema;
//   * tuple-returning ops read through getitem, functional collectives,
//     placeholders sharing one storage, a get_attr, an `_unsafe_view` of a
//     placeholder, sym_size nodes and symbolic int arguments;
//   * a backward half that reads forward values directly, through forward view
//     chains and through backward views, sometimes writing them in place;
//   * an output node returning the loss, gradients and sometimes a forward value.
//
// Thread-safety: a RandomGraphGenerator is used from one thread; distinct
// instances are independent.

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/graph.h"
#include "spillway/plan.h"

namespace spillway::testing {

// Deterministic random numbers: the same seed gives the same sequence everywhere.
class Rng {
 public:
  explicit Rng(std::uint64_t seed);
  std::uint64_t next();
  // Uniform in [lo, hi] (inclusive); lo <= hi.
  std::int64_t uniform(std::int64_t lo, std::int64_t hi);
  // True with probability p.
  bool chance(double p);
  // One element of a non-empty vector or array, uniformly.
  template <typename Container>
  const auto& pick(const Container& items) {
    return items[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(items.size()) - 1))];
  }

 private:
  std::uint64_t state_;
};

// Returns the graph for `seed`. Never throws except std::bad_alloc.
Graph make_random_joint_graph(std::uint64_t seed);

// Random planner options for `seed`: scope "self_attn" (sometimes "mlp"), a host
// budget of 0 (unlimited) or 1-64 MiB, min_bytes from 0 to 4 MiB, prefetch 0-3,
// and now and then mode kNone.
ActivationPlanOptions make_random_plan_options(std::uint64_t seed);

// "scope=self_attn budget=... min_bytes=... prefetch=... mode=..."
std::string describe_options(const ActivationPlanOptions& options);

}  // namespace spillway::testing
