// CostModel: per-node compute time (measured time_ms, else a roofline
// estimate from size hints) and per-transfer copy time (the profile's link
// curves).

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string_view>
#include <utility>

#include "sim/node_cost.h"
#include "sim/tensor_bytes.h"
#include "spillway/sim.h"

namespace spillway {
namespace sim {
namespace {

constexpr std::string_view kGetitemTarget = "operator.getitem";
constexpr std::string_view kSpillwayPrefix = "spillway.";
// Backward of attention recomputes the scores and forms three gradients:
// about 2.5x the forward FLOPs (FlashAttention-2's accounting).
constexpr double kAttentionBackwardFactor = 2.5;
// Backward of linear/convolution: grad input and grad weight, each a forward.
constexpr double kTwoGradientsFactor = 2.0;
// find_arg's position for an argument looked up by its schema name only.
constexpr std::size_t kByNameOnly = std::numeric_limits<std::size_t>::max();

// "mm" of "aten.mm.default"; the whole target when it has no namespace.
std::string_view op_name(std::string_view target) {
  const std::size_t first = target.find('.');
  if (first == std::string_view::npos) return target;
  const std::size_t second = target.find('.', first + 1);
  const std::size_t length =
      second == std::string_view::npos ? std::string_view::npos : second - first - 1;
  return target.substr(first + 1, length);
}

// The argument named `name` by the schema (positional or keyword), or the
// positional argument at `position` when the schema does not name it (no
// schema, or one with made-up names); nullptr when absent.
const Arg* find_arg(const Node& node, const OpSchema* schema, std::string_view name,
                    std::size_t position) {
  if (schema != nullptr) {
    for (std::size_t i = 0; i < schema->arguments.size(); ++i) {
      if (schema->arguments[i].name != name) continue;
      if (!schema->arguments[i].kwarg_only && i < node.args.size()) return &node.args[i];
      for (const auto& [key, arg] : node.kwargs) {
        if (key == name) return &arg;
      }
      return nullptr;  // named by the schema, not passed: its default
    }
  }
  return position < node.args.size() ? &node.args[position] : nullptr;
}

// The tensor an argument refers to, or nullptr.
const TensorInfo* tensor_arg(const Node& node, const OpSchema* schema, std::string_view name,
                             std::size_t position, const NodeLookup& lookup) {
  const Arg* arg = find_arg(node, schema, name, position);
  if (arg == nullptr || arg->kind != Arg::Kind::kNode) return nullptr;
  const Node* input = lookup.find(arg->node);
  if (input == nullptr || !input->value.is_tensor()) return nullptr;
  return &input->value.tensor;
}

bool bool_arg(const Node& node, const OpSchema* schema, std::string_view name,
              std::size_t position) {
  const Arg* arg = find_arg(node, schema, name, position);
  return arg != nullptr && arg->kind == Arg::Kind::kBool && arg->b;
}

std::int64_t dim_hint(const TensorInfo& t, int from_end) {
  const int at = t.rank() - from_end;
  if (at < 0) return 0;
  const SymSize& size = t.sizes[static_cast<std::size_t>(at)];
  return size.hint.value_or(0);
}

const TensorInfo* first_output_tensor(const Value& value) {
  if (value.is_tensor()) return &value.tensor;
  for (const Value& element : value.elements) {
    if (const TensorInfo* t = first_output_tensor(element)) return t;
  }
  return nullptr;
}

bool holds_tensor(const Value& value) { return first_output_tensor(value) != nullptr; }

// What a node computes: FLOPs and the operand whose element size picks the
// peak (nullptr when the node is not in the matmul family).
enum class WorkKind { kMatmul, kAttention, kAttentionBackward };
struct Work {
  double flops = 0;
  const TensorInfo* operand = nullptr;
  WorkKind kind = WorkKind::kMatmul;
};

// 2 * numel(out) * K, K the contracted dimension: the last one of `a`.
Work matmul_work(const TensorInfo* a, const TensorInfo* out) {
  if (a == nullptr || out == nullptr) return {};
  return {2.0 * static_cast<double>(hinted_numel(*out)) * static_cast<double>(dim_hint(*a, 1)), a};
}

Work attention_work(const Node& node, const OpSchema* schema, const NodeLookup& lookup,
                    bool backward) {
  const std::size_t first = backward ? 1 : 0;  // backward starts with grad_out
  const TensorInfo* q = tensor_arg(node, schema, "query", first, lookup);
  const TensorInfo* k = tensor_arg(node, schema, "key", first + 1, lookup);
  const TensorInfo* v = tensor_arg(node, schema, "value", first + 2, lookup);
  if (q == nullptr || k == nullptr || v == nullptr) return {};
  const std::int64_t d = dim_hint(*q, 1);
  if (d <= 0) return {};
  // B*H*Lq rows of Q, each against Lk keys: QK^T then PV.
  const double rows = static_cast<double>(hinted_numel(*q) / d);
  double work = 2.0 * rows * static_cast<double>(dim_hint(*k, 2)) *
                static_cast<double>(d + dim_hint(*v, 1));
  if (bool_arg(node, schema, "is_causal", kByNameOnly)) work *= 0.5;
  if (backward) work *= kAttentionBackwardFactor;
  return {work, q, backward ? WorkKind::kAttentionBackward : WorkKind::kAttention};
}

Work convolution_work(const Node& node, const OpSchema* schema, const NodeLookup& lookup,
                      bool backward) {
  // convolution(input, weight, bias, stride, padding, dilation, transposed, ...);
  // convolution_backward(grad_output, input, weight, ...).
  const TensorInfo* weight = tensor_arg(node, schema, "weight", backward ? 2 : 1, lookup);
  if (weight == nullptr || weight->rank() < 1 || dim_hint(*weight, weight->rank()) <= 0) return {};
  const double per_output = static_cast<double>(hinted_numel(*weight)) /
                            static_cast<double>(dim_hint(*weight, weight->rank()));
  const TensorInfo* scaled = nullptr;  // the tensor whose elements each cost per_output MACs
  if (backward) {
    scaled = tensor_arg(node, schema, "grad_output", 0, lookup);
  } else if (bool_arg(node, schema, "transposed", 6)) {
    scaled = tensor_arg(node, schema, "input", 0, lookup);
  } else {
    scaled = first_output_tensor(node.value);
  }
  if (scaled == nullptr) return {};
  double work = 2.0 * static_cast<double>(hinted_numel(*scaled)) * per_output;
  if (backward) work *= kTwoGradientsFactor;
  return {work, weight};
}

Work work_of(const Node& node, const OpSchema* schema, const NodeLookup& lookup) {
  if (node.kind != NodeKind::kCallFunction) return {};
  const std::string_view name = op_name(node.target);
  const TensorInfo* out = first_output_tensor(node.value);
  if (name == "mm" || name == "bmm" || name == "matmul") {
    return matmul_work(tensor_arg(node, schema, "self", 0, lookup), out);
  }
  if (name == "addmm") return matmul_work(tensor_arg(node, schema, "mat1", 1, lookup), out);
  if (name == "baddbmm") return matmul_work(tensor_arg(node, schema, "batch1", 1, lookup), out);
  if (name == "linear") return matmul_work(tensor_arg(node, schema, "input", 0, lookup), out);
  if (name == "linear_backward") {
    // linear_backward(self, grad_output, weight, mask): grad_output is [.., out].
    const TensorInfo* input = tensor_arg(node, schema, "self", 0, lookup);
    const TensorInfo* grad = tensor_arg(node, schema, "grad_output", 1, lookup);
    Work w = matmul_work(input, grad);
    w.flops *= kTwoGradientsFactor;
    return w;
  }
  const bool backward = name.ends_with("_backward");
  if (is_attention(name)) {
    return attention_work(node, schema, lookup, backward);
  }
  if (name.find("convolution") != std::string_view::npos) {
    return convolution_work(node, schema, lookup, backward);
  }
  return {};
}

// A non-mutating op whose tensor result lives on the storage of a tensor it
// reads: an alias the schema does not call a view (_unsafe_view, alias).
bool aliases_an_input(const Node& node, const OpSchema* schema, const NodeLookup& lookup) {
  if (schema != nullptr && schema->is_mutable) return false;
  if (!node.value.is_tensor() || !node.value.tensor.storage) return false;
  const std::int64_t storage = *node.value.tensor.storage;
  bool found = false;
  node.for_each_input([&](NodeId id) {
    if (found) return;
    const Node* input = lookup.find(id);
    found = input != nullptr && input->value.is_tensor() && input->value.tensor.storage == storage;
  });
  return found;
}

// The rate a node's FLOPs run at: the profile's attention rates for 16-bit
// attention where it has them, else the matmul peak of the operand's width.
double peak_tflops(const DeviceProfile& profile, const Work& work) {
  if (work.operand->element_size > 2) return profile.matmul_tflops_fp32;
  double attention = 0;
  if (work.kind == WorkKind::kAttention) attention = profile.attention_tflops_bf16;
  if (work.kind == WorkKind::kAttentionBackward) {
    attention = profile.attention_backward_tflops_bf16;
  }
  return attention > 0 ? attention : profile.matmul_tflops_bf16;
}

}  // namespace

bool takes_no_time(const Node& node, const OpSchema* schema, const NodeLookup& lookup) {
  switch (node.kind) {
    case NodeKind::kPlaceholder:
    case NodeKind::kGetAttr:
    case NodeKind::kOutput:
      return true;
    default:
      break;
  }
  if (node.target == kGetitemTarget || node.target.starts_with(kSpillwayPrefix)) return true;
  if (schema != nullptr && schema->is_view) return true;
  if (aliases_an_input(node, schema, lookup)) return true;
  if (holds_tensor(node.value)) return false;
  bool reads_tensor = false;
  node.for_each_input([&](NodeId id) {
    const Node* input = lookup.find(id);
    reads_tensor = reads_tensor || (input != nullptr && holds_tensor(input->value));
  });
  return !reads_tensor;  // scalar arithmetic on sizes launches no kernel
}

double flops(const Node& node, const OpSchema* schema, const NodeLookup& lookup) {
  return work_of(node, schema, lookup).flops;
}

double estimate_ms(const DeviceProfile& profile, const Node& node, const OpSchema* schema,
                   const NodeLookup& lookup) {
  if (takes_no_time(node, schema, lookup)) return 0;
  double bytes = static_cast<double>(lookup.value_bytes(node.id));
  node.for_each_input([&](NodeId id) {
    bytes += static_cast<double>(lookup.value_bytes(id));
  });
  double ms = profile.memory_gbs > 0 ? bytes / (profile.memory_gbs * 1e6) : 0;
  const Work work = work_of(node, schema, lookup);
  if (work.flops > 0 && work.operand != nullptr) {
    const double tflops = peak_tflops(profile, work);
    if (tflops > 0) ms = std::max(ms, work.flops / (tflops * 1e9));
  }
  return ms + profile.launch_us * 1e-3;
}

double node_ms(const DeviceProfile& profile, const Node& node, const OpSchema* schema,
               const NodeLookup& lookup) {
  if (node.time_ms) return *node.time_ms;
  return estimate_ms(profile, node, schema, lookup);
}

}  // namespace sim

CostModel::CostModel(DeviceProfile profile) : profile_(std::move(profile)) {}

double CostModel::node_ms(const Graph& graph, const Node& node) const {
  const sim::NodeLookup lookup(graph, sim::NodeLookup::Mode::kScan);
  return sim::node_ms(profile_, node, graph.schema_of(node), lookup);
}

double CostModel::estimate_ms(const Graph& graph, const Node& node) const {
  const sim::NodeLookup lookup(graph, sim::NodeLookup::Mode::kScan);
  return sim::estimate_ms(profile_, node, graph.schema_of(node), lookup);
}

double CostModel::flops(const Graph& graph, const Node& node) const {
  const sim::NodeLookup lookup(graph, sim::NodeLookup::Mode::kScan);
  return sim::flops(node, graph.schema_of(node), lookup);
}

double CostModel::d2h_ms(std::int64_t bytes, bool duplex) const {
  if (bytes <= 0) return 0;
  const LinkCurve& curve = duplex ? profile_.d2h_duplex : profile_.d2h;
  return static_cast<double>(bytes) / (curve.gbs(bytes) * 1e6);
}

double CostModel::h2d_ms(std::int64_t bytes, bool duplex) const {
  if (bytes <= 0) return 0;
  const LinkCurve& curve = duplex ? profile_.h2d_duplex : profile_.h2d;
  return static_cast<double>(bytes) / (curve.gbs(bytes) * 1e6);
}

}  // namespace spillway
