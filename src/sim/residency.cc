// The residency model of a recorded step and its replay under a plan
// (include/spillway/residency.h).
//
// Note [Residency replay]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Three steps in a row run position by position; the second is reported, so
// a storage that spends the wrap on the host starts the step there, as it
// does in steady state, and the copies that cross a step boundary count.
//
// At each position, in this order:
//   (1) storages that a D2H has finished copying by the time the compute
//       stream reaches the position are freed (the runtime lets a buffer go
//       once its copy's event has completed); first, the compute stream
//       waits for the D2Hs of the storages whose gap's wait falls here
//       (HostGap::wait), so they are freed here however late their copies;
//   (2) the H2D copies issued here start, each when the H2D stream is free,
//       the compute stream has reached the position and the storage's D2H (if
//       one is under way) has landed; the storage's device bytes are
//       allocated now (a storage whose D2H is still under way keeps its
//       buffer instead: nothing to copy back);
//   (3) the op waits for the H2D copies of the storages it uses, then
//       computes for its time; a storage it makes is allocated before it
//       runs; the live bytes while it runs (plus its scratch) are the
//       position's;
//   (4) after it, a storage with a gap planned whose last write before that
//       gap is this op is written back: a D2H starts once the D2H stream is
//       free and the op has finished (so a gap long after the write finds its
//       host copy ready); then each storage whose gap starts here leaves the
//       device, at once when its host copy is valid and landed (named in
//       `landed` at the next position: the replay's copy may be later), else
//       when its write-back lands (1). A storage never written gets its host copy
//       once, when the plan is made, not in every step. A storage made in the step and not kept
//       is freed after its last use, or where the recorded step freed it when
//       that was later (a gradient zero_grad lets go of); a kept one at the
//       end of the step.
// A copy that overlaps a copy of the other direction runs at the duplex rate
// for the whole of it (conservative). Placeholders' storages begin the first
// step on the device with no host copy, unless their wrap gap is planned:
// then they begin on the host, their copy valid.
//
// Host updates (the plan's host_updated): the model is first rewritten by
// apply_host_updates (their ops cost nothing and use nothing, their states
// never come to the device, their gradients end at their last use before the
// update: gradient_complete_position). Then, after that position, a D2H takes
// it to the host (it is freed when that lands). At the position of the
// update's op (where the replay hands it to its host worker), once the
// update's last gradient has landed, the update runs on the host, one update
// at a time in op order, for its host_ms; it may run on into the next step,
// whose uses of its parameters wait for it. Its parameters' host copies are
// the masters the update writes, valid at all times, so they leave the device in any gap
// without a write-back. A parameter that spends the wrap on the device gets
// its new value by an H2D issued when the update ends; one that spends it on
// the host is copied back when its copy is issued, but not before the update
// ends (a copy issued before the update has even started waits for it).
//
// Note [The host in residency replay]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A replayed step is issued by one host thread under a Python dispatch mode,
// and on a GPU that thread, not the GPU, can set the pace (T3 at 75 %: 460 ms
// of host time for a 155 ms GPU step). With the ops' host times known
// (ResidencyModel::op_cpu_ms, measured by the recorder) a fourth lane runs:
// before each op the host spends the op's cpu_ms plus the replay's own
// replay_op_ms, and the op starts on the compute stream no earlier than that.
// Each copy costs the host replay_copy_ms to issue (the replay's events, stream
// switches and views around it) and starts no earlier than that. The
// host blocks where the replay does: at an op that reads a parameter whose
// host update is still running (the replay waits for the update, then copies
// the new value). A gap's wait and a copy back due while its update runs hold
// the GPU or the copy, not the host. Each step starts with the host caught up
// with the compute stream (a loop reads its loss between steps).

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "spillway/error.h"
#include "spillway/residency.h"
#include "sim/tensor_bytes.h"

namespace spillway {
namespace {

[[noreturn]] void residency_bad(const std::string& message) { throw InvalidArgument("residency", message); }

// The host's time to issue the op at position p: its cpu_ms plus the replay's
// own, or -1 when the host is not modelled or the op has no host time.
double op_host_ms(const ResidencyModel& model, std::size_t p) {
  if (p >= model.op_cpu_ms.size() || model.op_cpu_ms[p] < 0) return -1;
  return model.op_cpu_ms[p] + model.replay_op_ms;
}

// Storage ids of a value's tensors with the furthest byte each reaches.
void residency_storages_of(const Value& value, std::vector<std::pair<std::int64_t, std::int64_t>>& out) {
  if (value.is_tensor()) {
    if (value.tensor.storage) out.emplace_back(*value.tensor.storage, sim::tensor_bytes(value.tensor).extent);
    return;
  }
  for (const Value& element : value.elements) residency_storages_of(element, out);
}

}  // namespace

ResidencyModel residency_model(const Graph& graph, const CostModel& cost) {
  verify_graph(graph);
  ResidencyModel model;
  const std::size_t n = graph.nodes.size();
  model.op_ms.reserve(n);
  std::unordered_map<NodeId, std::size_t> position;
  std::unordered_map<std::int64_t, std::size_t> index;  // storage id -> model.storages
  std::vector<std::int64_t> extent;
  auto storage = [&](std::int64_t id, const std::string& name) -> std::size_t {
    auto [it, added] = index.emplace(id, model.storages.size());
    if (added) {
      ResidencyStorage s;
      s.id = id;
      s.name = name;
      model.storages.push_back(std::move(s));
      extent.push_back(0);
    }
    return it->second;
  };
  // Use of storage s by the op at `pos`; one entry per position, writes merged.
  auto use = [&](std::size_t s, std::int32_t pos, bool write) {
    ResidencyStorage& st = model.storages[s];
    if (!st.uses.empty() && st.uses.back() == pos) {
      if (write) st.writes.back() = true;
      return;
    }
    st.uses.push_back(pos);
    st.writes.push_back(write);
  };
  std::vector<std::pair<std::int64_t, std::int64_t>> found;
  for (std::size_t p = 0; p < n; ++p) {
    const Node& node = graph.nodes[p];
    const auto pos = static_cast<std::int32_t>(p);
    position[node.id] = p;
    model.op_names.push_back(node.name);
    model.op_ids.push_back(node.id);
    model.op_ms.push_back(cost.node_ms(graph, node));
    model.op_cpu_ms.push_back(node.cpu_ms ? *node.cpu_ms : -1.0);
    const auto [scratch_a, scratch_b] = sim::scratch_bytes(node);
    model.op_scratch.push_back(round_allocation(scratch_a, cost.profile()) +
                               round_allocation(scratch_b, cost.profile()));
    found.clear();
    residency_storages_of(node.value, found);
    if (node.kind == NodeKind::kPlaceholder || node.kind == NodeKind::kGetAttr) {
      for (const auto& [id, reach] : found) {
        const std::size_t s = storage(id, node.name);
        model.storages[s].across_steps = true;
        extent[s] = std::max(extent[s], reach);
      }
      continue;
    }
    // What the schema writes.
    std::set<std::int64_t> written;
    if (const OpSchema* schema = graph.schema_of(node); schema && schema->is_mutable) {
      auto mark = [&](const Arg& arg) {
        std::vector<const Arg*> stack{&arg};
        while (!stack.empty()) {
          const Arg* a = stack.back();
          stack.pop_back();
          if (a->kind == Arg::Kind::kNode) {
            found.clear();
            residency_storages_of(graph.nodes[position.at(a->node)].value, found);
            for (const auto& f : found) written.insert(f.first);
          }
          for (const Arg& item : a->list) stack.push_back(&item);
        }
      };
      std::size_t positional = 0;
      for (const OpArgument& argument : schema->arguments) {
        if (argument.kwarg_only) continue;
        if (positional < node.args.size() && argument.is_write) mark(node.args[positional]);
        ++positional;
      }
      for (const auto& [key, arg] : node.kwargs) {
        for (const OpArgument& argument : schema->arguments) {
          if (argument.name == key && argument.is_write) mark(arg);
        }
      }
    }
    const bool kept_by_output = node.kind == NodeKind::kOutput;
    node.for_each_input([&](NodeId input) {
      found.clear();
      residency_storages_of(graph.nodes[position.at(input)].value, found);
      for (const auto& [id, reach] : found) {
        const std::size_t s = storage(id, graph.nodes[position.at(input)].name);
        if (kept_by_output) {
          model.storages[s].kept = true;
        } else {
          use(s, pos, written.count(id) > 0);
        }
      }
    });
    if (kept_by_output) continue;
    found.clear();
    residency_storages_of(node.value, found);
    for (const auto& [id, reach] : found) {
      const bool existed = index.count(id) > 0;
      const std::size_t s = storage(id, node.name);
      extent[s] = std::max(extent[s], reach);
      use(s, pos, written.count(id) > 0 || !existed);  // making a storage writes it
    }
  }
  if (std::none_of(model.op_cpu_ms.begin(), model.op_cpu_ms.end(), [](double ms) { return ms >= 0; })) {
    model.op_cpu_ms.clear();  // no host times: the host is not modelled
  }
  // Freed later than its last use (Node::frees): alive until then.
  for (std::size_t p = 0; p < n; ++p) {
    for (const std::int64_t id : graph.nodes[p].frees) {
      const auto it = index.find(id);
      if (it == index.end()) continue;
      ResidencyStorage& st = model.storages[it->second];
      if (st.across_steps || st.uses.empty() || st.uses.back() >= static_cast<std::int32_t>(p)) continue;
      st.freed_after = std::max(st.freed_after, static_cast<std::int32_t>(p));
    }
  }
  for (std::size_t s = 0; s < model.storages.size(); ++s) {
    model.storages[s].bytes = round_allocation(extent[s], cost.profile());
  }
  // Storages no op uses (a placeholder nothing reads) cannot move; they stay.
  return model;
}

int add_host_update_candidates(const Graph& graph, ResidencyModel& model, double host_gbs) {
  if (!(host_gbs > 0)) {
    residency_bad("host bandwidth must be > 0 GB/s, got " + std::to_string(host_gbs));
  }
  std::unordered_map<std::int64_t, std::int32_t> index;
  for (std::size_t s = 0; s < model.storages.size(); ++s) {
    index.emplace(model.storages[s].id, static_cast<std::int32_t>(s));
  }
  std::unordered_map<NodeId, std::size_t> position;
  for (std::size_t p = 0; p < graph.nodes.size(); ++p) position[graph.nodes[p].id] = p;
  // The storage of each node a list argument names, or nothing when any is not one
  // tensor with a known storage.
  auto storages_of = [&](const Arg& list, std::vector<std::int32_t>& out,
                         std::int64_t* elements, bool fp32) -> bool {
    if (list.kind != Arg::Kind::kList) return false;
    for (const Arg& a : list.list) {
      if (a.kind != Arg::Kind::kNode) return false;
      const Value& v = graph.nodes[position.at(a.node)].value;
      if (!v.is_tensor() || !v.tensor.storage) return false;
      const auto it = index.find(*v.tensor.storage);
      if (it == index.end()) return false;
      if (fp32 && v.tensor.dtype != "float32") return false;
      if (elements != nullptr) {
        const auto bytes = v.tensor.nbytes();
        if (!bytes) return false;
        *elements += *bytes / v.tensor.element_size;
      }
      out.push_back(it->second);
    }
    return true;
  };
  int added = 0;
  for (std::size_t p = 0; p < graph.nodes.size(); ++p) {
    const Node& node = graph.nodes[p];
    if (node.phase != Phase::kOptimizer || node.target != "aten._fused_adamw_.default") continue;
    bool amsgrad = false;
    for (const auto& [key, arg] : node.kwargs) {
      if (key == "amsgrad") amsgrad = arg.kind == Arg::Kind::kBool && arg.b;
    }
    if (amsgrad || node.args.size() < 6) continue;
    HostUpdate u;
    u.ops.push_back(static_cast<std::int32_t>(p));
    bool ok = storages_of(node.args[0], u.params, &u.elements, true) &&
              storages_of(node.args[1], u.grads, nullptr, true);
    // The moments (and AMSGrad's maxima, none here); the step counts stay: the optimizer
    // increments them on the device in an op of its own, and they are 4 bytes.
    for (int k : {2, 3, 4}) ok = ok && storages_of(node.args[k], u.states, nullptr, false);
    if (!ok || u.params.empty() || u.params.size() != u.grads.size()) continue;
    // Gradients kept across steps would not be consumed by the update; a parameter
    // written by another op too would make the host master stale.
    for (std::int32_t g : u.grads) ok = ok && !model.storages[g].across_steps;
    for (std::int32_t s : u.params) {
      const ResidencyStorage& st = model.storages[s];
      for (std::size_t j = 0; j < st.uses.size(); ++j) ok = ok && (!st.writes[j] || st.uses[j] == u.ops.front());
    }
    if (!ok) continue;
    u.host_ms = static_cast<double>(u.elements) * kHostAdamWBytesPerElement / (host_gbs * 1e6);
    model.host_updates.push_back(std::move(u));
    ++added;
  }
  return added;
}

std::int32_t gradient_complete_position(const ResidencyModel& model, const HostUpdate& u, std::int32_t grad) {
  const ResidencyStorage& st = model.storages.at(grad);
  const std::int32_t first_op = *std::min_element(u.ops.begin(), u.ops.end());
  std::int32_t last_write = -1, last_use = -1;
  for (std::size_t j = 0; j < st.uses.size(); ++j) {
    if (st.uses[j] >= first_op) break;
    last_use = st.uses[j];
    if (st.writes[j]) last_write = st.uses[j];
  }
  // Not its last write: autograd takes views of a gradient after writing it (a
  // weight's is made transposed), and a view of a storage that is away brings
  // it back in the replay. It leaves after the last op that touches it.
  return last_write < 0 ? -1 : last_use;
}

ResidencyModel apply_host_updates(const ResidencyModel& model, const std::vector<std::int32_t>& chosen) {
  ResidencyModel out = model;
  std::set<std::int32_t> seen;
  for (std::int32_t k : chosen) {
    if (k < 0 || k >= static_cast<std::int32_t>(model.host_updates.size())) {
      residency_bad("host update " + std::to_string(k) + " out of range (" +
                    std::to_string(model.host_updates.size()) + " candidates)");
    }
    if (!seen.insert(k).second) residency_bad("host update " + std::to_string(k) + " chosen twice");
    const HostUpdate& u = model.host_updates[k];
    const std::set<std::int32_t> ops(u.ops.begin(), u.ops.end());
    const std::int32_t first_op = *ops.begin();
    for (std::int32_t p : ops) out.op_ms[p] = 0;
    auto drop = [&](std::int32_t s, auto&& gone) {
      ResidencyStorage& st = out.storages[s];
      std::vector<std::int32_t> uses;
      std::vector<bool> writes;
      for (std::size_t j = 0; j < st.uses.size(); ++j) {
        if (gone(st.uses[j])) continue;
        uses.push_back(st.uses[j]);
        writes.push_back(st.writes[j]);
      }
      st.uses = std::move(uses);
      st.writes = std::move(writes);
    };
    for (std::int32_t s : u.states) drop(s, [](std::int32_t) { return true; });
    for (std::int32_t s : u.grads) {
      // Complete at its last use before the update: what follows is the update's.
      const std::int32_t complete = gradient_complete_position(model, u, s);
      drop(s, [&](std::int32_t p) { return p > complete && (p >= first_op || ops.count(p) > 0); });
      out.storages[s].freed_after = -1;  // it leaves for the host once complete
    }
  }
  // Every storage's uses of the replaced ops (the parameters', a step count's).
  std::set<std::int32_t> replaced;
  for (std::int32_t k : chosen) replaced.insert(model.host_updates[k].ops.begin(), model.host_updates[k].ops.end());
  if (!replaced.empty()) {
    for (ResidencyStorage& st : out.storages) {
      for (std::size_t j = 0; j < st.uses.size();) {
        if (replaced.count(st.uses[j])) {
          st.uses.erase(st.uses.begin() + static_cast<std::ptrdiff_t>(j));
          st.writes.erase(st.writes.begin() + static_cast<std::ptrdiff_t>(j));
        } else {
          ++j;
        }
      }
    }
  }
  return out;
}

namespace {

struct ResidencyCopy {
  double start = 0;
  double end = 0;
};

// One copy stream: copies in issue order, each after the one before.
struct CopyLane {
  double free_at = 0;
  std::vector<ResidencyCopy> busy;
  bool overlaps(double start, double end) const {
    for (auto it = busy.rbegin(); it != busy.rend(); ++it) {
      if (it->end <= start) break;
      if (it->start < end) return true;
    }
    return false;
  }
};

}  // namespace

// What every replay of plans with the same host updates shares: the model they
// leave, and each position's uses and last uses.
struct ResidencySimulation::Basis {
  Basis(const ResidencyModel& model, const std::vector<std::int32_t>& host, const CostModel& cost)
      : original(model),
        host_updated(host),
        owned(host.empty() ? ResidencyModel{} : apply_host_updates(model, host)),
        transformed(host.empty() ? model : owned),
        cost(cost) {
    const auto n = transformed.op_ms.size();
    if (!transformed.op_cpu_ms.empty() && transformed.op_cpu_ms.size() != n) {
      residency_bad("op_cpu_ms has " + std::to_string(transformed.op_cpu_ms.size()) + " entries for " +
                    std::to_string(n) + " ops");
    }
    for (const auto& [name, ms] : {std::pair{"replay_op_ms", transformed.replay_op_ms},
                                   std::pair{"replay_copy_ms", transformed.replay_copy_ms}}) {
      if (!(std::isfinite(ms) && ms >= 0)) {
        residency_bad(std::string(name) + " must be a finite number >= 0, got " + std::to_string(ms));
      }
    }
    uses_by_position.assign(n, {});
    last_by_position.assign(n, {});
    for (std::size_t s = 0; s < transformed.storages.size(); ++s) {
      const ResidencyStorage& st = transformed.storages[s];
      for (std::int32_t p : st.uses) uses_by_position[p].push_back(s);
      if (!st.across_steps && !st.kept && !st.uses.empty()) {
        last_by_position[std::max(st.uses.back(), st.freed_after)].push_back(s);
      }
    }
  }
  const ResidencyModel& original;
  const std::vector<std::int32_t> host_updated;
  const ResidencyModel owned;  // the model with the host updates applied (when any)
  const ResidencyModel& transformed;
  const CostModel cost;  // a copy: a temporary cost model is easy to pass
  std::vector<std::vector<std::size_t>> uses_by_position, last_by_position;
};

namespace {

class ResidencyReplay {
 public:
  ResidencyReplay(const ResidencySimulation::Basis& basis, const ResidencyPlan& plan, bool record)
      : model_(basis.transformed),
        cost_(basis.cost),
        n_(static_cast<std::int32_t>(basis.original.op_ms.size())),
        record_(record),
        uses_by_position_(basis.uses_by_position),
        last_by_position_(basis.last_by_position) {
    const ResidencyModel& model = basis.original;
    check(plan);
    host_modelled_ = !model_.op_cpu_ms.empty();
    for (const std::int32_t k : plan.host_updated) {
      const HostUpdate& u = model.host_updates[k];
      const auto index = static_cast<std::int32_t>(updates_.size());
      updates_.push_back(&u);
      if (u.ops.empty()) residency_bad("host update " + std::to_string(k) + " replaces no op");
      update_at_.push_back(*std::min_element(u.ops.begin(), u.ops.end()));
      updates_at_[update_at_.back()].push_back(index);
      for (const std::int32_t g : u.grads) {
        const std::int32_t complete = gradient_complete_position(model_, u, g);
        if (complete < 0) {
          residency_bad("host update " + std::to_string(k) + ": gradient " + model_.storages[g].name +
                        " is never written");
        }
        grad_complete_after_[complete].push_back({index, g});
        update_grad_.insert(g);
      }
      for (const std::int32_t s : u.params) {
        param_update_[s] = index;
        const ResidencyStorage& st = model_.storages[s];
        if (!st.uses.empty()) param_last_use_[st.uses.back()].push_back(s);
      }
      for (const std::int32_t s : u.states) host_only_.insert(s);
    }
    for (const HostGap& gap : plan.gaps) {
      const ResidencyStorage& st = model_.storages[gap.storage];
      const std::int32_t start = st.uses[gap.after];
      const bool wrap = gap.after + 1 == static_cast<std::int32_t>(st.uses.size());
      const std::int32_t next = wrap ? st.uses.front() + n_ : st.uses[gap.after + 1];
      leaves_after_[start].push_back(gap.storage);
      // The copy back is issued at next - lead: in the step before the next use's
      // when that is below n (a wrap gap's early copy).
      issues_at_[(next - gap.lead) % n_].push_back(gap.storage);
      if (wrap) {
        starts_on_host_.insert(gap.storage);
        wrap_gap_.insert(gap.storage);
      }
      moved_.insert(gap.storage);
      if (gap.wait > 0) waits_at_[(start + gap.wait) % n_].push_back(gap.storage);
      // Its host copy is written back right after the last write before the gap.
      const std::int32_t written = write_back_position(model_, gap);
      if (written >= 0) {
        writebacks_after_[written].insert(gap.storage);
      } else {
        never_written_.insert(gap.storage);
      }
    }
  }

  ResidencyForecast run() {
    const std::size_t storages = model_.storages.size();
    on_device_.assign(storages, false);
    category_.assign(storages, kTemporaries);
    host_valid_.assign(storages, false);
    d2h_done_.assign(storages, -1.0);
    h2d_done_.assign(storages, 0.0);
    alive_.assign(storages, false);
    awaiting_update_.assign(storages, false);
    update_end_.assign(updates_.size(), 0.0);
    deferred_.assign(updates_.size(), {});
    for (std::size_t s = 0; s < storages; ++s) {
      const ResidencyStorage& st = model_.storages[s];
      if (!st.across_steps || host_only_.count(static_cast<std::int32_t>(s))) continue;
      alive_[s] = true;
      // A storage never written has its host copy from the start (made once).
      if (never_written_.count(static_cast<std::int32_t>(s))) host_valid_[s] = true;
      if (starts_on_host_.count(static_cast<std::int32_t>(s))) {
        host_valid_[s] = true;
      } else {
        allocate(s, kInputs);
      }
    }
    ResidencyForecast out;
    out.live_bytes.assign(n_, 0);
    double step_start = 0;
    for (int step = 0; step < 3; ++step) {
      const bool reported = step == 1;
      if (reported) {
        step_start = now_;
        step_start_ = now_;
        d2h_bytes_ = h2d_bytes_ = 0;
        stall_ = 0;
        host_busy_ = 0;
        host_issue_ = host_blocked_ = host_late_ = 0;
        recording_ = record_;
      } else {
        recording_ = false;
      }
      reported_ = reported;
      host_ = std::max(host_, now_);  // caught up between steps
      grads_left_.assign(updates_.size(), 0);
      started_.assign(updates_.size(), false);
      grads_landed_.assign(updates_.size(), 0.0);
      for (std::size_t u = 0; u < updates_.size(); ++u) {
        grads_left_[u] = static_cast<std::int32_t>(updates_[u]->grads.size());
      }
      for (std::int32_t p = 0; p < n_; ++p) position(p, reported, out);
      // A storage made in the step and kept goes when the next step makes it again.
      for (std::size_t s = 0; s < storages; ++s) {
        if (!model_.storages[s].across_steps && alive_[s]) {
          release(s);
          alive_[s] = false;
        }
      }
      if (reported) {
        out.step_ms = now_ - step_start;
        out.stall_ms = stall_;
        out.bytes_d2h = d2h_bytes_;
        out.bytes_h2d = h2d_bytes_;
        out.host_busy_ms = host_busy_;
        out.host_issue_ms = host_issue_;
        out.host_blocked_ms = host_blocked_;
        out.host_late_ms = host_late_;
      }
    }
    for (double ms : model_.op_ms) out.compute_ms += ms;
    out.intervals.insert(out.intervals.end(), intervals_.begin(), intervals_.end());
    // Pinned memory: the moved storages' copies, and for each host update its
    // parameters' masters, its gradients' buffers and its states.
    std::set<std::int32_t> on_host(moved_.begin(), moved_.end());
    for (const HostUpdate* u : updates_) {
      on_host.insert(u->params.begin(), u->params.end());
      on_host.insert(u->grads.begin(), u->grads.end());
      on_host.insert(u->states.begin(), u->states.end());
    }
    for (std::int32_t s : on_host) out.host_bytes += model_.storages[s].bytes;
    return out;
  }

 private:
  void check(const ResidencyPlan& plan) const {
    std::set<std::pair<std::int32_t, std::int32_t>> seen;
    for (std::size_t g = 0; g < plan.gaps.size(); ++g) {
      const HostGap& gap = plan.gaps[g];
      const std::string where = "gap " + std::to_string(g) + ": ";
      if (gap.storage < 0 || gap.storage >= static_cast<std::int32_t>(model_.storages.size())) {
        residency_bad(where + "storage " + std::to_string(gap.storage) + " out of range");
      }
      const ResidencyStorage& st = model_.storages[gap.storage];
      const auto uses = static_cast<std::int32_t>(st.uses.size());
      if (gap.after < 0 || gap.after >= uses) {
        residency_bad(where + "use " + std::to_string(gap.after) + " of storage " + st.name + " out of range (" +
            std::to_string(uses) + " uses)");
      }
      const bool wrap = gap.after + 1 == uses;
      if (wrap && !st.across_steps) {
        residency_bad(where + "storage " + st.name + " is made in the step: its last use has no gap after it");
      }
      const std::int32_t start = st.uses[gap.after];
      const std::int32_t next = wrap ? st.uses.front() + n_ : st.uses[gap.after + 1];
      if (next - start < 2) residency_bad(where + "no op between two uses of " + st.name);
      if (gap.lead < 1 || gap.lead >= next - start) {
        residency_bad(where + "lead " + std::to_string(gap.lead) + " outside 1.." + std::to_string(next - start - 1));
      }
      if (gap.wait < 0 || (gap.wait > 0 && gap.wait + gap.lead >= next - start)) {
        residency_bad(where + "wait " + std::to_string(gap.wait) + " of storage " + st.name +
                      " not before its copy back (lead " + std::to_string(gap.lead) + " of a gap of " +
                      std::to_string(next - start) + " positions)");
      }
      if (!seen.insert({gap.storage, gap.after}).second) residency_bad(where + "the same gap twice");
    }
  }

  static constexpr int kInputs = static_cast<int>(MemoryCategory::kInputs);
  static constexpr int kTemporaries = static_cast<int>(MemoryCategory::kTemporaries);
  static constexpr int kInFlight = static_cast<int>(MemoryCategory::kInFlight);
  static constexpr int kReloads = static_cast<int>(MemoryCategory::kReloads);

  void allocate(std::size_t s, int category) {
    if (on_device_[s]) return;
    on_device_[s] = true;
    live_ += model_.storages[s].bytes;
    category_[s] = category;
    by_category_[category] += model_.storages[s].bytes;
  }
  void release(std::size_t s) {
    if (!on_device_[s]) return;
    on_device_[s] = false;
    live_ -= model_.storages[s].bytes;
    by_category_[category_[s]] -= model_.storages[s].bytes;
  }
  void recategorise(std::size_t s, int category) {
    if (!on_device_[s]) return;
    by_category_[category_[s]] -= model_.storages[s].bytes;
    category_[s] = category;
    by_category_[category] += model_.storages[s].bytes;
  }
  NodeId op_id(std::int32_t p) const {
    return p < static_cast<std::int32_t>(model_.op_ids.size()) ? model_.op_ids[p] : p;
  }
  int own_category(std::size_t s) const {
    return model_.storages[s].across_steps ? kInputs : kTemporaries;
  }

  double copy(CopyLane& self, CopyLane& other, double start, std::int64_t bytes, bool h2d,
              std::int32_t issued_at) {
    if (host_modelled_) {  // the host issues it (Note [The host in residency replay])
      host_ += model_.replay_copy_ms;
      if (reported_) host_issue_ += model_.replay_copy_ms;
      start = std::max(start, host_);
    }
    start = std::max(start, self.free_at);
    const double alone = h2d ? cost_.h2d_ms(bytes) : cost_.d2h_ms(bytes);
    const double end = other.overlaps(start, start + alone)
                           ? start + (h2d ? cost_.h2d_ms(bytes, true) : cost_.d2h_ms(bytes, true))
                           : start + alone;
    self.free_at = end;
    self.busy.push_back({start, end});
    if (recording_) {
      intervals_.push_back({h2d ? Stream::kH2D : Stream::kD2H, op_id(issued_at),
                            start - step_start_, end - step_start_, bytes});
    }
    return end;
  }

  void position(std::int32_t p, bool reported, ResidencyForecast& out) {
    // (1) Frees of storages whose D2H has landed; the compute stream first waits
    // for those the plan frees here whatever their copy's delay (HostGap::wait).
    if (auto it = waits_at_.find(p); it != waits_at_.end()) {
      for (const std::int32_t s : it->second) {
        if (pending_free_.count(s) == 0 || d2h_done_[s] <= now_) continue;
        if (reported) stall_ += d2h_done_[s] - now_;
        now_ = d2h_done_[s];
      }
    }
    // The landing times come off a heap (an entry whose storage has since come back, or
    // left again with a later copy, is stale); those landed go in index order.
    landed_now_.clear();
    while (!landing_.empty() && landing_.top().first <= now_) {
      const auto [at, s] = landing_.top();
      landing_.pop();
      if (pending_free_.count(s) > 0 && d2h_done_[s] == at) landed_now_.push_back(s);
    }
    std::sort(landed_now_.begin(), landed_now_.end());
    landed_now_.erase(std::unique(landed_now_.begin(), landed_now_.end()), landed_now_.end());
    for (const std::size_t s : landed_now_) {
      if (reported) out.landed.emplace_back(static_cast<std::int32_t>(s), p);
      recategorise(s, own_category(s));
      release(s);
      pending_free_.erase(s);
    }
    // (2) Copies back issued here.
    if (auto it = issues_at_.find(p); it != issues_at_.end()) {
      for (const std::size_t s : it->second) {
        if (pending_free_.erase(s) > 0) {  // its D2H has not landed: the buffer is still here
          if (reported) out.never_left.emplace_back(static_cast<std::int32_t>(s), p);
          h2d_done_[s] = 0;
          recategorise(s, own_category(s));
          continue;
        }
        if (on_device_[s]) continue;  // never left (the first step, before the gap's start)
        if (awaiting_update_[s]) {  // its new value is not made yet: copied once it is
          deferred_[param_update_.at(static_cast<std::int32_t>(s))].push_back(s);
          continue;
        }
        fetch(s, p);
      }
    }
    // (3) The op, once the host has issued it.
    double begin = now_;
    if (const double issue = op_host_ms(model_, p); issue >= 0) {
      host_ += issue;
      if (reported) host_issue_ += issue;
      if (host_ > begin) {
        if (reported) host_late_ += host_ - begin;
        begin = host_;
      }
    }
    const double issued = begin;
    for (std::size_t s : uses_at(p)) {
      if (host_modelled_) {
        if (const auto it = param_update_.find(static_cast<std::int32_t>(s)); it != param_update_.end()) {
          block_host(update_end_[it->second]);  // the replay waits for the update it reads
        }
      }
      if (!on_device_[s]) {  // a storage whose copy back was planned for the step before
        if (!alive_[s] && !model_.storages[s].across_steps) {
          alive_[s] = true;  // made here
          allocate(s, kTemporaries);
          continue;
        }
        fetch(s, p);
      }
      if (pending_free_.erase(s) > 0) recategorise(s, own_category(s));
      begin = std::max(begin, h2d_done_[s]);
      alive_[s] = true;
    }
    if (reported) stall_ += begin - issued;
    const std::int64_t live = live_ + model_.op_scratch[p];
    if (reported) {
      out.live_bytes[p] = live;
      if (live > out.peak_bytes) {
        out.peak_bytes = live;
        out.peak_op = p;
        out.in_flight_at_peak.assign(pending_free_.begin(), pending_free_.end());
      }
    }
    if (recording_) {
      TimelinePoint point;
      point.node = op_id(p);
      point.start_ms = begin - step_start_;
      point.end_ms = begin + model_.op_ms[p] - step_start_;
      point.live_bytes = live_;
      point.scratch_bytes = model_.op_scratch[p];
      for (int c = 0; c < kMemoryCategoryCount; ++c) point.by_category[c] = by_category_[c];
      out.timeline.push_back(point);
      if (model_.op_ms[p] > 0) {
        out.intervals.push_back({Stream::kCompute, point.node, point.start_ms, point.end_ms, 0});
      }
    }
    now_ = begin + model_.op_ms[p];
    for (std::size_t s : uses_at(p)) {
      if (writes_at(s, p)) host_valid_[s] = false;
    }
    // (4) Write-backs, then leaving the device.
    if (auto it = writebacks_after_.find(p); it != writebacks_after_.end()) {
      for (std::int32_t s : it->second) {
        d2h_done_[s] = copy(d2h_, h2d_, now_, model_.storages[s].bytes, false, p);
        d2h_bytes_ += model_.storages[s].bytes;
        host_valid_[s] = true;
      }
    }
    if (auto it = grad_complete_after_.find(p); it != grad_complete_after_.end()) {
      for (const auto& [u, g] : it->second) grad_complete(u, g, p);
    }
    if (auto it = updates_at_.find(p); it != updates_at_.end()) {
      for (const std::int32_t u : it->second) {
        if (grads_left_[u] == 0 && !started_[u]) start_update(u, p);
      }
    }
    if (auto it = param_last_use_.find(p); it != param_last_use_.end()) {
      for (const std::int32_t s : it->second) {
        if (!started_[param_update_.at(s)]) awaiting_update_[s] = true;
      }
    }
    if (auto it = leaves_after_.find(p); it != leaves_after_.end()) {
      for (std::int32_t s : it->second) {
        if (host_valid_[s] && d2h_done_[s] > now_) {
          await_landing(s);  // its write-back is under way
          recategorise(s, kInFlight);
        } else if (host_valid_[s]) {
          // Its write-back has landed here: freed at once. The replay's copy may be
          // later than this one; it is let go before the next op all the same.
          release(s);
          if (reported) out.landed.emplace_back(static_cast<std::int32_t>(s), p + 1);
        } else {  // the first step: no write-back before it yet
          d2h_done_[s] = copy(d2h_, h2d_, now_, model_.storages[s].bytes, false, p);
          d2h_bytes_ += model_.storages[s].bytes;
          host_valid_[s] = true;
          await_landing(s);
          recategorise(s, kInFlight);
        }
      }
    }
    for (std::size_t s : last_uses_at(p)) {
      alive_[s] = false;
      host_valid_[s] = false;
      // A gradient's last use is where it is complete, so its D2H has just begun.
      if (update_grad_.count(static_cast<std::int32_t>(s)) && d2h_done_[s] > now_) {
        await_landing(s);  // a gradient on its way to the host update
        recategorise(s, kInFlight);
        continue;
      }
      release(s);
      pending_free_.erase(s);
    }
  }

  // A storage brought back by an H2D issued at position p: after its D2H (if
  // under way) and, for a parameter updated on the host, after its update.
  void fetch(std::size_t s, std::int32_t p) {
    double start = std::max({now_, host_, d2h_done_[s]});
    if (const auto it = param_update_.find(static_cast<std::int32_t>(s)); it != param_update_.end()) {
      start = std::max(start, update_end_[it->second]);
    }
    allocate(s, kReloads);
    h2d_done_[s] = copy(h2d_, d2h_, start, model_.storages[s].bytes, true, p);
    h2d_bytes_ += model_.storages[s].bytes;
  }

  // Gradient g of host update u is complete after position p: it goes to the host.
  void grad_complete(std::int32_t u, std::int32_t g, std::int32_t p) {
    d2h_done_[g] = copy(d2h_, h2d_, now_, model_.storages[g].bytes, false, p);
    d2h_bytes_ += model_.storages[g].bytes;
    grads_landed_[u] = std::max(grads_landed_[u], d2h_done_[g]);
    if (--grads_left_[u] == 0 && p >= update_at_[u]) start_update(u, p);
  }

  // Update u is handed to the host at its op's position p (its last gradient
  // complete): it starts once that gradient has landed and the host is free,
  // then its parameters come back (in place, or when their copy back is issued).
  void start_update(std::int32_t u, std::int32_t p) {
    started_[u] = true;
    const double start = std::max({grads_landed_[u], host_free_, now_});
    update_end_[u] = start + updates_[u]->host_ms;
    host_free_ = update_end_[u];
    if (reported_) host_busy_ += updates_[u]->host_ms;
    for (const std::int32_t s : updates_[u]->params) {
      awaiting_update_[s] = false;
      if (on_device_[s] && !wrap_gap_.count(s)) {  // stays: the new value is copied into it
        h2d_done_[s] = copy(h2d_, d2h_, update_end_[u], model_.storages[s].bytes, true, p);
        h2d_bytes_ += model_.storages[s].bytes;
      }
    }
    for (const std::size_t s : deferred_[u]) {
      if (!on_device_[s]) fetch(s, p);
    }
    deferred_[u].clear();
  }

  // The host thread waits until `until` (a copy's event, a host update).
  void block_host(double until) {
    if (!host_modelled_ || until <= host_) return;
    if (reported_) host_blocked_ += until - host_;
    host_ = until;
  }

  // Storage s is on the device until its D2H lands (step (1) frees it then).
  void await_landing(std::size_t s) {
    pending_free_.insert(s);
    landing_.emplace(d2h_done_[s], s);
  }

  const std::vector<std::size_t>& uses_at(std::int32_t p) const { return uses_by_position_[p]; }
  const std::vector<std::size_t>& last_uses_at(std::int32_t p) const { return last_by_position_[p]; }
  bool writes_at(std::size_t s, std::int32_t p) const {
    const ResidencyStorage& st = model_.storages[s];
    const auto it = std::lower_bound(st.uses.begin(), st.uses.end(), p);
    return it != st.uses.end() && *it == p && st.writes[it - st.uses.begin()];
  }

  const ResidencyModel& model_;  // with the plan's host updates applied (when any)
  const CostModel& cost_;
  const std::int32_t n_;
  const bool record_;
  bool reported_ = false;
  // Host updates (Note [Residency replay]).
  std::vector<const HostUpdate*> updates_;
  std::map<std::int32_t, std::vector<std::pair<std::int32_t, std::int32_t>>> grad_complete_after_;
  std::map<std::int32_t, std::vector<std::int32_t>> param_last_use_;
  std::map<std::int32_t, std::int32_t> param_update_;  // parameter storage -> update
  std::set<std::int32_t> update_grad_, host_only_, wrap_gap_;
  std::vector<bool> awaiting_update_;
  std::vector<std::int32_t> grads_left_;
  std::vector<std::int32_t> update_at_;  // an update's op position: where it is handed over
  std::map<std::int32_t, std::vector<std::int32_t>> updates_at_;
  std::vector<bool> started_;
  std::vector<double> grads_landed_, update_end_;
  std::vector<std::vector<std::size_t>> deferred_;
  double host_free_ = 0;
  double host_busy_ = 0;
  // The host thread issuing the step (Note [The host in residency replay]).
  bool host_modelled_ = false;
  double host_ = 0;
  double host_issue_ = 0, host_blocked_ = 0, host_late_ = 0;
  bool recording_ = false;
  double step_start_ = 0;
  std::vector<int> category_;
  std::array<std::int64_t, kMemoryCategoryCount> by_category_{};
  std::vector<StreamInterval> intervals_;
  std::map<std::int32_t, std::vector<std::int32_t>> leaves_after_;
  std::map<std::int32_t, std::vector<std::int32_t>> issues_at_;
  std::map<std::int32_t, std::vector<std::int32_t>> waits_at_;  // HostGap::wait, by position
  std::set<std::int32_t> starts_on_host_;
  std::map<std::int32_t, std::set<std::int32_t>> writebacks_after_;
  std::set<std::int32_t> never_written_;
  std::set<std::int32_t> moved_;
  const std::vector<std::vector<std::size_t>>& uses_by_position_;
  const std::vector<std::vector<std::size_t>>& last_by_position_;
  std::vector<bool> on_device_, host_valid_, alive_;
  std::vector<double> d2h_done_, h2d_done_;
  std::set<std::size_t> pending_free_;
  // (landing time, storage) of the D2Hs pending_free_ waits for, soonest first.
  std::priority_queue<std::pair<double, std::size_t>, std::vector<std::pair<double, std::size_t>>,
                      std::greater<>>
      landing_;
  std::vector<std::size_t> landed_now_;
  CopyLane d2h_, h2d_;
  double now_ = 0;
  double stall_ = 0;
  std::int64_t live_ = 0;
  std::int64_t d2h_bytes_ = 0, h2d_bytes_ = 0;
};

}  // namespace

std::int32_t write_back_position(const ResidencyModel& model, const HostGap& gap) {
  const ResidencyStorage& st = model.storages.at(gap.storage);
  const auto uses = static_cast<std::int32_t>(st.uses.size());
  const std::int32_t back = st.across_steps ? uses : gap.after + 1;
  for (std::int32_t k = 0; k < back; ++k) {
    const std::int32_t j = ((gap.after - k) % uses + uses) % uses;
    if (st.writes[j]) return st.uses[j];
  }
  return -1;
}

ResidencySimulation::ResidencySimulation(const ResidencyModel& model, const std::vector<std::int32_t>& host_updated,
                                         const CostModel& cost)
    : basis_(std::make_unique<Basis>(model, host_updated, cost)) {}

ResidencySimulation::~ResidencySimulation() = default;

const ResidencyModel& ResidencySimulation::model() const { return basis_->transformed; }

ResidencyForecast ResidencySimulation::simulate(const ResidencyPlan& plan, bool record_timeline) const {
  if (plan.host_updated != basis_->host_updated) {
    residency_bad("a plan with other host updates than the simulation was made for");
  }
  return ResidencyReplay(*basis_, plan, record_timeline).run();
}

ResidencyForecast simulate_residency(const ResidencyModel& model, const ResidencyPlan& plan,
                                     const CostModel& cost, bool record_timeline) {
  return ResidencySimulation(model, plan.host_updated, cost).simulate(plan, record_timeline);
}

SimResult residency_sim_result(const Graph& graph, const ResidencyModel& model,
                               const ResidencyForecast& forecast) {
  if (forecast.timeline.size() != model.op_ms.size() || graph.nodes.size() != model.op_ms.size()) {
    throw InvalidArgument("residency", "the writers need a forecast simulated with record_timeline "
                                       "from a model of this graph");
  }
  SimResult r;
  r.step_ms = forecast.step_ms;
  r.peak_bytes = forecast.peak_bytes;
  if (forecast.peak_op >= 0) {
    const TimelinePoint& at = forecast.timeline[forecast.peak_op];
    r.peak_node = at.node;
    r.peak_phase = graph.nodes[forecast.peak_op].phase;
    r.peak_time_ms = at.start_ms;
    r.peak_by_category = at.by_category;
    r.peak_by_category[static_cast<int>(MemoryCategory::kTemporaries)] += at.scratch_bytes;
  }
  r.compute_busy_ms = forecast.compute_ms;
  r.compute_wait_ms = forecast.stall_ms;
  r.bytes_d2h = forecast.bytes_d2h;
  r.bytes_h2d = forecast.bytes_h2d;
  r.host_peak_bytes = forecast.host_bytes;
  for (const StreamInterval& interval : forecast.intervals) {
    const double ms = interval.end_ms - interval.start_ms;
    if (interval.stream == Stream::kD2H) r.d2h_busy_ms += ms;
    if (interval.stream == Stream::kH2D) r.h2d_busy_ms += ms;
  }
  r.timeline = forecast.timeline;
  r.intervals = forecast.intervals;
  return r;
}

}  // namespace spillway
