#include "testing/offload_oracle.h"

#include <algorithm>
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

std::optional<std::vector<std::int64_t>> hints(const std::vector<SymSize>& dims) {
  std::vector<std::int64_t> out;
  for (const SymSize& dim : dims) {
    if (!dim.hint) return std::nullopt;
    out.push_back(*dim.hint);
  }
  return out;
}

// Row-major strides of `sizes` (torch's empty(sizes).stride()).
std::vector<std::int64_t> row_major(const std::vector<std::int64_t>& sizes) {
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::size_t i = sizes.size(); i-- > 1;) {
    strides[i - 1] = strides[i] * std::max<std::int64_t>(sizes[i], 1);
  }
  return strides;
}

// True when some permutation of the dimensions, laid out row-major, gives
// exactly the recorded strides (every dimension, size-1 ones included).
// Found by trying every permutation, not by the planner's sort.
bool dense_by_search(const TensorInfo& tensor) {
  const auto sizes = hints(tensor.sizes);
  const auto strides = hints(tensor.strides);
  if (!sizes || !strides || strides->size() != sizes->size() || sizes->size() > 8) return false;
  for (std::int64_t size : *sizes) {
    if (size < 1) return false;
  }
  std::vector<std::size_t> order(sizes->size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  do {
    std::vector<std::int64_t> permuted;
    permuted.reserve(order.size());
    for (std::size_t dim : order) permuted.push_back((*sizes)[dim]);
    const std::vector<std::int64_t> laid = row_major(permuted);
    bool match = true;
    for (std::size_t k = 0; k < order.size() && match; ++k) match = laid[k] == (*strides)[order[k]];
    if (match) return true;
  } while (std::next_permutation(order.begin(), order.end()));
  return false;
}

// Bytes from a strided tensor's first element to its last, inclusive.
std::optional<std::int64_t> reach_of(const TensorInfo& tensor) {
  const auto sizes = hints(tensor.sizes);
  const auto strides = hints(tensor.strides);
  if (!sizes || !strides || strides->size() != sizes->size()) return std::nullopt;
  std::int64_t last = 0;
  for (std::size_t i = 0; i < sizes->size(); ++i) {
    if ((*sizes)[i] == 0) return 0;
    last += ((*sizes)[i] - 1) * std::max<std::int64_t>((*strides)[i], 0);
  }
  return (last + 1) * tensor.element_size;
}

bool same_layout(const TensorInfo& a, const TensorInfo& b) {
  return a.sizes == b.sizes && a.strides == b.strides;
}

// The dims of an aten.permute.default node, when they are a permutation of
// 0..rank-1; nullopt otherwise.
std::optional<std::vector<std::size_t>> permute_dims(const Node& node, std::size_t rank) {
  if (node.target != "aten.permute.default" || node.args.size() != 2 ||
      node.args[1].kind != Arg::Kind::kList || node.args[1].list.size() != rank) {
    return std::nullopt;
  }
  std::vector<std::size_t> dims;
  std::vector<bool> seen(rank, false);
  for (const Arg& item : node.args[1].list) {
    if (item.kind != Arg::Kind::kInt || item.i < 0 || static_cast<std::size_t>(item.i) >= rank ||
        seen[static_cast<std::size_t>(item.i)]) {
      return std::nullopt;
    }
    seen[static_cast<std::size_t>(item.i)] = true;
    dims.push_back(static_cast<std::size_t>(item.i));
  }
  return dims;
}

// Whether `out` is what aten.permute(in, dims) produces (sizes and strides).
bool permutes_to(const TensorInfo& in, const std::vector<std::size_t>& dims,
                 const TensorInfo& out) {
  if (in.sizes.size() != dims.size() || out.sizes.size() != dims.size() ||
      in.strides.size() != dims.size() || out.strides.size() != dims.size()) {
    return false;
  }
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (!(out.sizes[i] == in.sizes[dims[i]]) || !(out.strides[i] == in.strides[dims[i]])) {
      return false;
    }
  }
  return true;
}

bool is_row_major(const TensorInfo& tensor) {
  const auto sizes = hints(tensor.sizes);
  const auto strides = hints(tensor.strides);
  return sizes && strides && *strides == row_major(*sizes);
}

// Every (slot, node) a node reads: "args[i]" / "kwargs.k", lists flattened in order.
void slots_of(const Arg& arg, const std::string& slot, std::vector<std::pair<std::string, NodeId>>& out) {
  if (arg.kind == Arg::Kind::kNode) out.emplace_back(slot, arg.node);
  for (std::size_t i = 0; i < arg.list.size(); ++i) {
    slots_of(arg.list[i], slot + "[" + std::to_string(i) + "]", out);
  }
}
std::vector<std::pair<std::string, NodeId>> read_slots(const Node& node) {
  std::vector<std::pair<std::string, NodeId>> out;
  for (std::size_t i = 0; i < node.args.size(); ++i) {
    slots_of(node.args[i], "args[" + std::to_string(i) + "]", out);
  }
  for (const auto& [key, arg] : node.kwargs) slots_of(arg, "kwargs." + key, out);
  return out;
}

// Whether `after` is `before` but for tensors that moved to a storage in
// `read` (Note [Aliases follow a redirect] in src/plan/apply_edits.cc: a
// redirected view lives in the storage of what it now reads).
bool same_but_moved(const Value& before, const Value& after, const std::set<std::int64_t>& read) {
  if (!before.is_tensor()) {
    if (before.elements.size() != after.elements.size()) return false;
    Value shallow_before = before;
    Value shallow_after = after;
    shallow_before.elements.clear();
    shallow_after.elements.clear();
    if (!(shallow_before == shallow_after)) return false;
    for (std::size_t i = 0; i < before.elements.size(); ++i) {
      if (!same_but_moved(before.elements[i], after.elements[i], read)) return false;
    }
    return true;
  }
  if (!after.is_tensor()) return false;
  TensorInfo moved_back = after.tensor;
  if (moved_back.storage != before.tensor.storage) {
    if (!moved_back.storage || !read.count(*moved_back.storage)) return false;
    moved_back.storage = before.tensor.storage;
  }
  return moved_back == before.tensor;
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

  // Original nodes survive unchanged but for redirected inputs (and the
  // storage of a view that follows them), in their order.
  std::size_t previous_position = 0;
  bool first = true;
  for (const Node& node : original.nodes) {
    auto it = rewritten_index.find(node.id);
    if (it == rewritten_index.end()) {
      fail("original node " + node.name + " is missing from the rewritten graph");
      continue;
    }
    const Node& copy = rewritten.nodes[it->second];
    std::set<std::int64_t> read;  // the storages the copy reads
    for (NodeId id : inputs_of(copy)) {
      auto input = rewritten_index.find(id);
      if (input == rewritten_index.end()) continue;
      const Value& value = rewritten.nodes[input->second].value;
      if (value.is_tensor() && value.tensor.storage) read.insert(*value.tensor.storage);
    }
    if (copy.name != node.name || copy.kind != node.kind || copy.target != node.target ||
        copy.phase != node.phase || !same_but_moved(node.value, copy.value, read) ||
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

  std::unordered_map<NodeId, std::vector<const Node*>> backward_readers;  // original graph
  for (const Node& node : original.nodes) {
    if (node.phase != Phase::kBackward) continue;
    std::unordered_set<NodeId> inputs;
    for (NodeId id : inputs_of(node)) {
      if (inputs.insert(id).second) backward_readers[id].push_back(&node);
    }
  }
  auto rewritten_node = [&](NodeId id) -> const Node* {
    auto it = rewritten_index.find(id);
    return it == rewritten_index.end() ? nullptr : &rewritten.nodes[it->second];
  };

  // What moves is the value itself when contiguous, else a row-major permute
  // view of it; backward readers that read the value now read a node with the
  // value's sizes and strides, built from the backward wait.
  auto check_transfer_layout = [&](const Node& producer, const Offload& offload,
                                   const std::string& who) {
    const TensorInfo& tensor = producer.value.tensor;
    const Node* moved_by = rewritten_node(offload.offload_node);
    if (moved_by == nullptr || moved_by->args.empty() ||
        moved_by->args[0].kind != Arg::Kind::kNode) {
      fail(who + "offload node missing or malformed");
      return;
    }
    const Node* moved = rewritten_node(moved_by->args[0].node);
    if (moved == nullptr || !moved->value.is_tensor()) {
      fail(who + "the offload moves no tensor");
      return;
    }
    if (moved->id == producer.id && !tensor.contiguous) {
      fail(who + "the offload moves the non-contiguous value itself");
    } else if (moved->id != producer.id) {
      const auto dims = permute_dims(*moved, tensor.sizes.size());
      if (tensor.contiguous || !dims || moved->args[0].kind != Arg::Kind::kNode ||
          moved->args[0].node != producer.id || !permutes_to(tensor, *dims, moved->value.tensor)) {
        fail(who + "the offload moves " + moved->name + ", not the value or a permute of it");
      } else if (!is_row_major(moved->value.tensor) || !moved->value.tensor.contiguous) {
        fail(who + "the offloaded permute view " + moved->name + " is not row-major");
      }
    }
    if (moved->id != producer.id) {
      // The reloaded tensor has the permuted layout: only views that restore
      // the value's layout may read it.
      for (const Node& node : rewritten.nodes) {
        if (node.target.rfind("spillway.", 0) == 0) continue;
        for (NodeId id : inputs_of(node)) {
          if (id == offload.backward_wait_node && node.target != "aten.permute.default") {
            fail(who + node.name + " reads the permuted reload " +
                 name_of(rewritten, rewritten_index, id) + " without restoring its layout");
          }
        }
      }
    }
    for (const Node* reader_ptr : backward_readers[producer.id]) {
      const Node& reader = *reader_ptr;
      const Node* copy = rewritten_node(reader.id);
      if (copy == nullptr) continue;
      const auto before = read_slots(reader);
      const auto after = read_slots(*copy);
      if (before.size() != after.size()) {
        fail(who + "backward " + reader.name + " changed its argument structure");
        continue;
      }
      for (std::size_t i = 0; i < before.size(); ++i) {
        if (before[i].second != producer.id) continue;
        const Node* seen = rewritten_node(after[i].second);
        if (seen == nullptr || !seen->value.is_tensor() ||
            !same_layout(seen->value.tensor, tensor)) {
          fail(who + "backward " + reader.name + " " + before[i].first +
               " reads a value whose sizes/strides differ from the original");
          continue;
        }
        if (seen->id == producer.id) continue;  // reported below as a direct read
        // The stand-in is the backward wait, or a permute of it that
        // reproduces the value's layout from the wait's.
        const Node* wait = seen;
        if (seen->target == "aten.permute.default") {
          const auto dims = permute_dims(*seen, tensor.sizes.size());
          wait = seen->args.empty() || seen->args[0].kind != Arg::Kind::kNode
                     ? nullptr
                     : rewritten_node(seen->args[0].node);
          if (!dims || wait == nullptr || !wait->value.is_tensor() ||
              !permutes_to(wait->value.tensor, *dims, seen->value.tensor)) {
            fail(who + "restore view " + seen->name + " does not permute its input to its value");
            continue;
          }
        }
        if (wait->id != offload.backward_wait_node) {
          fail(who + "backward " + reader.name + " reads " + seen->name +
               " instead of the reload chain");
        }
      }
    }
  };

  // The forward wait depends on the last forward reader of the storage group
  // (the value itself when none reads it), or, with offload_tuple_outputs,
  // on a tensor getitem of a tuple-returning last reader.
  auto check_last_use_edge = [&](const Node& producer, const std::unordered_set<NodeId>& group_ids,
                                 const Offload& offload, const std::string& who) {
    const Node* wait = rewritten_node(offload.forward_wait_node);
    if (wait == nullptr || wait->args.size() < 3 || wait->args[2].kind != Arg::Kind::kNode) {
      fail(who + "forward wait has no last-use argument");
      return;
    }
    // Nodes on the storage: the group, and tuples/lists holding an element on
    // it (split); the last forward node reading any of them is the last use.
    std::unordered_set<NodeId> on_storage = group_ids;
    for (const Node& node : original.nodes) {
      for (const Value& element : node.value.elements) {
        if (element.is_tensor() && element.tensor.storage == producer.value.tensor.storage) {
          on_storage.insert(node.id);
        }
      }
    }
    // A getitem of a tuple reads only the element it selects.
    auto reads_storage = [&](const Node& node) {
      if (node.target == "operator.getitem" && node.args.size() == 2 &&
          node.args[0].kind == Arg::Kind::kNode && node.args[1].kind == Arg::Kind::kInt &&
          !group_ids.count(node.args[0].node) && on_storage.count(node.args[0].node)) {
        const Value& tuple = original.nodes[original_index.at(node.args[0].node)].value;
        const auto i = static_cast<std::size_t>(node.args[1].i);
        return node.args[1].i >= 0 && i < tuple.elements.size() &&
               tuple.elements[i].is_tensor() &&
               tuple.elements[i].tensor.storage == producer.value.tensor.storage;
      }
      for (NodeId id : inputs_of(node)) {
        if (on_storage.count(id)) return true;
      }
      return false;
    };
    const Node* last = &producer;
    bool after_producer = false;
    for (const Node& node : original.nodes) {
      if (node.id == producer.id) after_producer = true;
      if (!after_producer || node.phase != Phase::kForward || node.kind == NodeKind::kOutput) {
        continue;
      }
      if (reads_storage(node)) last = &node;
    }
    const Node* edge = rewritten_node(wait->args[2].node);
    if (edge == nullptr || !edge->value.is_tensor()) {
      fail(who + "forward wait's last-use argument is not a tensor");
      return;
    }
    if (edge->id == last->id) return;
    const bool tuple_getitem = edge->target == "operator.getitem" && !edge->args.empty() &&
                               edge->args[0].kind == Arg::Kind::kNode &&
                               edge->args[0].node == last->id && !last->value.is_tensor();
    if (!tuple_getitem) {
      fail(who + "forward wait depends on " + edge->name + ", not on the last forward reader " +
           last->name);
    } else if (!options.offload_tuple_outputs) {
      fail(who + "forward wait pinned through a getitem of " + last->name +
           " without offload_tuple_outputs");
    }
  };

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
    if (!tensor.contiguous) {
      if (!options.dense_storages) {
        fail(who + "is not contiguous");
      } else if (!dense_by_search(tensor)) {
        fail(who + "is not contiguous, and no permutation of a row-major layout gives its strides");
      }
    }
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
    if (!tensor.contiguous) {
      // The whole storage is the value: nothing on it reaches further.
      for (const Node* member : group) {
        const std::optional<std::int64_t> reach =
            member->value.is_tensor() ? reach_of(member->value.tensor) : std::nullopt;
        if (!reach || !bytes || *reach > *bytes) {
          fail(who + "dense storage member " + member->name + " reaches beyond its " +
               (bytes ? std::to_string(*bytes) : std::string("?")) + " bytes");
        }
      }
    }
    check_transfer_layout(producer, offload, who);
    check_last_use_edge(producer, group_ids, offload, who);

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
