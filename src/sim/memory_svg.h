#pragma once
// Internals of memory_svg (include/spillway/sim.h) that its tests check.
// Internal to spillway_sim.

#include <cstddef>

#include "spillway/sim.h"

namespace spillway::sim {

// The most timeline points memory_svg draws; a longer timeline is thinned to
// this many, keeping the peak's point (Note [Memory picture samples] in
// memory_svg.cc).
inline constexpr std::size_t kMaxSamples = 2000;

// How many of `result`'s timeline points memory_svg draws: the timeline's
// length up to kMaxSamples, at most kMaxSamples beyond it.
std::size_t memory_svg_sample_count(const SimResult& result);

}  // namespace spillway::sim
