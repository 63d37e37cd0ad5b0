#include "testing/offload_oracle.h"

#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "spillway/error.h"

namespace spillway::testing {
namespace {

using Index = std::unordered_map<NodeId, std::size_t>;

Index index_of(const Graph& graph) {
  Index index;
  for (std::size_t i = 0; i < graph.nodes.size(); ++i) index.emplace(graph.nodes[i].id, i);
  return index;
}

std::optional<std::int64_t> storage_of(const Graph& graph, const Index& index, NodeId id) {
  auto it = index.find(id);
  if (it == index.end()) return std::nullopt;
  const Value& value = graph.nodes[it->second].value;
  if (!value.is_tensor()) return std::nullopt;
  return value.tensor.storage;
}

void collect_nodes(const Arg& arg, std::vector<NodeId>& out) {
  if (arg.kind == Arg::Kind::kNode) out.push_back(arg.node);
  for (const Arg& item : arg.list) collect_nodes(item, out);
}

std::vector<NodeId> inputs_of(const Node& node) {
  std::vector<NodeId> ids;
  node.for_each_input([&](NodeId id) { ids.push_back(id); });
  return ids;
}

const Arg* find_kwarg(const Node& node, const std::string& name) {
  for (const auto& [key, arg] : node.kwargs) {
    if (key == name) return &arg;
  }
  return nullptr;
}

bool is_collective(const OpSchema* schema) {
  return schema && schema->ns.rfind("_c10d_functional", 0) == 0;
}

std::string name_of(const Graph& graph, const Index& index, NodeId id) {
  auto it = index.find(id);
  return it == index.end() ? "#" + std::to_string(id) : graph.nodes[it->second].name;
}

}  // namespace

bool in_scope(const Node& node, const std::string& scope) {
  for (const std::string& module : node.module_stack) {
    const std::size_t dot = module.rfind('.');
    const std::string leaf = dot == std::string::npos ? module : module.substr(dot + 1);
    if (leaf == scope) return true;
  }
  return false;
}

std::set<std::int64_t> possibly_written_storages(const Graph& graph) {
  const Index index = index_of(graph);
  std::set<std::int64_t> written;
  auto add_all_tensor_args = [&](const Node& node) {
    for (NodeId id : inputs_of(node)) {
      if (auto storage = storage_of(graph, index, id)) written.insert(*storage);
    }
  };
  for (const Node& node : graph.nodes) {
    if (node.kind != NodeKind::kCallFunction && node.kind != NodeKind::kCallMethod &&
        node.kind != NodeKind::kCallModule) {
      continue;
    }
    const OpSchema* schema = graph.schema_of(node);
    if (schema == nullptr) {
      add_all_tensor_args(node);
      continue;
    }
    if (!schema->is_mutable) continue;
    std::vector<std::int64_t> keys;
    bool resolved = false;
    bool unresolved = false;
    std::size_t position = 0;
    for (const OpArgument& argument : schema->arguments) {
      std::optional<std::size_t> slot;
      if (!argument.kwarg_only) slot = position++;
      if (!argument.is_write) continue;
      const Arg* value = find_kwarg(node, argument.name);
      if (value == nullptr && slot && *slot < node.args.size()) value = &node.args[*slot];
      if (value == nullptr) {
        unresolved = true;
        continue;
      }
      std::vector<NodeId> targets;
      collect_nodes(*value, targets);
      if (targets.empty()) continue;
      resolved = true;
      for (NodeId id : targets) {
        if (auto storage = storage_of(graph, index, id)) {
          keys.push_back(*storage);
        } else {
          unresolved = true;
        }
      }
    }
    if (unresolved || !resolved) {
      add_all_tensor_args(node);
    } else {
      written.insert(keys.begin(), keys.end());
    }
  }
  return written;
}

std::vector<std::string> check_offload_plan(const Graph& original,
                                            const ActivationPlanOptions& options,
                                            const PlanResult& result) {
  std::vector<std::string> problems;
  auto fail = [&](std::string message) { problems.push_back(std::move(message)); };
  const Graph& rewritten = result.graph;
  const Plan& plan = result.plan;

  try {
    verify_graph(rewritten);
  } catch (const Error& e) {
    fail(std::string("rewritten graph fails verify_graph: ") + e.what());
  }
  try {
    verify_offload_graph(original, rewritten);
  } catch (const Error& e) {
    fail(std::string("rewritten graph fails verify_offload_graph: ") + e.what());
  }

  const Index original_index = index_of(original);
  const Index rewritten_index = index_of(rewritten);

  // Original nodes survive unchanged but for redirected inputs, in their order.
  std::size_t previous_position = 0;
  bool first = true;
  for (const Node& node : original.nodes) {
    auto it = rewritten_index.find(node.id);
    if (it == rewritten_index.end()) {
      fail("original node " + node.name + " is missing from the rewritten graph");
      continue;
    }
    const Node& copy = rewritten.nodes[it->second];
    if (copy.name != node.name || copy.kind != node.kind || copy.target != node.target ||
        copy.phase != node.phase || !(copy.value == node.value) ||
        copy.module_stack != node.module_stack) {
      fail("original node " + node.name + " changed more than its inputs");
    }
    if (!first && it->second <= previous_position) {
      fail("original node " + node.name + " moved before an earlier node");
    }
    previous_position = it->second;
    first = false;
  }

  if (options.mode == ActivationMode::kNone) {
    if (!plan.offloads.empty() || !plan.edits.empty() ||
        rewritten.nodes.size() != original.nodes.size()) {
      fail("mode none changed the graph");
    }
    return problems;
  }

  // Storage groups of the original graph.
  std::map<std::int64_t, std::vector<const Node*>> members;  // in graph order
  for (const Node& node : original.nodes) {
    if (node.value.is_tensor() && node.value.tensor.storage) {
      members[*node.value.tensor.storage].push_back(&node);
    }
  }
  std::unordered_set<NodeId> returned;
  for (const Node& node : original.nodes) {
    if (node.kind == NodeKind::kOutput) {
      for (NodeId id : inputs_of(node)) returned.insert(id);
    }
  }
  const std::set<std::int64_t> written = possibly_written_storages(original);

  std::int64_t total = 0;
  std::unordered_set<NodeId> forbidden_in_backward;  // offloaded values and forward aliases
  for (const Offload& offload : plan.offloads) {
    total += offload.bytes;
    auto it = original_index.find(offload.producer);
    if (it == original_index.end()) {
      fail("offload names unknown producer " + std::to_string(offload.producer));
      continue;
    }
    const Node& producer = original.nodes[it->second];
    const std::string who = "chosen value " + producer.name + ": ";
    const OpSchema* schema = original.schema_of(producer);
    if (producer.phase != Phase::kForward || producer.kind != NodeKind::kCallFunction) {
      fail(who + "not a forward call_function");
    }
    if (schema && schema->is_view) fail(who + "is a view");
    if (is_collective(schema)) fail(who + "is a collective");
    if (!producer.value.is_tensor()) {
      fail(who + "is not tensor-valued");
      continue;
    }
    const TensorInfo& tensor = producer.value.tensor;
    const std::optional<std::int64_t> bytes = tensor.nbytes();
    if (tensor.dtensor_like) fail(who + "is DTensor-like");
    if (tensor.rank() < 2) fail(who + "has rank " + std::to_string(tensor.rank()));
    if (!tensor.contiguous) fail(who + "is not contiguous");
    if (!bytes) {
      fail(who + "has an unbacked size");
    } else {
      if (*bytes < options.min_bytes) {
        fail(who + std::to_string(*bytes) + " bytes < min_bytes " +
             std::to_string(options.min_bytes));
      }
      if (*bytes != offload.bytes) {
        fail(who + "offload records " + std::to_string(offload.bytes) + " bytes, value has " +
             std::to_string(*bytes));
      }
    }
    if (!in_scope(producer, options.scope)) fail(who + "is outside scope " + options.scope);
    if (!tensor.storage) {
      fail(who + "has an unknown storage");
      continue;
    }
    const std::int64_t storage = *tensor.storage;
    if (written.count(storage)) fail(who + "its storage may be written in place");
    const std::vector<const Node*>& group = members[storage];
    if (group.front()->id != producer.id) {
      fail(who + "is not the first producer of its storage (" + group.front()->name + " is)");
    }
    bool read_in_backward = false;
    std::unordered_set<NodeId> group_ids;
    for (const Node* member : group) {
      group_ids.insert(member->id);
      if (member->kind != NodeKind::kCallFunction) {
        fail(who + "its storage is shared by " + std::string(to_string(member->kind)) + " " +
             member->name);
      }
      if (returned.count(member->id))
        fail(who + "its storage is returned by the output (" + member->name + ")");
      if (member->phase == Phase::kForward) forbidden_in_backward.insert(member->id);
    }
    for (const Node& node : original.nodes) {
      if (node.phase != Phase::kBackward) continue;
      for (NodeId id : inputs_of(node)) read_in_backward = read_in_backward || group_ids.count(id);
    }
    if (!read_in_backward) fail(who + "no backward node reads it or an alias");

    // The forward wait follows every forward reader of the storage group.
    auto wait = rewritten_index.find(offload.forward_wait_node);
    if (wait == rewritten_index.end()) {
      fail(who + "forward wait node " + std::to_string(offload.forward_wait_node) + " missing");
    } else {
      for (std::size_t i = 0; i < rewritten.nodes.size(); ++i) {
        const Node& reader = rewritten.nodes[i];
        // Transfer nodes pin or move memory and never compute on it: another
        // value's forward wait may name this one as its last-use token.
        if (reader.phase != Phase::kForward || reader.target.rfind("spillway.", 0) == 0) continue;
        for (NodeId id : inputs_of(reader)) {
          if (group_ids.count(id) && original_index.count(id) &&
              original.nodes[original_index.at(id)].phase == Phase::kForward && i > wait->second) {
            fail(who + "forward reader " + reader.name + " runs after the forward wait " +
                 rewritten.nodes[wait->second].name);
          }
        }
      }
    }
  }
  if (total != plan.bytes_offloaded) {
    fail("bytes_offloaded " + std::to_string(plan.bytes_offloaded) + " != sum of offloads " +
         std::to_string(total));
  }
  if (options.host_budget_bytes > 0 && total > options.host_budget_bytes) {
    fail("offloaded " + std::to_string(total) + " bytes over the budget of " +
         std::to_string(options.host_budget_bytes));
  }
  if (static_cast<std::int64_t>(plan.offloads.size()) > plan.candidate_count) {
    fail("more values chosen than candidates");
  }
  // The budget is filled greedily: a candidate left out for the budget would
  // not fit beside what was chosen, and nothing is left out when unlimited.
  std::int64_t over_budget = 0;
  for (const ValueDecision& decision : plan.decisions) {
    if (decision.rule != Rule::kOverBudget) continue;
    ++over_budget;
    if (options.host_budget_bytes == 0) {
      fail(decision.name + " left out for the budget with an unlimited budget");
    } else if (decision.bytes && total + *decision.bytes <= options.host_budget_bytes) {
      fail(decision.name + " (" + std::to_string(*decision.bytes) +
           " bytes) left out for the budget but fits beside the " + std::to_string(total) +
           " chosen bytes");
    }
  }
  if (plan.candidate_count != static_cast<std::int64_t>(plan.offloads.size()) + over_budget) {
    fail("candidate_count " + std::to_string(plan.candidate_count) + " != chosen " +
         std::to_string(plan.offloads.size()) + " + over budget " + std::to_string(over_budget));
  }
  std::int64_t prefetched = 0;
  for (const Offload& offload : plan.offloads) prefetched += offload.prefetched;
  if (prefetched != plan.reloads_prefetched) fail("reloads_prefetched disagrees with offloads");
  if (options.prefetch_regions == 0 && plan.reloads_prefetched != 0) {
    fail("reloads prefetched with prefetch_regions 0");
  }

  for (const Node& node : rewritten.nodes) {
    if (node.phase != Phase::kBackward) continue;
    for (NodeId id : inputs_of(node)) {
      if (forbidden_in_backward.count(id)) {
        fail("backward node " + node.name + " reads offloaded value or alias " +
             name_of(original, original_index, id));
      }
    }
  }
  return problems;
}

}  // namespace spillway::testing
