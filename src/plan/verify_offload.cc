// verify_offload_graph: the offload invariants (a)-(d) of plan.h.
//
// Aliases of an offloaded value P are taken from the original graph: P's
// storage-group members and the closure of forward views and storage sharers
// (analysis::forward_aliases). Transfer nodes (spillway.* / ao.*) are not
// readers: they move or pin memory, they do not compute on it.

#include <string>
#include <unordered_set>

#include "analysis/alias_chain.h"
#include "analysis/graph_index.h"
#include "analysis/op_facts.h"
#include "analysis/storage_groups.h"
#include "analysis/write_safety.h"
#include "plan/dense_layout.h"
#include "spillway/error.h"
#include "spillway/plan.h"

namespace spillway {
namespace {

std::string label(const Node& node) {
  return "node " + std::to_string(node.id) + " (" + node.name + ")";
}

[[noreturn]] void fail(const Node& value, const std::string& invariant, const std::string& what) {
  throw InvalidGraph("plan", "offloaded value " + label(value) + ": invariant (" + invariant +
                                 ") broken: " + what);
}

bool first_arg_is(const Node& node, NodeId id) {
  return !node.args.empty() && node.args[0].kind == Arg::Kind::kNode && node.args[0].node == id;
}

// The single reader of `source` with `target` whose first argument is `source`.
const Node& single_chained(const analysis::GraphIndex& index, const Node& value,
                           const Node& source, std::string_view target, const char* what) {
  const Node* found = nullptr;
  int count = 0;
  for (NodeId user : index.users(source.id)) {
    const Node& reader = index.node(user);
    if (reader.target == target && first_arg_is(reader, source.id)) {
      found = &reader;
      ++count;
    }
  }
  if (count != 1) {
    fail(value, "a", label(source) + " has " + std::to_string(count) + " " + what +
                         " (expected exactly one)");
  }
  return *found;
}

}  // namespace

void verify_offload_graph(const Graph& original, const Graph& rewritten) {
  verify_graph(rewritten);
  const analysis::GraphIndex before(original);
  const analysis::StorageGroups groups(before);
  const analysis::GraphIndex after(rewritten);
  std::unordered_map<std::int64_t, NodeId> written;
  bool written_known = false;

  for (const Node& offload : rewritten.nodes) {
    if (offload.kind != NodeKind::kCallFunction || offload.target != kOffloadTarget) continue;
    if (offload.args.empty() || offload.args[0].kind != Arg::Kind::kNode ||
        !after.contains(offload.args[0].node)) {
      throw InvalidGraph("plan", label(offload) +
                                     " does not offload a node of the original graph");
    }
    NodeId moved = offload.args[0].node;
    if (!before.contains(moved)) {
      // dense_storages: a contiguous aten.permute view of an original node.
      const Node& view = after.node(moved);
      if (view.target != plan::kPermuteTarget || view.args.empty() ||
          view.args[0].kind != Arg::Kind::kNode || !before.contains(view.args[0].node)) {
        throw InvalidGraph("plan", label(offload) +
                                       " does not offload a node of the original graph");
      }
      if (!view.value.is_tensor() || !view.value.tensor.contiguous) {
        fail(after.node(view.args[0].node), "a",
             label(offload) + " moves " + label(view) + ", which is not contiguous");
      }
      moved = view.args[0].node;
    }
    const Node& value = after.node(moved);

    // (a) offload -> forward wait -> reload -> backward wait.
    const Node& forward_wait = single_chained(after, value, offload, kWaitTarget, "forward waits");
    const Node& reload = single_chained(after, value, forward_wait, kReloadTarget, "reloads");
    const Node& backward_wait = single_chained(after, value, reload, kWaitTarget, "backward waits");
    if (forward_wait.phase != Phase::kForward || reload.phase != Phase::kBackward ||
        backward_wait.phase != Phase::kBackward) {
      fail(value, "a", "the transfer chain has the wrong phases");
    }

    // (b) transfers are read only after their waits; the forward wait follows
    // every forward reader of the storage group.
    const std::size_t forward_wait_at = after.position(forward_wait.id);
    for (const auto& [transfer, wait] : {std::pair{&offload, &forward_wait}, {&reload, &backward_wait}}) {
      for (NodeId user : after.users(transfer->id)) {
        if (user != wait->id && after.position(user) < after.position(wait->id)) {
          fail(value, "b", label(after.node(user)) + " reads " + label(*transfer) +
                               " before " + label(*wait));
        }
      }
    }
    std::vector<NodeId> aliases = analysis::forward_aliases(before, groups, value.id);
    aliases.push_back(value.id);
    for (NodeId alias : aliases) {
      if (!after.contains(alias)) continue;
      if (after.node(alias).phase == Phase::kForward && after.position(alias) > forward_wait_at) {
        fail(value, "b", "alias " + label(after.node(alias)) + " is produced after " +
                             label(forward_wait));
      }
      for (NodeId user : after.users(alias)) {
        const Node& reader = after.node(user);
        if (analysis::is_offload_op(reader)) continue;
        if (reader.phase == Phase::kForward && after.position(user) > forward_wait_at) {
          fail(value, "b", "forward " + label(reader) + " reads " + label(after.node(alias)) +
                               " after " + label(forward_wait));
        }
        // (c) backward reads go through the reload chain.
        if (reader.phase == Phase::kBackward) {
          fail(value, "c", "backward " + label(reader) + " reads " + label(after.node(alias)) +
                               " directly");
        }
      }
    }

    // (d) never written in place.
    if (!written_known) {
      written = analysis::find_written_storages(after);
      written_known = true;
    }
    for (NodeId alias : aliases) {
      if (!after.contains(alias)) continue;
      std::optional<std::int64_t> storage = analysis::storage_of(after.node(alias));
      if (!storage) continue;
      if (auto it = written.find(*storage); it != written.end()) {
        fail(value, "d", "storage " + std::to_string(*storage) + " is written in place by " +
                             label(after.node(it->second)));
      }
    }
  }
}

}  // namespace spillway
