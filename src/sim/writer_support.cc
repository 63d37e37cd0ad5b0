#include "sim/writer_support.h"

#include <algorithm>

#include "spillway/error.h"

namespace spillway::sim {

std::array<std::int64_t, kMemoryCategoryCount> drawn_bytes(const TimelinePoint& point) {
  std::array<std::int64_t, kMemoryCategoryCount> bytes = point.by_category;
  bytes[static_cast<int>(MemoryCategory::kTemporaries)] += point.scratch_bytes;
  return bytes;
}

NodeNames::NodeNames(const Graph& graph) {
  nodes_.reserve(graph.nodes.size());
  for (const Node& node : graph.nodes) nodes_.emplace(node.id, &node);
}

const Node* NodeNames::find(NodeId id) const {
  const auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : it->second;
}

std::string NodeNames::name(NodeId id) const {
  if (const Node* node = find(id)) return node->name;
  return "#" + std::to_string(id);
}

void require_timeline(const SimResult& result, std::string_view writer) {
  if (!result.timeline.empty()) return;
  throw InvalidArgument("sim", std::string(writer) +
                                   " needs a result simulated with record_timeline (this "
                                   "result has no timeline; set SimOptions::record_timeline)");
}

const TimelinePoint* first_backward_point(const NodeNames& names, const SimResult& result) {
  for (const TimelinePoint& point : result.timeline) {
    const Node* node = names.find(point.node);
    if (node != nullptr && node->phase == Phase::kBackward &&
        node->kind != NodeKind::kPlaceholder && node->kind != NodeKind::kGetAttr) {
      return &point;
    }
  }
  return nullptr;
}

double drawn_end_ms(const SimResult& result) {
  double end = result.step_ms;
  for (const TimelinePoint& point : result.timeline) end = std::max(end, point.end_ms);
  for (const StreamInterval& interval : result.intervals) end = std::max(end, interval.end_ms);
  return end;
}

}  // namespace spillway::sim
