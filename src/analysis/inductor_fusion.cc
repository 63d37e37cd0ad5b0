#include "analysis/inductor_fusion.h"

#include <algorithm>
#include <array>
#include <string_view>

namespace spillway::analysis {
namespace {

constexpr std::array<std::string_view, 4> kPointwiseByName = {
    "aten._to_copy.default",
    "prims.convert_element_type.default",
    "aten.where.self",
    "aten.clone.default",
};

// Overloads whose Inductor lowering is a loop body fused with its pointwise
// neighbours (Note [What Inductor fuses] has the kernels that show it).
constexpr std::array<std::string_view, 21> kFusedReductionsAndLayout = {
    "aten._log_softmax.default",
    "aten._log_softmax_backward_data.default",
    "aten._softmax.default",
    "aten._softmax_backward_data.default",
    "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default",
    "aten.gather.default",
    "aten.sum.default",
    "aten.sum.dim_IntList",
    "aten.mean.default",
    "aten.mean.dim",
    "aten.amax.default",
    "aten.cat.default",
    "aten.slice_backward.default",
    "aten.constant_pad_nd.default",
    "aten.embedding.default",
    "aten.arange.default",
    "aten.arange.start",
    "aten.arange.start_step",
    "aten.scalar_tensor.default",
    "prims.iota.default",
};

template <std::size_t N>
bool listed(const std::array<std::string_view, N>& targets, std::string_view target) {
  return std::find(targets.begin(), targets.end(), target) != targets.end();
}

}  // namespace

bool is_inductor_pointwise(const Node& node, const OpSchema* schema) {
  if (node.kind != NodeKind::kCallFunction) return false;
  if (schema != nullptr && schema->is_pointwise) return true;
  return listed(kPointwiseByName, node.target);
}

bool is_inductor_fused(const Node& node, const OpSchema* schema) {
  if (is_inductor_pointwise(node, schema)) return true;
  return node.kind == NodeKind::kCallFunction && listed(kFusedReductionsAndLayout, node.target);
}

}  // namespace spillway::analysis
