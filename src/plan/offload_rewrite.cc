#include "plan/offload_rewrite.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "analysis/op_facts.h"
#include "analysis/regions.h"
#include "plan/dense_layout.h"
#include "plan/id_map.h"
#include "plan/node_sequence.h"
#include "spillway/error.h"

namespace spillway::plan {
namespace {

using PrefetchAnchor = ActivationPlanOptions::PrefetchAnchor;

OpSchema spillway_schema(std::vector<std::string> names) {
  OpSchema schema;
  schema.ns = "spillway";
  for (std::string& name : names) schema.arguments.push_back({std::move(name), false, false});
  return schema;
}

void set_storage(Value& value, std::int64_t storage) {
  if (value.is_tensor()) value.tensor.storage = storage;
  for (Value& element : value.elements) set_storage(element, storage);
}

Arg remap(const Arg& arg, const std::unordered_map<NodeId, NodeId>& map) {
  Arg out = arg;
  if (arg.kind == Arg::Kind::kNode) {
    if (auto it = map.find(arg.node); it != map.end()) out.node = it->second;
  }
  for (Arg& item : out.list) item = remap(item, map);
  return out;
}

class RewriteBuilder {
 public:
  RewriteBuilder(const analysis::GraphIndex& index, const analysis::ScopeRoots& scope)
      : index_(index), scope_(scope), fx_(original_order(index)) {
    const Graph& graph = index.graph();
    next_id_ = index.max_id() + 1;
    for (const Node& node : graph.nodes) {
      // New names all start with "spillway_": only such names can clash.
      if (node.name.starts_with("spillway_")) names_.insert(node.name);
    }
    next_storage_ = graph.max_storage() + 1;
  }

  OffloadRewrite build(const std::vector<ChosenValue>& chosen, int prefetch_regions,
                       const ReplaySelection& replay, PrefetchAnchor prefetch_anchor,
                       int release_lag, int just_in_time_regions) {
    OffloadRewrite out;
    extra_views_ = &replay.extra_views;
    for (const ChosenValue& value : chosen) out.offloads.push_back(add_forward(value));
    for (std::size_t i = 0; i < chosen.size(); ++i) add_backward(chosen[i], out.offloads[i]);
    for (const ReplayChoice& choice : replay.replays) {
      Replay added = add_replay(choice);
      if (choice.facts != nullptr) out.replays.push_back(added);
    }
    delay_forward_waits(chosen, out.offloads, release_lag);
    out.reloads_prefetched =
        prefetch(out.offloads, prefetch_regions, prefetch_anchor, just_in_time_regions);
    out.edits = express_as_edits();
    return out;
  }

 private:
  struct Pending {
    Edit edit;
    bool insertion = true;
  };

  static std::vector<NodeId> original_order(const analysis::GraphIndex& index) {
    std::vector<NodeId> ids;
    ids.reserve(index.size());
    for (const Node& node : index.graph().nodes) ids.push_back(node.id);
    return ids;
  }

  static std::vector<int> checked_dense_order(const Node& producer) {
    std::optional<std::vector<int>> order = dense_order(producer.value.tensor);
    if (!order) {
      throw Error("plan", "internal error: chosen value " + producer.name +
                              " is neither contiguous nor dense");
    }
    return *order;
  }

  static Arg int_list(const std::vector<int>& dims) {
    std::vector<Arg> items;
    items.reserve(dims.size());
    for (int dim : dims) items.push_back(Arg::of_int(dim));
    return Arg::of_list(std::move(items));
  }

  const Node& lookup(NodeId id) const {
    if (auto it = new_nodes_.find(id); it != new_nodes_.end()) return it->second;
    return index_.node(id);
  }

  std::string unique_name(const std::string& base) {
    std::string name = base;
    for (int suffix = 1; names_.count(name); ++suffix) name = base + "_" + std::to_string(suffix);
    names_.insert(name);
    return name;
  }

  Node new_node(std::string_view target, const std::string& name, std::vector<Arg> args, Phase phase,
                const Node& like, Value value) {
    Node node;
    node.id = next_id_++;
    node.name = unique_name(name);
    node.kind = NodeKind::kCallFunction;
    node.target = std::string(target);
    node.args = std::move(args);
    node.phase = phase;
    node.module_stack = like.module_stack;
    node.value = std::move(value);
    return node;
  }

  // Records an insertion: FX-style in the simulation, reference anchor in the edit.
  NodeId insert(EditKind kind, Node node, NodeId anchor, Placement placement, NodeId source) {
    const NodeId id = node.id;
    if (placement == Placement::kBefore) {
      fx_.insert_before(anchor, id);  // FX inserting_before(anchor)
    } else {
      fx_.insert_right_after(anchor, id);  // FX inserting_after(anchor)
    }
    Edit edit;
    edit.kind = kind;
    edit.anchor = anchor;
    edit.placement = placement;
    edit.source = source;
    new_nodes_.emplace(id, node);
    edit.node = std::move(node);
    edit_index_[id] = pending_.size();
    pending_.push_back({std::move(edit), true});
    return id;
  }

  void redirect(NodeId reader, NodeId from, NodeId to, NodeId source) {
    Edit edit;
    edit.kind = EditKind::kRedirect;
    edit.reader = reader;
    edit.from = from;
    edit.to = to;
    edit.source = source;
    pending_.push_back({std::move(edit), false});
  }

  Offload add_forward(const ChosenValue& value) {
    const Node& producer = index_.node(value.producer);
    const CandidateFacts& facts = *value.facts;
    Offload offload;
    offload.producer = producer.id;
    offload.bytes = value.bytes;
    offload.last_forward_use = facts.lifetime.last_forward_use;
    offload.first_backward_reader = facts.first_backward_reader;

    // A dense, non-contiguous value moves through a contiguous permute view.
    NodeId moved = producer.id;
    TensorInfo host = producer.value.tensor;
    if (!producer.value.tensor.contiguous) {
      const std::vector<int> order = checked_dense_order(producer);
      TensorInfo view = permute_info(producer.value.tensor, order);
      host = view;
      moved = offload.dense_permute_node =
          insert(EditKind::kDensePermute,
                 new_node(kPermuteTarget, "spillway_dense_" + producer.name,
                          {Arg::of_node(producer.id), int_list(order)}, Phase::kForward,
                          producer, Value::of_tensor(std::move(view))),
                 producer.id, Placement::kAfter, producer.id);
    }
    host.device = "cpu";
    host.storage = next_storage_++;
    offload.offload_node =
        insert(EditKind::kOffload,
               new_node(kOffloadTarget, "spillway_offload_" + producer.name,
                        {Arg::of_node(moved)}, Phase::kForward, producer,
                        Value::of_tensor(host)),
               moved, Placement::kAfter, producer.id);
    // The wait depends on the last use (or on the last getitem of a tuple
    // last use) and sits right after it.
    const NodeId last_use = *facts.lifetime.last_use_arg;
    const NodeId anchor = last_use == producer.id ? offload.offload_node : last_use;
    offload.forward_wait_node = insert(
        EditKind::kForwardWait,
        new_node(kWaitTarget, "spillway_wait_offload_" + producer.name,
                 {Arg::of_node(offload.offload_node), Arg::of_node(producer.id),
                  Arg::of_node(last_use)},
                 Phase::kForward, producer, Value::of_tensor(host)),
        anchor, Placement::kAfter, producer.id);
    return offload;
  }

  void add_backward(const ChosenValue& value, Offload& offload) {
    const Node& producer = index_.node(value.producer);
    const CandidateFacts& facts = *value.facts;
    const NodeId first = value.reload_before >= 0 ? value.reload_before : facts.first_backward_reader;
    offload.first_backward_reader = first;
    const bool dense = offload.dense_permute_node >= 0;
    std::vector<int> order;
    TensorInfo device = producer.value.tensor;
    if (dense) {
      order = checked_dense_order(producer);
      device = permute_info(producer.value.tensor, order);
    }
    device.storage = next_storage_++;
    offload.reload_node = insert(
        EditKind::kReload,
        new_node(kReloadTarget, "spillway_reload_" + producer.name,
                 {Arg::of_node(offload.forward_wait_node),
                  Arg::of_string(producer.value.tensor.device)},
                 Phase::kBackward, producer, Value::of_tensor(device)),
        first, Placement::kBefore, producer.id);
    offload.backward_wait_node = insert(
        EditKind::kBackwardWait,
        new_node(kWaitTarget, "spillway_wait_reload_" + producer.name,
                 {Arg::of_node(offload.reload_node), Arg::of_node(offload.forward_wait_node)},
                 Phase::kBackward, producer, Value::of_tensor(device)),
        first, Placement::kBefore, producer.id);
    NodeId restored = offload.backward_wait_node;
    if (dense) {
      TensorInfo same = producer.value.tensor;  // sizes and strides of the value
      same.storage = device.storage;
      restored = offload.restore_permute_node =
          insert(EditKind::kRestorePermute,
                 new_node(kPermuteTarget, "spillway_restore_" + producer.name,
                          {Arg::of_node(offload.backward_wait_node),
                           int_list(inverse_order(order))},
                          Phase::kBackward, producer, Value::of_tensor(std::move(same))),
                 first, Placement::kBefore, producer.id);
    }
    rebuilt_[producer.id] = restored;
    redirect_backward_readers(producer, facts, restored, *device.storage, first);
  }

  // P's backward readers read `restored` (a value with P's sizes and strides on
  // `storage`), and P's views read in backward (or by a replay) are replayed on
  // it before `before`.
  void redirect_backward_readers(const Node& producer, const CandidateFacts& facts,
                                 NodeId restored, std::int64_t storage, NodeId before) {
    for (NodeId reader : facts.chain.direct_backward_readers) {
      redirect(reader, producer.id, restored, producer.id);
    }

    std::vector<NodeId> views = facts.chain.replay_views;
    if (extra_views_ != nullptr) {
      if (auto it = extra_views_->find(producer.id); it != extra_views_->end()) {
        views.insert(views.end(), it->second.begin(), it->second.end());
      }
    }
    std::sort(views.begin(), views.end(),
              [&](NodeId a, NodeId b) { return index_.position(a) < index_.position(b); });
    std::unordered_map<NodeId, NodeId> replayed{{producer.id, restored}};
    for (NodeId view_id : views) {
      const Node& view = index_.node(view_id);
      std::vector<Arg> args;
      for (const Arg& arg : view.args) args.push_back(remap(arg, replayed));
      Value replay_value = view.value;
      set_storage(replay_value, storage);
      Node replay = new_node(view.target, "spillway_replay_" + view.name, std::move(args),
                             Phase::kBackward, view, std::move(replay_value));
      for (const auto& [key, arg] : view.kwargs) replay.kwargs.emplace_back(key, remap(arg, replayed));
      replay.time_ms = view.time_ms;
      replayed[view_id] =
          insert(EditKind::kReplayView, std::move(replay), before, Placement::kBefore, producer.id);
      rebuilt_[view_id] = replayed[view_id];
    }
    for (const auto& [view, reader] : facts.chain.view_backward_redirects) {
      if (auto it = replayed.find(view); it != replayed.end()) {
        redirect(reader, view, it->second, producer.id);
      }
    }
  }

  // A copy of P's node in backward over the rebuilt (reloaded or replayed)
  // inputs; P's backward readers read it. An intermediate has no readers to
  // redirect.
  Replay add_replay(const ReplayChoice& choice) {
    const Node& producer = index_.node(choice.producer);
    for (NodeId input : choice.inputs) {
      const bool as_is = std::find(choice.kept_inputs.begin(), choice.kept_inputs.end(), input) !=
                         choice.kept_inputs.end();
      if (!as_is && !rebuilt_.count(input)) {
        throw Error("plan", "internal error: replayed value " + producer.name + " reads " +
                                index_.node(input).name + ", which is neither moved nor replayed");
      }
    }
    std::vector<Arg> args;
    for (const Arg& arg : producer.args) args.push_back(remap(arg, rebuilt_));
    Value value = producer.value;
    const std::int64_t storage = next_storage_++;
    set_storage(value, storage);
    Node copy = new_node(producer.target, "spillway_replay_" + producer.name, std::move(args),
                         Phase::kBackward, producer, std::move(value));
    for (const auto& [key, arg] : producer.kwargs) copy.kwargs.emplace_back(key, remap(arg, rebuilt_));
    copy.time_ms = producer.time_ms;
    Replay replay;
    replay.producer = producer.id;
    replay.bytes = choice.bytes;
    replay.needed_before = choice.needed_before;
    replay.replay_node = insert(EditKind::kReplayOp, std::move(copy), choice.needed_before,
                                Placement::kBefore, producer.id);
    rebuilt_[producer.id] = replay.replay_node;
    if (choice.facts != nullptr) {
      replay.first_backward_reader = choice.facts->first_backward_reader;
      redirect_backward_readers(producer, *choice.facts, replay.replay_node, storage,
                                choice.needed_before);
    }
    return replay;
  }

  // The rewritten graph as FX order has it now: each node, and each id's position.
  struct CurrentOrder {
    std::vector<const Node*> nodes;
    IdMap<std::size_t> position;
  };
  CurrentOrder current_order() const {
    const std::vector<NodeId> order = fx_.order();
    CurrentOrder current{{}, IdMap<std::size_t>(order.size(), 0)};
    current.nodes.reserve(order.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      current.nodes.push_back(&lookup(order[i]));
      current.position.set(order[i], i);
    }
    return current;
  }

  // ActivationPlanOptions::release_lag: each forward wait goes before the
  // first node of the forward region `lag` regions after its producer's, when
  // that node comes later than the wait. A value's own ChosenValue::release_lag
  // overrides `lag`; it may point one past the last region (right after that
  // region's last node) or two past it (right before the first backward node).
  void delay_forward_waits(const std::vector<ChosenValue>& chosen,
                           const std::vector<Offload>& offloads, int lag) {
    const bool own_lags = std::any_of(chosen.begin(), chosen.end(),
                                      [](const ChosenValue& c) { return c.release_lag >= 0; });
    if ((lag <= 0 && !own_lags) || scope_.empty() || offloads.empty()) return;
    const CurrentOrder current = current_order();
    const std::vector<const Node*>& nodes = current.nodes;
    const IdMap<std::size_t>& position = current.position;
    const analysis::Regions regions = analysis::find_regions(nodes, scope_, Phase::kForward);
    for (std::size_t i = 0; i < offloads.size(); ++i) {
      const Offload& offload = offloads[i];
      const int value_lag = chosen[i].release_lag >= 0 ? chosen[i].release_lag : lag;
      if (value_lag <= 0) continue;
      const Node& producer = index_.node(offload.producer);
      const std::string* root = scope_.root_of(producer);
      if (root == nullptr) continue;
      const std::size_t produced_at = position.get(offload.producer);
      std::optional<std::size_t> region = analysis::region_of(regions, *root, produced_at);
      if (!region || regions.anchors[*region] > produced_at) continue;
      const std::size_t target = *region + static_cast<std::size_t>(value_lag);
      std::size_t anchor_position = 0;
      if (target < regions.anchors.size()) {
        anchor_position = regions.anchors[target];
      } else if (chosen[i].release_lag >= 0 && target == regions.anchors.size() &&
                 regions.ends.back() + 1 < nodes.size()) {
        anchor_position = regions.ends.back() + 1;
      } else if (chosen[i].release_lag >= 0 && target == regions.anchors.size() + 1) {
        anchor_position = regions.ends.back() + 1;  // the first backward node
        while (anchor_position < nodes.size() && nodes[anchor_position]->phase != Phase::kBackward) {
          ++anchor_position;
        }
        if (anchor_position >= nodes.size()) continue;
      } else {
        continue;  // the last regions: reference placement
      }
      if (anchor_position <= position.get(offload.forward_wait_node)) continue;
      const NodeId anchor = nodes[anchor_position]->id;
      fx_.move_before(anchor, offload.forward_wait_node);
      Edit& edit = pending_[edit_index_.at(offload.forward_wait_node)].edit;
      edit.anchor = anchor;
      edit.placement = Placement::kBefore;
    }
  }

  std::int64_t prefetch(std::vector<Offload>& offloads, int regions_earlier,
                        PrefetchAnchor where, int just_in_time_regions) {
    if (regions_earlier <= 0 || scope_.empty() || offloads.empty()) return 0;
    const CurrentOrder current = current_order();
    const std::vector<const Node*>& nodes = current.nodes;
    const IdMap<std::size_t>& position = current.position;
    const analysis::Regions regions = analysis::find_regions(nodes, scope_);
    if (regions.anchors.empty()) return 0;

    std::unordered_map<NodeId, Offload*> by_reload;
    for (Offload& offload : offloads) by_reload[offload.reload_node] = &offload;
    // kRegionEnd: the last reload moved after each region end, so the next
    // one goes after it and moved reloads keep their graph order (as the
    // reference's prepend keeps it for kRegionStart).
    std::unordered_map<std::size_t, NodeId> last_after_end;
    std::int64_t moved = 0;
    for (std::size_t reload_position = 0; reload_position < nodes.size(); ++reload_position) {
      auto it = by_reload.find(nodes[reload_position]->id);
      if (it == by_reload.end()) continue;
      Offload& offload = *it->second;
      const std::string* root = scope_.root_of(*nodes[reload_position]);
      if (root == nullptr) continue;
      std::optional<std::size_t> region = analysis::region_of(regions, *root, reload_position);
      if (!region) continue;
      const std::optional<std::size_t> prefetched =
          analysis::prefetch_region(regions, *region, regions_earlier, just_in_time_regions);
      if (!prefetched) continue;  // the just-in-time tail
      const std::size_t target = *prefetched;
      const std::size_t forward_wait_position = position.get(offload.forward_wait_node);
      if (where == PrefetchAnchor::kRegionStart) {
        const std::size_t anchor_position = regions.anchors[target];
        if (anchor_position >= reload_position) continue;
        if (anchor_position <= forward_wait_position) continue;  // see header
        const NodeId anchor = nodes[anchor_position]->id;
        fx_.move_before(anchor, offload.reload_node);
        pending_[edit_index_.at(offload.reload_node)].edit.anchor = anchor;
      } else {
        // Right after the region's last in-root node. Positions are those of
        // the graph before any move, so `end + 1 == reload_position` means
        // the reload already follows the end: nothing to move.
        const std::size_t end_position = regions.ends[target];
        if (end_position >= reload_position) continue;
        if (end_position < forward_wait_position) continue;  // see header
        auto last = last_after_end.try_emplace(target, nodes[end_position]->id).first;
        if (end_position + 1 == reload_position || fx_.next(last->second) == offload.reload_node) {
          last->second = offload.reload_node;  // already there: later ones go after it
          continue;
        }
        fx_.move_right_after(last->second, offload.reload_node);
        // The edit says "after the region end"; express_as_edits re-anchors
        // it if that is not where applying the edits in order would put it
        // (the end is a node a later edit inserts, or other nodes were
        // inserted after it).
        Edit& edit = pending_[edit_index_.at(offload.reload_node)].edit;
        edit.anchor = nodes[end_position]->id;
        edit.placement = Placement::kAfter;
        last->second = offload.reload_node;
      }
      offload.prefetched = true;
      ++moved;
    }
    return moved;
  }

  std::vector<Edit> express_as_edits() {
    const std::vector<NodeId> final_order = fx_.order();
    IdMap<std::size_t> final_position(final_order.size(), 0);
    for (std::size_t i = 0; i < final_order.size(); ++i) final_position.set(final_order[i], i);
    auto in_order = [&](NodeId before, NodeId node, NodeId after) {
      const std::size_t p = final_position.get(node);
      return (before < 0 || final_position.get(before) < p) &&
             (after < 0 || p < final_position.get(after));
    };

    NodeSequence applied(original_order(index_));
    std::vector<Edit> edits;
    edits.reserve(pending_.size());
    for (Pending& pending : pending_) {
      Edit& edit = pending.edit;
      if (pending.insertion) {
        const NodeId id = edit.node.id;
        // A prefetch may anchor a reload on a node inserted by a later edit
        // (a replay or restore view that opens a region): re-anchor it too.
        bool placed = applied.contains(edit.anchor);
        if (placed) {
          NodeId before;
          NodeId after;
          if (edit.placement == Placement::kAfter) {
            before = applied.run_end(edit.anchor);
            after = applied.next(before);
          } else {
            before = applied.previous(edit.anchor);
            after = edit.anchor;
          }
          placed = in_order(before, id, after);
        }
        if (!placed) {
          // Anchor on the next node already present in the final order.
          NodeId next = -1;
          for (std::size_t p = final_position.get(id) + 1; p < final_order.size(); ++p) {
            if (applied.contains(final_order[p])) {
              next = final_order[p];
              break;
            }
          }
          if (next >= 0) {
            edit.anchor = next;
            edit.placement = Placement::kBefore;
          } else {
            edit.anchor = applied.last();
            edit.placement = Placement::kAfter;
          }
        }
        if (edit.placement == Placement::kAfter) {
          applied.insert_after_run(edit.anchor, id);
        } else {
          applied.insert_before(edit.anchor, id);
        }
      }
      edits.push_back(std::move(edit));
    }
    if (applied.order() != final_order) {
      throw Error("plan", "internal error: edits do not reproduce the rewritten order of graph '" +
                              index_.graph().name + "'");
    }
    return edits;
  }

  const analysis::GraphIndex& index_;
  const analysis::ScopeRoots& scope_;
  NodeSequence fx_;
  NodeId next_id_ = 0;
  std::int64_t next_storage_ = 0;
  std::unordered_set<std::string> names_;
  std::unordered_map<NodeId, Node> new_nodes_;
  std::unordered_map<NodeId, std::size_t> edit_index_;
  // Moved or replayed value, or a view of one replayed on it -> the backward
  // node that holds it again.
  std::unordered_map<NodeId, NodeId> rebuilt_;
  const std::unordered_map<NodeId, std::vector<NodeId>>* extra_views_ = nullptr;  // not owned
  std::vector<Pending> pending_;
};

}  // namespace

OpSchema offload_schema() { return spillway_schema({"tensor"}); }
OpSchema reload_schema() { return spillway_schema({"tensor", "device"}); }
OpSchema wait_schema() { return spillway_schema({"tensor", "keepalive", "last_use"}); }

OffloadRewrite build_offload_rewrite(const analysis::GraphIndex& index,
                                     const analysis::ScopeRoots& scope,
                                     const std::vector<ChosenValue>& chosen, int prefetch_regions,
                                     const ReplaySelection& replay,
                                     ActivationPlanOptions::PrefetchAnchor prefetch_anchor,
                                     int release_lag, int just_in_time_regions) {
  return RewriteBuilder(index, scope)
      .build(chosen, prefetch_regions, replay, prefetch_anchor, release_lag,
             just_in_time_regions);
}

}  // namespace spillway::plan
