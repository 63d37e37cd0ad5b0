#pragma once
// What the two result writers (chrome_trace, memory_svg) share: how each
// memory category is named and coloured, node lookup by id, and their common
// precondition. Internal to spillway_sim.
//
// Thread-safety: pure functions and immutable tables.

#include <array>
#include <string>
#include <string_view>
#include <unordered_map>

#include "spillway/graph.h"
#include "spillway/sim.h"

namespace spillway::sim {

// A category's machine name (the trace's counter arguments, the picture's
// class names) is to_string(category).
struct CategoryStyle {
  MemoryCategory category;
  std::string_view label;   // what the picture's legend says
  std::string_view colour;  // an SVG fill colour
};

// In MemoryCategory order, which is also the stacking order of the picture
// (bottom first): what is always there under what comes and goes.
inline constexpr std::array<CategoryStyle, kMemoryCategoryCount> kCategoryStyles{{
    {MemoryCategory::kInputs, "inputs and weights", "#9a9a9a"},
    {MemoryCategory::kActivations, "kept activations", "#3b75c4"},
    {MemoryCategory::kTemporaries, "temporaries", "#bcd6f0"},
    {MemoryCategory::kInFlight, "in-flight copies", "#f28e2b"},
    {MemoryCategory::kReloads, "reloads", "#4fa04a"},
    {MemoryCategory::kRecomputed, "recomputed", "#8a5bbf"},
}};

// A point's bytes per category as the writers draw them: the kernel's
// scratch (TimelinePoint::scratch_bytes) counted as a temporary.
std::array<std::int64_t, kMemoryCategoryCount> drawn_bytes(const TimelinePoint& point);

// Node names by id; an id the graph lacks is named "#<id>", so a writer never
// fails on a result simulated from a different graph.
class NodeNames {
 public:
  explicit NodeNames(const Graph& graph);
  // The node with `id`, or nullptr.
  const Node* find(NodeId id) const;
  std::string name(NodeId id) const;

 private:
  std::unordered_map<NodeId, const Node*> nodes_;
};

// Throws InvalidArgument("[sim] <writer> needs a result simulated with
// record_timeline ...") when `result` has no timeline.
void require_timeline(const SimResult& result, std::string_view writer);

// The timeline point where backward starts: the first one whose node is a
// backward node that computes (a backward placeholder, such as the tangents
// that exported graphs list among the forward's inputs, does not count), or
// nullptr when there is none.
const TimelinePoint* first_backward_point(const NodeNames& names, const SimResult& result);

// The end of the step as the writers draw it: the latest of step_ms and every
// point's and interval's end.
double drawn_end_ms(const SimResult& result);

}  // namespace spillway::sim
