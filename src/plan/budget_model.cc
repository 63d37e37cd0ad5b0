#include "plan/budget_model.h"

#include <algorithm>
#include <iterator>
#include <tuple>

#include "spillway/error.h"

namespace spillway::plan {
namespace {

// What happens at one point of the step. Points are "before node p" (slot 2p)
// and "after node p" (slot 2p + 1); within a slot, kinds run in this order.
enum class EventKind {
  kOffloadIssue = 0,  // after the producer
  kForwardWait = 1,   // after offload_release
  kReloadIssue = 2,   // before reload_at
  kBackwardWait = 3,  // before needed_before
  kRecompute = 4,     // before needed_before
};

struct Event {
  std::size_t slot = 0;
  EventKind kind = EventKind::kOffloadIssue;
  std::size_t candidate = 0;
  friend bool operator<(const Event& a, const Event& b) {
    return std::tie(a.slot, a.kind, a.candidate) < std::tie(b.slot, b.kind, b.candidate);
  }
};

}  // namespace

BudgetModel::BudgetModel(std::vector<ModelCandidate> candidates, std::vector<double> node_ms,
                         std::vector<std::int64_t> baseline_live,
                         std::vector<std::size_t> reload_anchor, const CostModel& cost,
                         std::vector<double> host_ms)
    : candidates_(std::move(candidates)),
      node_ms_(std::move(node_ms)),
      baseline_live_(std::move(baseline_live)),
      reload_anchor_(std::move(reload_anchor)),
      host_ms_(std::move(host_ms)) {
  if (node_ms_.size() != baseline_live_.size() || node_ms_.size() != reload_anchor_.size() ||
      (!host_ms_.empty() && host_ms_.size() != node_ms_.size())) {
    throw Error("plan", "internal error: budget model inputs of different lengths");
  }
  prefix_ms_.assign(node_ms_.size() + 1, 0.0);
  for (std::size_t p = 0; p < node_ms_.size(); ++p) prefix_ms_[p + 1] = prefix_ms_[p] + node_ms_[p];
  for (const ModelCandidate& c : candidates_) {
    d2h_ms_.push_back(c.can_offload ? cost.d2h_ms(c.bytes) : 0.0);
    h2d_ms_.push_back(c.can_offload ? cost.h2d_ms(c.bytes) : 0.0);
  }
}

std::vector<std::size_t> BudgetModel::needed_before(const std::vector<Decision>& decisions) const {
  std::vector<std::size_t> before(candidates_.size());
  for (std::size_t i = 0; i < candidates_.size(); ++i) before[i] = candidates_[i].first_backward;
  // A recompute reads earlier candidates only, so visiting the latest first
  // settles each reader before the values it reads.
  for (std::size_t j = candidates_.size(); j-- > 0;) {
    if (decisions[j] != Decision::kRecompute) continue;
    for (int i : candidates_[j].recompute_reads) {
      before[static_cast<std::size_t>(i)] = std::min(before[static_cast<std::size_t>(i)], before[j]);
    }
  }
  return before;
}

std::pair<std::size_t, std::size_t> BudgetModel::freed_interval(
    const std::vector<Decision>& decisions, std::size_t i) const {
  return freed_interval(needed_before(decisions), i, decisions[i]);
}

std::pair<std::size_t, std::size_t> BudgetModel::freed_interval(
    const std::vector<std::size_t>& needed, std::size_t i, Decision decision) const {
  const ModelCandidate& c = candidates_[i];
  const std::size_t before = needed[i];
  switch (decision) {
    case Decision::kOffload: {
      const std::size_t back = reload_anchor_[before];
      return {c.offload_release + 1, back == 0 ? 0 : back - 1};
    }
    case Decision::kRecompute:
      return {c.last_forward + 1, before == 0 ? 0 : before - 1};
    case Decision::kKeep:
      break;
  }
  return {1, 0};
}

ModelScore BudgetModel::evaluate(const std::vector<Decision>& decisions,
                                 std::vector<std::int64_t>* live_out,
                                 std::vector<int>* release_lags) const {
  if (decisions.size() != candidates_.size()) {
    throw Error("plan", "internal error: one decision per candidate expected");
  }
  const std::size_t n = node_ms_.size();
  const std::vector<std::size_t> before = needed_before(decisions);
  std::vector<Event> events;
  std::vector<std::int64_t> delta(n + 1, 0);
  auto free_between = [&](std::size_t first, std::size_t last, std::int64_t bytes) {
    if (first > last || first >= n) return;
    delta[first] -= bytes;
    delta[std::min(last, n - 1) + 1] += bytes;
  };
  // Offloads whose release waits for the time pass (release_positions).
  std::vector<std::size_t> timed_release;
  if (release_lags != nullptr) release_lags->assign(candidates_.size(), -1);
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const ModelCandidate& c = candidates_[i];
    switch (decisions[i]) {
      case Decision::kKeep:
        break;
      case Decision::kOffload: {
        if (!c.can_offload) throw Error("plan", "internal error: offload of a fixed value");
        const std::size_t back = reload_anchor_[before[i]];
        const bool timed = !c.release_positions.empty();
        const std::size_t wait_at = timed ? c.release_positions.back() : c.offload_release;
        events.push_back({2 * c.position + 1, EventKind::kOffloadIssue, i});
        events.push_back({2 * wait_at + 1, EventKind::kForwardWait, i});
        events.push_back({2 * back, EventKind::kReloadIssue, i});
        events.push_back({2 * before[i], EventKind::kBackwardWait, i});
        if (timed) {
          timed_release.push_back(i);
        } else {
          if (back > 0) free_between(c.offload_release + 1, back - 1, c.bytes);
          if (release_lags != nullptr) (*release_lags)[i] = c.release_lag;
        }
        break;
      }
      case Decision::kRecompute:
        if (!c.can_recompute) throw Error("plan", "internal error: recompute of a fixed value");
        events.push_back({2 * before[i], EventKind::kRecompute, i});
        if (before[i] > 0) free_between(c.last_forward + 1, before[i] - 1, c.bytes);
        break;
    }
  }
  std::sort(events.begin(), events.end());

  ModelScore score;
  double t = 0;
  std::size_t done = 0;  // nodes executed so far
  double d2h_free = 0, h2d_free = 0;
  // Note [The host lane]: the host's time per position under these decisions,
  // and when it has issued the nodes so far.
  std::vector<double> host_ms;
  double host = 0;
  if (!host_ms_.empty()) {
    host_ms = host_ms_;
    for (std::size_t i = 0; i < candidates_.size(); ++i) {
      const ModelCandidate& c = candidates_[i];
      if (c.host_unless >= 0 &&
          decisions[static_cast<std::size_t>(c.host_unless)] == Decision::kRecompute) {
        continue;
      }
      if (decisions[i] == Decision::kOffload) host_ms[c.position] += c.host_offload_ms;
      if (decisions[i] == Decision::kRecompute) host_ms[c.position] += c.host_recompute_ms;
    }
  }
  std::vector<double> d2h_end(candidates_.size(), 0.0), h2d_end(candidates_.size(), 0.0);
  // (slot, time added to the compute stream by waits and recomputes at or
  // before that slot), one per event: a node's end time for timed releases.
  std::vector<std::pair<std::size_t, double>> added;
  auto run_until = [&](std::size_t nodes) {
    if (nodes <= done) return;
    if (host_ms.empty()) {
      t += prefix_ms_[nodes] - prefix_ms_[done];
      done = nodes;
      return;
    }
    for (; done < nodes; ++done) {  // execution model (12) of spillway/sim.h
      host += std::max(0.0, host_ms[done]);
      t += node_ms_[done];
      if (host > t) {
        score.host_wait_ms += host - t;
        t = host;
      }
    }
  };
  auto wait_for = [&](double ready) {
    if (ready > t) {
      score.wait_ms += ready - t;
      t = ready;
    }
  };
  for (const Event& e : events) {
    run_until(e.slot / 2 + (e.slot % 2));
    const std::size_t i = e.candidate;
    switch (e.kind) {
      case EventKind::kOffloadIssue:
        d2h_end[i] = std::max(d2h_free, t) + d2h_ms_[i];
        d2h_free = d2h_end[i];
        break;
      case EventKind::kForwardWait:
        wait_for(d2h_end[i]);
        break;
      case EventKind::kReloadIssue:
        h2d_end[i] = std::max({h2d_free, t, d2h_end[i]}) + h2d_ms_[i];
        h2d_free = h2d_end[i];
        break;
      case EventKind::kBackwardWait:
        wait_for(h2d_end[i]);
        break;
      case EventKind::kRecompute:
        t += candidates_[i].recompute_ms;
        break;
    }
    if (!timed_release.empty()) added.emplace_back(e.slot, t - prefix_ms_[done]);
  }
  run_until(n);
  score.step_ms = std::max({t, d2h_free, h2d_free});

  // A timed release frees after the first of its positions whose node ends
  // (before the waits that follow it) with the D2H done, else the last.
  for (std::size_t i : timed_release) {
    const ModelCandidate& c = candidates_[i];
    std::size_t chosen = c.release_positions.size() - 1;
    for (std::size_t k = 0; k + 1 < c.release_positions.size(); ++k) {
      const std::size_t p = c.release_positions[k];
      auto it = std::upper_bound(added.begin(), added.end(), 2 * p,
                                 [](std::size_t slot, const std::pair<std::size_t, double>& a) {
                                   return slot < a.first;
                                 });
      const double shift = it == added.begin() ? 0.0 : std::prev(it)->second;
      if (prefix_ms_[p + 1] + shift >= d2h_end[i]) {
        chosen = k;
        break;
      }
    }
    const std::size_t back = reload_anchor_[before[i]];
    if (back > 0) free_between(c.release_positions[chosen] + 1, back - 1, c.bytes);
    if (release_lags != nullptr) (*release_lags)[i] = c.release_lags[chosen];
  }

  std::int64_t running = 0;
  if (live_out != nullptr) live_out->resize(n);
  for (std::size_t p = 0; p < n; ++p) {
    running += delta[p];
    const std::int64_t live = baseline_live_[p] + running;
    if (live_out != nullptr) (*live_out)[p] = live;
    if (live > score.peak) {
      score.peak = live;
      score.peak_position = p;
    }
  }
  return score;
}

}  // namespace spillway::plan
