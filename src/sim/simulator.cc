// simulate(): one training step of a graph on three streams (compute, D2H,
// H2D) with the device bytes live at every node, following the execution
// model numbered in include/spillway/sim.h.
//
// Note [Simulation in three passes]
// A planner calls simulate() thousands of times, so everything here is
// O(nodes + edges) with flat vectors indexed by node position or storage slot
// and no ordered maps:
//   1. layout: one walk in graph order resolves every input to a position
//      (NodeLookup, built once), maps each tensor's storage id to a dense slot
//      (sized by the furthest byte a value reaches), records each slot's first
//      producer and last reader, checks and links the spillway chains
//      (offload -> forward wait -> reload -> backward wait) and computes each
//      node's compute time;
//   2. categories: each slot's MemoryCategory, and the slots freed after each
//      node (a counting sort by last reader);
//   3. replay: one more walk in graph order advances the three streams and the
//      live bytes (allocations before a node, frees after it) and keeps the
//      peak, the totals and, with record_timeline, the per-node points.
// With SimOptions::inductor_fusion, pass 1 also notes, per slot, whether
// anything but a fused node or an alias in its phase touches it, and keeps
// each fused node's inputs; between passes 1 and 2, fold_fusion() marks the
// slots that are not materialised and scales the fused nodes' times
// (execution model (9)).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "analysis/inductor_fusion.h"
#include "sim/node_cost.h"
#include "sim/node_lookup.h"
#include "sim/tensor_bytes.h"
#include "spillway/error.h"
#include "spillway/plan.h"
#include "spillway/sim.h"

namespace spillway {

std::string_view to_string(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kInputs:
      return "inputs";
    case MemoryCategory::kActivations:
      return "activations";
    case MemoryCategory::kTemporaries:
      return "temporaries";
    case MemoryCategory::kInFlight:
      return "in_flight";
    case MemoryCategory::kReloads:
      return "reloads";
    case MemoryCategory::kRecomputed:
      return "recomputed";
  }
  return "unknown";
}

std::string_view to_string(Stream stream) {
  switch (stream) {
    case Stream::kCompute:
      return "compute";
    case Stream::kD2H:
      return "d2h";
    case Stream::kH2D:
      return "h2d";
    case Stream::kHost:
      return "host";
  }
  return "unknown";
}

namespace {

using sim::NodeLookup;

enum class Role : std::uint8_t { kCompute, kOffload, kReload, kWait };

constexpr int kInputs = static_cast<int>(MemoryCategory::kInputs);
constexpr int kActivations = static_cast<int>(MemoryCategory::kActivations);
constexpr int kTemporaries = static_cast<int>(MemoryCategory::kTemporaries);
constexpr int kInFlight = static_cast<int>(MemoryCategory::kInFlight);
constexpr int kReloads = static_cast<int>(MemoryCategory::kReloads);
constexpr int kRecomputed = static_cast<int>(MemoryCategory::kRecomputed);

// One allocation: the storage shared by every value with its storage id.
struct Slot {
  std::int64_t bytes = 0;    // furthest byte any value reaches (unrounded)
  std::int64_t rounded = 0;  // round_allocation(bytes)
  std::int32_t first = 0;    // position of the first producer
  std::int32_t last = 0;     // position of the last producer or reader
  bool host = false;         // an offload result: pinned host memory
  bool whole_step = false;   // a placeholder's: allocated before the step, never freed
  bool to_end = false;       // read by the output node: never freed
  bool backward_read = false;
  bool backward_compute_read = false;  // read by a backward node other than the output
  // inductor_fusion: a tangent, allocated before its first reader (first is
  // then that reader) and freed after its last (execution model (10)).
  bool tangent = false;
  std::int32_t first_read = -1;  // position of the first reader, -1: none
  // inductor_fusion: something other than a fused node or an alias in the
  // first producer's phase produces or reads it; fused: not materialised.
  bool fusion_blocked = false;
  bool fused = false;
  // inductor_fusion: blocked by something other than a fused node or an
  // alias of the other phase reading it (a matmul, a copy, an in-place write):
  // it lands in memory whatever the partitioner does.
  bool materialised_anyway = false;
  std::uint8_t category = kTemporaries;
};

// Storage id -> slot index: a flat table for the small dense ids graphs use,
// a hash map beyond.
class SlotTable {
 public:
  explicit SlotTable(std::size_t nodes) : limit_(4 * nodes + 1024) {}

  // The slot of `storage`, or -1.
  std::int32_t find(std::int64_t storage) const {
    if (static_cast<std::uint64_t>(storage) < limit_) {
      const auto at = static_cast<std::size_t>(storage);
      return at < flat_.size() ? flat_[at] : -1;
    }
    auto it = sparse_.find(storage);
    return it == sparse_.end() ? -1 : it->second;
  }

  void set(std::int64_t storage, std::int32_t slot) {
    if (static_cast<std::uint64_t>(storage) < limit_) {
      const auto at = static_cast<std::size_t>(storage);
      if (at >= flat_.size()) flat_.resize(std::max(at + 1, 2 * flat_.size()), -1);
      flat_[at] = slot;
    } else {
      sparse_[storage] = slot;
    }
  }

 private:
  std::size_t limit_;
  std::vector<std::int32_t> flat_;
  std::unordered_map<std::int64_t, std::int32_t> sparse_;
};

// Graph::schema_of with one cheap hash per node. Looking targets up was a
// quarter of the simulation's time both with the ordered map (string compares)
// and with std::hash (murmur over every byte); targets differ in their length
// and in the few bytes after the namespace and at the end ("aten.mm.default",
// "aten.add.Tensor"), which is all this hash reads. Collisions only cost an
// equality compare.
struct TargetHash {
  std::size_t operator()(std::string_view target) const noexcept {
    const std::size_t n = target.size();
    std::uint64_t head = 0;
    std::uint64_t tail = 0;
    if (n >= 13) {
      std::memcpy(&head, target.data() + 5, 8);  // past "aten." and the like
      std::memcpy(&tail, target.data() + n - 8, 8);
    } else {
      std::memcpy(&head, target.data(), std::min<std::size_t>(n, 8));
      if (n > 8) std::memcpy(&tail, target.data() + 8, n - 8);
    }
    std::uint64_t h = (head * 0x9E3779B97F4A7C15ull) ^ (tail + n) * 0xC2B2AE3D27D4EB4Full;
    return static_cast<std::size_t>(h ^ (h >> 29));
  }
};

class SchemaTable {
 public:
  explicit SchemaTable(const Graph& graph) {
    by_target_.reserve(2 * graph.ops.size());
    for (const auto& [target, schema] : graph.ops) by_target_.emplace(target, &schema);
  }

  const OpSchema* of(const Node& node) const {
    if (node.kind != NodeKind::kCallFunction) return nullptr;
    auto it = by_target_.find(node.target);
    return it == by_target_.end() ? nullptr : it->second;
  }

 private:
  std::unordered_map<std::string_view, const OpSchema*, TargetHash> by_target_;
};

std::string label(const Node& node) {
  return "node " + std::to_string(node.id) + " (" + node.name + ")";
}

[[noreturn]] void fail(const Node& node, const std::string& detail) {
  throw InvalidGraph("sim", label(node) + ": " + detail);
}

Role role_of(const Node& node) {
  if (node.kind != NodeKind::kCallFunction) return Role::kCompute;
  if (node.target == kOffloadTarget) return Role::kOffload;
  if (node.target == kReloadTarget) return Role::kReload;
  if (node.target == kWaitTarget) return Role::kWait;
  return Role::kCompute;
}

// Execution model (11): a chain longer than this (slots recomputed for one
// saved value) is left saved.
constexpr std::size_t kMaxRecomputedChain = 256;

// wait_tensor(t, keepalive, last_use): the position of last_use.
constexpr std::size_t kWaitLastUseArg = 2;

// The node id of args[0] when it is a node reference, else -1.
NodeId first_arg_node(const Node& node) {
  if (node.args.empty() || node.args[0].kind != Arg::Kind::kNode) return -1;
  return node.args[0].node;
}

// One copy stream: when it is free and the intervals it has been busy, in
// order (the other direction reads them for the duplex rate).
struct CopyStream {
  double free_ms = 0;
  double busy_ms = 0;
  std::vector<std::pair<double, double>> busy;
  std::size_t cursor = 0;  // first interval that may end after the other direction's next start
};

// When a copy of `bytes` starting at `start` ends, moving at `alone` bytes/ms
// while `other` is idle and at `duplex` bytes/ms during its busy intervals
// (execution model (5)). Starts on one stream never decrease, so `other`'s
// cursor only moves forward.
double copy_end(double start, double bytes, double alone, double duplex, CopyStream& other) {
  while (other.cursor < other.busy.size() && other.busy[other.cursor].second <= start) {
    ++other.cursor;
  }
  double t = start;
  double remaining = bytes;
  for (std::size_t i = other.cursor; remaining > 0; ++i) {
    if (i == other.busy.size()) return t + remaining / alone;
    const auto [busy_start, busy_end] = other.busy[i];
    if (t < busy_start) {
      const double can_move = (busy_start - t) * alone;
      if (remaining <= can_move) return t + remaining / alone;
      remaining -= can_move;
      t = busy_start;
    }
    const double can_move = (busy_end - t) * duplex;
    if (remaining <= can_move) return t + remaining / duplex;
    remaining -= can_move;
    t = busy_end;
  }
  return t;
}

class Simulation {
 public:
  Simulation(const Graph& graph, const CostModel& cost, const SimOptions& options)
      : graph_(graph),
        cost_(cost),
        options_(options),
        lookup_(graph, NodeLookup::Mode::kTable),
        schemas_(graph),
        n_(graph.nodes.size()),
        slot_table_(graph.nodes.size()) {}

  SimResult run() {
    lay_out();
    if (options_.inductor_fusion) {
      recompute_as_the_partitioner();
      fold_fusion();
      read_when_kernels_run();
      follow_compiled_lifetimes();
    }
    assign_categories();
    return replay();
  }

 private:
  // ---- pass 1 ----------------------------------------------------------------

  std::int32_t slot_for(const TensorInfo& tensor, std::int32_t pos) {
    std::int32_t s = tensor.storage ? slot_table_.find(*tensor.storage) : -1;
    if (s < 0) {
      s = static_cast<std::int32_t>(slots_.size());
      Slot slot;
      slot.first = pos;
      slot.last = pos;
      slots_.push_back(slot);
      slot_forward_.push_back(graph_.nodes[static_cast<std::size_t>(pos)].phase == Phase::kForward);
      if (tensor.storage) slot_table_.set(*tensor.storage, s);
    }
    return s;
  }

  // Records the slots of the node's tensors from out_slots_[begin] on;
  // returns the value's bytes (value_nbytes).
  std::int64_t add_outputs(const Value& value, std::int32_t pos, std::size_t begin) {
    if (value.is_tensor()) {
      const sim::TensorBytes bytes = sim::tensor_bytes(value.tensor);
      const std::int32_t s = slot_for(value.tensor, pos);
      Slot& slot = slots_[static_cast<std::size_t>(s)];
      slot.bytes = std::max(slot.bytes, bytes.extent);
      slot.last = std::max(slot.last, pos);
      for (std::size_t i = begin; i < out_slots_.size(); ++i) {
        if (out_slots_[i] == s) return bytes.nbytes;  // two elements on one storage (split)
      }
      out_slots_.push_back(s);
      return bytes.nbytes;
    }
    std::int64_t total = 0;
    for (const Value& element : value.elements) {
      total = sim::add_bytes(total, add_outputs(element, pos, begin));
    }
    return total;
  }

  std::int32_t position_of_input(const Node& node, NodeId id, std::int32_t pos) const {
    const std::int64_t at = lookup_.position(id);
    if (at < 0) fail(node, "reads node " + std::to_string(id) + ", which the graph does not have");
    if (at >= pos) {
      fail(node, "reads node " + std::to_string(id) + ", which does not come before it");
    }
    return static_cast<std::int32_t>(at);
  }

  // Calls fn(position) for every input the node reads. A wait's last_use
  // argument orders the graph and is checked like any input, but is not a
  // read (execution model (6)): the wait the runtime runs does not hold it
  // (Note [Forward wait without last_use] in
  // python/spillway/activations/_compiled_apply.py).
  template <typename Fn>
  void for_each_read(const Node& node, Role role, std::int32_t pos, Fn&& fn) const {
    if (role != Role::kWait) {
      node.for_each_input([&](NodeId id) { fn(position_of_input(node, id, pos)); });
      return;
    }
    node.for_each_input([&](NodeId id) { position_of_input(node, id, pos); });
    const auto read = [&](const Arg& arg) {
      if (arg.kind == Arg::Kind::kNode) fn(position_of_input(node, arg.node, pos));
    };
    for (std::size_t i = 0; i < node.args.size() && i < kWaitLastUseArg; ++i) read(node.args[i]);
    for (const auto& [name, arg] : node.kwargs) {
      if (name != "last_use") read(arg);
    }
  }

  void lay_out() {
    role_.resize(n_);
    duration_.assign(n_, 0.0);
    scratch_.assign(n_, 0);
    out_begin_.assign(n_ + 1, 0);
    linked_.assign(n_, -1);
    in_flight_slot_.assign(n_, -1);
    copy_bytes_.assign(n_, 0);
    const bool fusion = options_.inductor_fusion;
    if (fusion) {
      fused_node_.assign(n_, false);
      fused_inputs_begin_.assign(n_ + 1, 0);
    }
    slots_.reserve(n_);
    slot_forward_.reserve(n_);
    out_slots_.reserve(n_ + n_ / 4);
    const DeviceProfile& profile = cost_.profile();

    for (std::size_t at = 0; at < n_; ++at) {
      const Node& node = graph_.nodes[at];
      const auto pos = static_cast<std::int32_t>(at);
      const Role role = role_of(node);
      role_[at] = role;
      const bool backward = node.phase == Phase::kBackward;
      const bool is_output = node.kind == NodeKind::kOutput;
      const OpSchema* schema = schemas_.of(node);
      if (fusion) inputs_.clear();

      for_each_read(node, role, pos, [&](std::int32_t from) {
        const auto from_at = static_cast<std::size_t>(from);
        if (fusion && std::find(inputs_.begin(), inputs_.end(), from) == inputs_.end()) {
          inputs_.push_back(from);
        }
        for (std::int32_t i = out_begin_[from_at]; i < out_begin_[from_at + 1]; ++i) {
          Slot& slot = slots_[static_cast<std::size_t>(out_slots_[static_cast<std::size_t>(i)])];
          if (slot.first_read < 0) slot.first_read = pos;
          // The output node's read keeps the storage to the end of the step
          // (to_end), which a last reader cannot say: last stays the last
          // node that computes with it.
          if (!is_output) slot.last = pos;
          slot.to_end = slot.to_end || is_output;
          slot.backward_read = slot.backward_read || backward;
          slot.backward_compute_read = slot.backward_compute_read || (backward && !is_output);
        }
      });

      const std::size_t begin = out_slots_.size();
      lookup_.set_value_bytes(at, add_outputs(node.value, pos, begin));
      out_begin_[at + 1] = static_cast<std::int32_t>(out_slots_.size());
      if (node.kind == NodeKind::kPlaceholder || node.kind == NodeKind::kGetAttr) {
        for (std::size_t i = begin; i < out_slots_.size(); ++i) {
          Slot& slot = slots_[static_cast<std::size_t>(out_slots_[i])];
          slot.whole_step = true;
          slot.tangent = fusion && backward && node.kind == NodeKind::kPlaceholder;
        }
      }

      if (fusion) note_fusion(node, schema, role, pos, begin);

      switch (role) {
        case Role::kCompute: {
          duration_[at] = sim::node_ms(profile, node, schema, lookup_);
          const auto [accumulator, rows] = sim::scratch_bytes(node);
          scratch_[at] = sim::add_bytes(round_allocation(accumulator, profile),
                                        round_allocation(rows, profile));
          break;
        }
        case Role::kOffload:
          link_offload(node, pos, begin);
          break;
        case Role::kReload:
          link_reload(node, pos);
          break;
        case Role::kWait:
          link_wait(node, pos);
          break;
      }
    }
  }

  // Execution model (9), pass 1: whether the node is fused, which slots it
  // keeps from being left unmaterialised (those it reads or writes other than
  // as a fused node or an alias of its phase), and, for a fused node, its
  // distinct inputs (inputs_, by position) for fold_fusion().
  void note_fusion(const Node& node, const OpSchema* schema, Role role, std::int32_t pos,
                   std::size_t begin) {
    const auto at = static_cast<std::size_t>(pos);
    const bool fused = role == Role::kCompute && analysis::is_inductor_fused(node, schema);
    bool alias = node.kind == NodeKind::kCallFunction && begin < out_slots_.size() &&
                 !(schema != nullptr && schema->is_mutable);
    for (std::size_t i = begin; i < out_slots_.size() && alias; ++i) {
      alias = slots_[static_cast<std::size_t>(out_slots_[i])].first < pos;
    }
    for (std::size_t i = begin; i < out_slots_.size(); ++i) {
      Slot& slot = slots_[static_cast<std::size_t>(out_slots_[i])];
      if (slot.first == pos) {
        slot.fusion_blocked = !fused;
        slot.materialised_anyway = !fused;
      } else if (!alias) {
        slot.fusion_blocked = true;  // written again in place
        slot.materialised_anyway = true;
      }
    }
    const bool forward = node.phase == Phase::kForward;
    for (std::int32_t from : inputs_) {
      const auto from_at = static_cast<std::size_t>(from);
      for (std::int32_t i = out_begin_[from_at]; i < out_begin_[from_at + 1]; ++i) {
        const auto s = static_cast<std::size_t>(out_slots_[static_cast<std::size_t>(i)]);
        if (!(fused || alias)) {
          slots_[s].fusion_blocked = true;
          slots_[s].materialised_anyway = true;
        } else if (slot_forward_[s] != forward) {
          slots_[s].fusion_blocked = true;
        }
      }
    }
    fused_node_[at] = fused;
    if (fused) fused_inputs_.insert(fused_inputs_.end(), inputs_.begin(), inputs_.end());
    fused_inputs_begin_[at + 1] = static_cast<std::int32_t>(fused_inputs_.size());
  }

  // Whether any storage of the node's value is materialised (a node without
  // a tensor: yes, it has no bytes either way).
  bool materialised(std::size_t at) const {
    if (out_begin_[at] == out_begin_[at + 1]) return true;
    for (std::int32_t i = out_begin_[at]; i < out_begin_[at + 1]; ++i) {
      if (!slots_[static_cast<std::size_t>(out_slots_[static_cast<std::size_t>(i)])].fused) {
        return true;
      }
    }
    return false;
  }

  // Execution model (9), between passes 1 and 2: the slots left
  // unmaterialised, and each fused node's time scaled by the share of its
  // traffic (distinct inputs and outputs, value bytes) that stays in memory.
  void fold_fusion() {
    for (Slot& slot : slots_) {
      slot.fused = !slot.fusion_blocked && !slot.whole_step && !slot.host && !slot.to_end;
    }
    for (std::size_t at = 0; at < n_; ++at) {
      if (!fused_node_[at] || duration_[at] <= 0) continue;
      const auto own = static_cast<double>(lookup_.value_bytes(graph_.nodes[at].id));
      double traffic = own;
      double kept = materialised(at) ? own : 0.0;
      for (std::int32_t i = fused_inputs_begin_[at]; i < fused_inputs_begin_[at + 1]; ++i) {
        const auto from = static_cast<std::size_t>(fused_inputs_[static_cast<std::size_t>(i)]);
        const auto bytes = static_cast<double>(lookup_.value_bytes(graph_.nodes[from].id));
        traffic += bytes;
        if (materialised(from)) kept += bytes;
      }
      if (traffic > 0) duration_[at] *= kept / traffic;
    }
  }

  // Execution model (11): whether the partitioner may recompute slot s in
  // backward from its pointwise chain.
  bool partitioner_recomputable(std::size_t s, const std::vector<bool>& planned) const {
    const Slot& slot = slots_[s];
    if (!slot_forward_[s] || slot.whole_step || slot.host || slot.to_end ||
        slot.materialised_anyway || (planned[s] && slot.backward_compute_read)) {
      return false;
    }
    const auto first = static_cast<std::size_t>(slot.first);
    const Node& producer = graph_.nodes[first];
    return role_[first] == Role::kCompute && fused_node_[first] &&
           analysis::is_inductor_pointwise(producer, schemas_.of(producer));
  }

  // Execution model (11), between pass 1 and fold_fusion(): each forward
  // storage backward reads that the partitioner recomputes inside backward's
  // kernels is left unmaterialised, and what its pointwise chain reads is
  // kept to its last backward reader instead.
  void recompute_as_the_partitioner() {
    std::vector<bool> planned(slots_.size(), false);
    for (NodeId id : options_.planned) {
      const std::int64_t at = lookup_.position(id);
      if (at < 0) continue;
      for (std::int32_t i = out_begin_[static_cast<std::size_t>(at)];
           i < out_begin_[static_cast<std::size_t>(at) + 1]; ++i) {
        planned[static_cast<std::size_t>(out_slots_[static_cast<std::size_t>(i)])] = true;
      }
    }
    std::vector<bool> offloaded(slots_.size(), false);
    for (std::int32_t s : in_flight_slot_) {
      if (s >= 0) offloaded[static_cast<std::size_t>(s)] = true;
    }
    std::vector<std::int32_t> seen(slots_.size(), -1);  // target that visited it
    std::vector<std::size_t> chain;
    std::vector<std::size_t> kept;
    std::vector<std::size_t> pending;
    for (std::size_t target = 0; target < slots_.size(); ++target) {
      const Slot& saved = slots_[target];
      if (!saved.backward_compute_read || !saved.fusion_blocked ||
          !partitioner_recomputable(target, planned)) {
        continue;
      }
      const auto stamp = static_cast<std::int32_t>(target);
      chain.clear();
      kept.clear();
      pending.assign(1, target);
      seen[target] = stamp;
      bool ok = true;
      while (ok && !pending.empty()) {
        const std::size_t s = pending.back();
        pending.pop_back();
        chain.push_back(s);
        if (chain.size() > kMaxRecomputedChain) ok = false;
        const auto producer = static_cast<std::size_t>(slots_[s].first);
        for (std::int32_t i = fused_inputs_begin_[producer];
             ok && i < fused_inputs_begin_[producer + 1]; ++i) {
          const auto from = static_cast<std::size_t>(fused_inputs_[static_cast<std::size_t>(i)]);
          for (std::int32_t k = out_begin_[from]; k < out_begin_[from + 1]; ++k) {
            const auto input = static_cast<std::size_t>(out_slots_[static_cast<std::size_t>(k)]);
            if (seen[input] == stamp) continue;
            seen[input] = stamp;
            const Slot& read = slots_[input];
            if (partitioner_recomputable(input, planned)) {
              pending.push_back(input);
            } else if (read.host || offloaded[input]) {
              ok = false;  // the partitioner would save the value itself
            } else if (!read.whole_step) {
              kept.push_back(input);
            }
          }
        }
      }
      if (!ok) continue;
      std::int32_t last = saved.last;
      for (std::size_t s : chain) {
        if (!slots_[s].backward_compute_read) continue;
        slots_[s].fusion_blocked = false;
        last = std::max(last, slots_[s].last);
      }
      for (std::size_t s : kept) {
        Slot& read = slots_[s];
        read.fusion_blocked = true;
        read.backward_read = true;
        read.backward_compute_read = true;
        kept_until_.emplace_back(static_cast<std::int32_t>(s), last);
      }
    }
  }

  // Execution model (9): a fused node whose output is not materialised runs
  // inside the kernels of its readers that write memory; the storages it
  // reads live until the last of them has run. So do those a recomputed
  // chain keeps (11), until the kernel of its last backward reader.
  void read_when_kernels_run() {
    constexpr std::int32_t kNone = -1;
    std::vector<std::int32_t> kernel(n_, kNone);  // by position: the last kernel it runs in
    for (std::size_t at = n_; at-- > 0;) {
      if (!fused_node_[at]) continue;
      const bool deferred = !materialised(at);
      const std::int32_t runs =
          deferred && kernel[at] != kNone ? kernel[at] : static_cast<std::int32_t>(at);
      for (std::int32_t i = fused_inputs_begin_[at]; i < fused_inputs_begin_[at + 1]; ++i) {
        const auto from = static_cast<std::size_t>(fused_inputs_[static_cast<std::size_t>(i)]);
        for (std::int32_t k = out_begin_[from]; k < out_begin_[from + 1]; ++k) {
          Slot& slot = slots_[static_cast<std::size_t>(out_slots_[static_cast<std::size_t>(k)])];
          if (slot.fused) {
            std::int32_t& producer = kernel[static_cast<std::size_t>(slot.first)];
            producer = std::max(producer, runs);
          } else if (deferred) {
            slot.last = std::max(slot.last, runs);
          }
        }
      }
    }
    for (const auto& [s, reader] : kept_until_) {
      const auto at = static_cast<std::size_t>(reader);
      const std::int32_t runs = fused_node_[at] && !materialised(at) && kernel[at] != kNone
                                    ? kernel[at]
                                    : reader;
      Slot& slot = slots_[static_cast<std::size_t>(s)];
      slot.last = std::max(slot.last, runs);
    }
  }

  // Execution model (10), between passes 1 and 2: tangents live from their
  // first reader to their last, and a forward storage the output node returns
  // and a backward node reads lives to its last reader.
  void follow_compiled_lifetimes() {
    // Autograd hands the compiled backward every tangent at once, zeros for
    // the outputs no gradient reaches (a training step's logits and the
    // attention's key/value cache): all are allocated when backward starts.
    std::int32_t backward_start = -1;
    for (std::size_t pos = 0; pos < n_; ++pos) {
      const Node& node = graph_.nodes[pos];
      if (node.phase == Phase::kBackward && node.kind != NodeKind::kPlaceholder) {
        backward_start = static_cast<std::int32_t>(pos);
        break;
      }
    }
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      Slot& slot = slots_[s];
      if (slot.tangent && slot.whole_step && !slot.host && !slot.to_end) {
        slot.whole_step = false;
        if (slot.first_read < 0) {
          slot.fused = true;  // never read: never allocated
          continue;
        }
        slot.first = backward_start >= 0 ? std::min(backward_start, slot.first_read)
                                          : slot.first_read;
        // Held to the end: autograd's call into the compiled backward keeps
        // the tuple of gradients it passed until the call returns.
        slot.to_end = true;
        late_allocations_.emplace_back(slot.first, static_cast<std::int32_t>(s));
      } else if (slot.to_end && slot_forward_[s] && slot.backward_compute_read &&
                 !slot.whole_step && !slot.host) {
        slot.to_end = false;
      }
    }
    std::sort(late_allocations_.begin(), late_allocations_.end());
  }

  // An offload copies its input (a tensor) to host memory: its result's
  // storage is host memory, and the input's storage is in flight.
  void link_offload(const Node& node, std::int32_t pos, std::size_t begin) {
    const NodeId input_id = first_arg_node(node);
    if (input_id < 0) fail(node, "offload's first argument is not a node");
    const std::int32_t input = position_of_input(node, input_id, pos);
    const Node& moved = graph_.nodes[static_cast<std::size_t>(input)];
    if (!moved.value.is_tensor()) {
      fail(node, "offloads " + label(moved) + ", which is not a tensor");
    }
    const auto input_at = static_cast<std::size_t>(input);
    if (out_begin_[input_at + 1] > out_begin_[input_at]) {
      in_flight_slot_[static_cast<std::size_t>(pos)] =
          out_slots_[static_cast<std::size_t>(out_begin_[input_at])];
    }
    for (std::size_t i = begin; i < out_slots_.size(); ++i) {
      slots_[static_cast<std::size_t>(out_slots_[i])].host = true;
    }
    copy_bytes_[static_cast<std::size_t>(pos)] =
        sim::hinted_nbytes(node.value.is_tensor() ? node.value.tensor : moved.value.tensor);
  }

  // A reload's first argument is the forward wait of an offload; linked_
  // keeps the offload, whose D2H the H2D waits for.
  void link_reload(const Node& node, std::int32_t pos) {
    const NodeId wait_id = first_arg_node(node);
    if (wait_id < 0) fail(node, "reload's first argument is not a node");
    const std::int32_t wait = position_of_input(node, wait_id, pos);
    const std::int32_t offload = linked_[static_cast<std::size_t>(wait)];
    if (role_[static_cast<std::size_t>(wait)] != Role::kWait || offload < 0 ||
        role_[static_cast<std::size_t>(offload)] != Role::kOffload) {
      fail(node, "reload's first argument " + label(graph_.nodes[static_cast<std::size_t>(wait)]) +
                     " is not the wait of an offload");
    }
    linked_[static_cast<std::size_t>(pos)] = offload;
    copy_bytes_[static_cast<std::size_t>(pos)] =
        node.value.is_tensor() ? sim::hinted_nbytes(node.value.tensor)
                               : copy_bytes_[static_cast<std::size_t>(offload)];
  }

  // A wait's first argument is an offload or a reload; linked_ keeps it.
  void link_wait(const Node& node, std::int32_t pos) {
    const NodeId copy_id = first_arg_node(node);
    if (copy_id < 0) fail(node, "wait_tensor's first argument is not a node");
    const std::int32_t copy = position_of_input(node, copy_id, pos);
    const Role copy_role = role_[static_cast<std::size_t>(copy)];
    if (copy_role != Role::kOffload && copy_role != Role::kReload) {
      fail(node, "wait_tensor waits on " + label(graph_.nodes[static_cast<std::size_t>(copy)]) +
                     ", which is not an offload or a reload");
    }
    linked_[static_cast<std::size_t>(pos)] = copy;
  }

  // ---- pass 2 ----------------------------------------------------------------

  void assign_categories() {
    std::vector<bool> recomputed(n_, false);
    for (NodeId id : options_.recomputed) {
      const std::int64_t at = lookup_.position(id);
      if (at < 0) {
        throw InvalidArgument("sim", "SimOptions::recomputed names node " + std::to_string(id) +
                                         ", which the graph does not have");
      }
      recomputed[static_cast<std::size_t>(at)] = true;
      recomputed_ms_ += duration_[static_cast<std::size_t>(at)];
    }
    const DeviceProfile& profile = cost_.profile();
    free_begin_.assign(n_ + 1, 0);
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      Slot& slot = slots_[s];
      slot.rounded = round_allocation(slot.bytes, profile);
      const auto first = static_cast<std::size_t>(slot.first);
      if (slot.whole_step || slot.tangent) {
        slot.category = kInputs;
      } else if (role_[first] == Role::kReload) {
        slot.category = kReloads;
      } else if (recomputed[first]) {
        slot.category = kRecomputed;
      } else if (slot_forward_[s] && slot.backward_read) {
        slot.category = kActivations;
      } else {
        slot.category = kTemporaries;
      }
      if (!slot.whole_step && !slot.to_end && !slot.fused) {
        ++free_begin_[static_cast<std::size_t>(slot.last) + 1];
      }
    }
    for (std::size_t at = 0; at < n_; ++at) free_begin_[at + 1] += free_begin_[at];
    free_slots_.resize(static_cast<std::size_t>(free_begin_[n_]));
    std::vector<std::int32_t> fill(free_begin_.begin(), free_begin_.end() - 1);
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const Slot& slot = slots_[s];
      if (slot.whole_step || slot.to_end || slot.fused) continue;
      free_slots_[static_cast<std::size_t>(fill[static_cast<std::size_t>(slot.last)]++)] =
          static_cast<std::int32_t>(s);
    }
  }

  // ---- pass 3 ----------------------------------------------------------------

  // Moves a live device slot's bytes to another category.
  void recategorise(std::size_t s, int category) {
    const Slot& slot = slots_[s];
    live_by_category_[static_cast<std::size_t>(current_category_[s])] -= slot.rounded;
    live_by_category_[static_cast<std::size_t>(category)] += slot.rounded;
    current_category_[s] = static_cast<std::uint8_t>(category);
  }

  SimResult replay() {
    SimResult result;
    const bool timeline = options_.record_timeline;
    if (timeline) {
      result.timeline.reserve(n_);
      result.intervals.reserve(n_ / 2);
    }
    current_category_.resize(slots_.size());
    std::int64_t live = 0;
    std::int64_t host_live = 0;
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const Slot& slot = slots_[s];
      current_category_[s] = slot.category;
      if (slot.whole_step && !slot.host) {
        live += slot.rounded;
        live_by_category_[kInputs] += slot.rounded;
      }
    }
    const DeviceProfile& profile = cost_.profile();
    CopyStream d2h;
    CopyStream h2d;
    std::vector<double> copy_done(n_, 0.0);  // by offload/reload position
    double t = 0;  // when the compute stream is free
    // Execution model (12): when the host has issued the nodes so far; only
    // where some node has cpu_ms.
    const bool host_modelled =
        std::any_of(graph_.nodes.begin(), graph_.nodes.end(),
                    [](const Node& node) { return node.cpu_ms.has_value(); });
    double host = 0;
    result.peak_bytes = -1;
    std::size_t next_late = 0;  // into late_allocations_

    for (std::size_t at = 0; at < n_; ++at) {
      const Node& node = graph_.nodes[at];
      const auto pos = static_cast<std::int32_t>(at);
      for (; next_late < late_allocations_.size() && late_allocations_[next_late].first == pos;
           ++next_late) {
        const auto s = static_cast<std::size_t>(late_allocations_[next_late].second);
        live += slots_[s].rounded;
        live_by_category_[slots_[s].category] += slots_[s].rounded;
      }
      for (std::int32_t i = out_begin_[at]; i < out_begin_[at + 1]; ++i) {
        const auto s = static_cast<std::size_t>(out_slots_[static_cast<std::size_t>(i)]);
        const Slot& slot = slots_[s];
        if (slot.first != pos || slot.whole_step || slot.fused || slot.tangent) continue;
        if (slot.host) {
          host_live += slot.bytes;
        } else {
          live += slot.rounded;
          live_by_category_[slot.category] += slot.rounded;
        }
      }
      if (in_flight_slot_[at] >= 0 && !slots_[static_cast<std::size_t>(in_flight_slot_[at])].host) {
        recategorise(static_cast<std::size_t>(in_flight_slot_[at]), kInFlight);
      }

      if (host_modelled) {
        const double issue = node.cpu_ms.value_or(0.0);
        if (timeline && issue > 0) {
          result.intervals.push_back({Stream::kHost, node.id, host, host + issue, 0});
        }
        host += issue;
        result.host_ms += issue;
      }
      double start = t;
      double end = t;
      switch (role_[at]) {
        case Role::kCompute:
          end = t + duration_[at];
          if (host_modelled && host > end) {
            result.host_wait_ms += host - end;
            start += host - end;
            end = host;
          }
          t = end;
          result.compute_busy_ms += duration_[at];
          if (timeline && duration_[at] > 0) {
            result.intervals.push_back({Stream::kCompute, node.id, start, end, 0});
          }
          break;
        case Role::kOffload: {
          const std::int64_t bytes = copy_bytes_[at];
          const double copy_start = std::max(d2h.free_ms, t);
          const double copy_stop =
              bytes <= 0 ? copy_start
                         : copy_end(copy_start, static_cast<double>(bytes),
                                    profile.d2h.gbs(bytes) * 1e6,
                                    profile.d2h_duplex.gbs(bytes) * 1e6, h2d);
          finish_copy(d2h, Stream::kD2H, node.id, copy_start, copy_stop, bytes, result);
          result.bytes_d2h += bytes;
          copy_done[at] = copy_stop;
          break;
        }
        case Role::kReload: {
          const std::int64_t bytes = copy_bytes_[at];
          const double copy_start =
              std::max({h2d.free_ms, t, copy_done[static_cast<std::size_t>(linked_[at])]});
          const double copy_stop =
              bytes <= 0 ? copy_start
                         : copy_end(copy_start, static_cast<double>(bytes),
                                    profile.h2d.gbs(bytes) * 1e6,
                                    profile.h2d_duplex.gbs(bytes) * 1e6, d2h);
          finish_copy(h2d, Stream::kH2D, node.id, copy_start, copy_stop, bytes, result);
          result.bytes_h2d += bytes;
          copy_done[at] = copy_stop;
          break;
        }
        case Role::kWait: {
          const double ready = copy_done[static_cast<std::size_t>(linked_[at])];
          if (ready > t) {
            result.compute_wait_ms += ready - t;
            t = ready;
          }
          start = end = t;
          break;
        }
      }

      result.host_peak_bytes = std::max(result.host_peak_bytes, host_live);
      const std::int64_t scratch = scratch_[at];
      if (live + scratch > result.peak_bytes) {
        result.peak_bytes = live + scratch;
        result.peak_node = node.id;
        result.peak_phase = node.phase;
        result.peak_time_ms = start;
        result.peak_by_category = live_by_category_;
        result.peak_by_category[kTemporaries] += scratch;
      }
      if (timeline) {
        result.timeline.push_back({node.id, start, end, live, live_by_category_, scratch});
      }

      for (std::int32_t i = free_begin_[at]; i < free_begin_[at + 1]; ++i) {
        const auto s = static_cast<std::size_t>(free_slots_[static_cast<std::size_t>(i)]);
        const Slot& slot = slots_[s];
        if (slot.host) {
          host_live -= slot.bytes;
        } else {
          live -= slot.rounded;
          live_by_category_[current_category_[s]] -= slot.rounded;
        }
      }
      // A forward wait ends the flight; a storage something still reads
      // takes its own category again.
      if (role_[at] == Role::kWait) {
        const std::int32_t copy = linked_[at];
        const std::int32_t moved = in_flight_slot_[static_cast<std::size_t>(copy)];
        if (moved >= 0) {
          const auto s = static_cast<std::size_t>(moved);
          const Slot& slot = slots_[s];
          const bool still_live = slot.whole_step || slot.to_end || slot.last > pos;
          if (still_live && !slot.host && current_category_[s] == kInFlight) {
            recategorise(s, slot.category);
          }
        }
      }
    }

    if (n_ == 0) result.peak_bytes = live;
    result.step_ms = std::max({t, d2h.free_ms, h2d.free_ms});
    result.d2h_busy_ms = d2h.busy_ms;
    result.h2d_busy_ms = h2d.busy_ms;
    result.recompute_ms = recomputed_ms_;
    return result;
  }

  void finish_copy(CopyStream& stream, Stream which, NodeId node, double start, double stop,
                   std::int64_t bytes, SimResult& result) const {
    stream.free_ms = stop;
    stream.busy_ms += stop - start;
    if (stop > start) stream.busy.emplace_back(start, stop);
    if (options_.record_timeline) result.intervals.push_back({which, node, start, stop, bytes});
  }

  const Graph& graph_;
  const CostModel& cost_;
  const SimOptions& options_;
  NodeLookup lookup_;  // value bytes recorded as lay_out() walks the graph
  const SchemaTable schemas_;
  const std::size_t n_;

  // By node position.
  std::vector<Role> role_;
  std::vector<double> duration_;
  std::vector<std::int64_t> scratch_;  // by position: the kernel's rounded scratch
  std::vector<std::int32_t> out_begin_;  // n + 1: the node's slots are out_slots_[begin, next)
  std::vector<std::int32_t> out_slots_;
  // wait -> its copy; reload -> its offload; -1 otherwise.
  std::vector<std::int32_t> linked_;
  std::vector<std::int32_t> in_flight_slot_;  // offload -> the slot it moves, else -1
  std::vector<std::int64_t> copy_bytes_;      // offload/reload -> bytes copied
  std::vector<std::int32_t> free_begin_;      // n + 1: slots freed after the node
  std::vector<std::int32_t> free_slots_;
  // inductor_fusion only: whether the node is fused, and its distinct inputs
  // (positions) in fused_inputs_[begin, next); inputs_ is pass 1's scratch.
  std::vector<bool> fused_node_;
  std::vector<std::int32_t> fused_inputs_begin_;  // n + 1
  std::vector<std::int32_t> fused_inputs_;
  std::vector<std::int32_t> inputs_;

  // By slot.
  SlotTable slot_table_;
  std::vector<Slot> slots_;
  std::vector<bool> slot_forward_;  // first produced in forward
  // inductor_fusion: (position, slot) of tangents allocated at their first
  // reader, by position.
  std::vector<std::pair<std::int32_t, std::int32_t>> late_allocations_;
  // inductor_fusion: (slot, backward reader) of storages a recomputed chain
  // keeps until that reader's kernel (execution model (11)).
  std::vector<std::pair<std::int32_t, std::int32_t>> kept_until_;
  std::vector<std::uint8_t> current_category_;

  std::array<std::int64_t, kMemoryCategoryCount> live_by_category_{};
  double recomputed_ms_ = 0;
};

}  // namespace

SimResult simulate(const Graph& graph, const CostModel& cost, const SimOptions& options) {
  return Simulation(graph, cost, options).run();
}

}  // namespace spillway
