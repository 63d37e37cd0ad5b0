// The residency planner (include/spillway/residency.h).
//
// Note [Residency planning]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A candidate is a gap between two uses of a storage of at least min_bytes
// with an op inside it (for a storage that lives across steps, the wrap from
// its last use to the next step's first too). Its copy back is led by the
// fewest positions whose ops take prefetch_slack times the copy's time, or
// the whole gap when the gap is shorter (then the copy cannot hide).
//
// Greedy: simulate; while the peak is above the budget, take the candidates
// whose gap holds the peak position off the device (their storage left
// before it and is not back yet), best first: those whose copies hide in the
// gap's compute (largest first), then the rest by the time they cannot hide
// per byte; as many as cover the excess at once; simulate again. When none
// is left, the storages that should be gone at the peak but whose
// write-backs have not landed there (queued behind other copies: a gap
// chosen, or one whose copy cannot land in time) get a wait there
// (HostGap::wait: the compute stream waits for the copy), those whose copies
// were issued first (they land first) before the rest, as many as cover the
// excess. Without waits offload cannot go below what the copies land in
// time for: on T1's recorded step the forward hides ~4.4 GiB of copies, and
// the planner reached 27.6 GiB of a 26.1 GiB budget there, then cycled (a gap
// dropped for raising the excess was taken again for covering the peak).
// Only when nothing is left to wait for either, adding or dropping each
// candidate is simulated and the change that lowers the bytes above the
// budget (summed over positions) most is made (of the 64 largest gaps around
// the peak); a gap dropped so is not taken again, so every round takes a
// gap, moves a wait earlier or bans a gap, and the search ends. Before all
// this, a plan with every candidate on the host is simulated: when even that
// does not fit and some op alone uses more than the budget, the error says
// so at once (everything on the host is not a lower bound: its copies queue
// behind one another and come back early, so a subset can fit where
// everything does not; a test has one). When the peak fits, gaps whose
// storage never left (a copy back issued before the write-back landed) go
// if the plan fits without them (on T1 at 80 % they were 13.6 GiB of the
// 23.3 GiB written back, and the step went from 406 to 302 ms simulated);
// then chosen gaps are dropped, latest first, while the plan still fits and
// is no slower (a peak covered by a later choice may not need an earlier
// one), else their wait is. Exact: every subset of the candidates, without
// waits, the fastest that fits; the test oracle for small traces.
//
// Host updates (the model's AdamW steps that may run on the host,
// add_host_update_candidates): the gaps are planned twice, on the model as
// it is and on the model with every host update applied (their moments off
// the device for good, their gradients leaving once complete), and the
// faster plan that fits is the answer (kFastest; kNone and kAll plan one).
// kFastest also plans with the first eighth, quarter, half and three
// quarters of them, in the order their gradients complete (the last layers'
// first: their updates overlap the rest of backward, and their parameters
// are needed last in the next forward). A choice per parameter is left for
// later: each choice is a whole gap search (the choices run on threads of
// their own).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <future>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "spillway/error.h"
#include "spillway/residency.h"

namespace spillway {
namespace {

struct GapCandidate {
  HostGap gap;
  std::int32_t start = 0;  // position of the use the gap follows
  std::int32_t gone = 0;   // the first position its storage may be off the device: after
                           // its D2H, when its host copy may be stale
  std::int32_t back = 0;   // position where the copy back is issued (unrolled: may be >= n)
  std::int32_t next = 0;   // position of the next use (unrolled)
  std::int32_t written = 0;  // position of its write-back (the last write before the gap), else start
  std::int64_t bytes = 0;
  double unhidden_ms = 0;  // copy time beyond the gap's compute
};

std::vector<GapCandidate> gap_candidates(const ResidencyModel& model, const ResidencyOptions& options,
                                     const CostModel& cost) {
  const auto n = static_cast<std::int32_t>(model.op_ms.size());
  std::vector<GapCandidate> out;
  for (std::size_t s = 0; s < model.storages.size(); ++s) {
    const ResidencyStorage& st = model.storages[s];
    if (st.bytes < options.min_bytes || st.uses.empty()) continue;
    const auto uses = static_cast<std::int32_t>(st.uses.size());
    for (std::int32_t k = 0; k < uses; ++k) {
      const bool wrap = k + 1 == uses;
      if (wrap && !st.across_steps) continue;
      const std::int32_t start = st.uses[k];
      const std::int32_t next = wrap ? st.uses.front() + n : st.uses[k + 1];
      if (next - start < 2) continue;
      const double need = options.prefetch_slack * cost.h2d_ms(st.bytes);
      double ahead = 0;
      std::int32_t lead = 0;
      while (lead + 1 < next - start && ahead < need) {
        ++lead;
        ahead += model.op_ms[(next - lead) % n];
      }
      double inside = 0;
      for (std::int32_t p = start + 1; p < next; ++p) inside += model.op_ms[p % n];
      bool stale = !st.across_steps;
      for (bool w : st.writes) stale = stale || w;
      // The write-back starts after the last write before the gap (residency.cc);
      // the storage is gone once it has landed.
      std::int32_t gone = start + 1;
      if (stale) {
        std::int32_t written = start;
        for (std::int32_t j = k; j >= 0 && !st.writes[j]; --j) written = j > 0 ? st.uses[j - 1] : -1;
        double copied = 0;
        for (std::int32_t p = std::max(written, 0) + 1; p <= start; ++p) copied += model.op_ms[p];
        const double d2h = cost.d2h_ms(st.bytes);
        while (gone < next - lead && copied < d2h) copied += model.op_ms[gone++ % n];
      }
      GapCandidate c;
      c.gap = {static_cast<std::int32_t>(s), k, lead};
      c.start = start;
      c.gone = gone;
      c.back = next - lead;
      c.next = next;
      // Unrolled: a write in the step before (a storage kept across steps) is below 0.
      const std::int32_t written = write_back_position(model, c.gap);
      c.written = written < 0 ? start : written - (written > start ? n : 0);
      c.bytes = st.bytes;
      const double copies = cost.h2d_ms(st.bytes) + (stale ? cost.d2h_ms(st.bytes) : 0);
      c.unhidden_ms = std::max(0.0, copies - inside);
      out.push_back(c);
    }
  }
  return out;
}

// Position p (of the step, or as the next step's, p + n) unrolled into the
// candidate's gap from position `from` until its copy back is issued, or -1.
std::int32_t in_gap(const GapCandidate& c, std::int32_t p, std::int32_t n, std::int32_t from) {
  for (const std::int32_t q : {p, p + n}) {
    if (from <= q && q < c.back) return q;
  }
  return -1;
}

// Whether the candidate keeps its storage off the device at position p (as
// far as the plan can tell before simulating it).
bool gap_holds_off(const GapCandidate& c, std::int32_t p, std::int32_t n) { return in_gap(c, p, n, c.gone) >= 0; }

// Bytes above the budget, summed over positions: what a step towards fitting lowers
// even where two positions share the peak.
double bytes_above(const ResidencyForecast& f, std::int64_t budget) {
  double sum = 0;
  for (std::int64_t live : f.live_bytes) sum += static_cast<double>(std::max<std::int64_t>(0, live - budget));
  return sum;
}

bool fits_budget(const ResidencyForecast& f, const ResidencyOptions& options) {
  return f.peak_bytes <= options.budget_bytes;
}

// The plan of the chosen candidates, each with its wait (HostGap::wait).
ResidencyPlan plan_with(const std::vector<GapCandidate>& all, const std::vector<bool>& chosen,
                        const std::vector<std::int32_t>& waits, const std::vector<std::int32_t>& host_updated) {
  ResidencyPlan plan;
  plan.host_updated = host_updated;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (!chosen[i]) continue;
    plan.gaps.push_back(all[i].gap);
    if (!waits.empty()) plan.gaps.back().wait = waits[i];
  }
  return plan;
}

std::string shown_bytes(std::int64_t bytes) {
  char text[32];
  if (bytes >= (1LL << 30)) {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1LL << 30));
  } else if (bytes >= (1 << 20)) {
    std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  } else {
    std::snprintf(text, sizeof text, "%.1f KiB", static_cast<double>(bytes) / (1 << 10));
  }
  return text;
}

// Copies back issued earlier where the plan waits for them: each gap's lead
// one op longer, else doubled, in turn, kept when the plan still fits and gets
// faster; rounds until nothing improves (at most 4, and 64 tries per gap in
// all).
void tune_leads(const ResidencySimulation& simulation, const ResidencyModel& model, const ResidencyOptions& options,
                ResidencyPlan& plan, ResidencyForecast& f) {
  const auto n = static_cast<std::int32_t>(model.op_ms.size());
  int budget = 64 * static_cast<int>(plan.gaps.size());
  for (int round = 0; round < 4 && f.stall_ms > 0 && budget > 0; ++round) {
    bool improved = false;
    for (HostGap& gap : plan.gaps) {
      if (budget-- <= 0) break;
      const ResidencyStorage& st = model.storages[gap.storage];
      const bool wrap = gap.after + 1 == static_cast<std::int32_t>(st.uses.size());
      const std::int32_t next = wrap ? st.uses.front() + n : st.uses[gap.after + 1];
      const std::int32_t widest = next - st.uses[gap.after] - 1 - gap.wait;
      if (gap.lead >= widest) continue;
      const std::int32_t was = gap.lead;
      for (const std::int32_t lead : {was + 1, std::min(widest, 2 * was)}) {
        if (lead <= was || lead > widest) continue;
        gap.lead = lead;
        const ResidencyForecast trial = simulation.simulate(plan);
        if (fits_budget(trial, options) && trial.step_ms < f.step_ms - 1e-9) {
          f = trial;
          improved = true;
          break;
        }
        gap.lead = was;
      }
    }
    if (!improved) break;
  }
}

}  // namespace

namespace {

// The plan for one set of host updates: `original` with them run on the host,
// its gaps chosen on the model they leave.
ResidencyResult plan_with_host_updates(const ResidencyModel& original, const std::vector<std::int32_t>& host,
                                       const ResidencyOptions& options, const CostModel& cost) {
  const ResidencySimulation simulation(original, host, cost);
  const ResidencyModel& model = simulation.model();  // as the host updates leave it
  const auto n = static_cast<std::int32_t>(model.op_ms.size());
  auto simulate = [&](const ResidencyPlan& plan) { return simulation.simulate(plan); };
  auto plan_with = [&](const std::vector<GapCandidate>& all, const std::vector<bool>& chosen,
                       const std::vector<std::int32_t>& waits = {}) {
    return spillway::plan_with(all, chosen, waits, host);
  };
  ResidencyResult result;
  ResidencyPlan bare;
  bare.host_updated = host;
  result.unplanned = simulate(bare);
  const std::vector<GapCandidate> all = gap_candidates(model, options, cost);
  result.candidates = static_cast<std::int32_t>(all.size());
  if (fits_budget(result.unplanned, options)) {
    result.plan = bare;
    result.forecast = result.unplanned;
    return result;
  }

  if (options.strategy == ResidencyStrategy::kExact) {
    if (static_cast<int>(all.size()) > options.exact_max_gaps) {
      throw InvalidArgument("residency", "the exact solver takes at most " +
                            std::to_string(options.exact_max_gaps) + " candidate gaps, this trace has " +
                            std::to_string(all.size()));
    }
    bool found = false;
    std::int64_t lowest = result.unplanned.peak_bytes;
    for (std::uint32_t mask = 1; mask < (1u << all.size()); ++mask) {
      std::vector<bool> chosen(all.size());
      for (std::size_t i = 0; i < all.size(); ++i) chosen[i] = (mask >> i) & 1u;
      const ResidencyPlan plan = plan_with(all, chosen);
      const ResidencyForecast f = simulate(plan);
      lowest = std::min(lowest, f.peak_bytes);
      if (!fits_budget(f, options)) continue;
      if (!found || f.step_ms < result.forecast.step_ms - 1e-12 ||
          (f.step_ms <= result.forecast.step_ms + 1e-12 && plan.gaps.size() < result.plan.gaps.size())) {
        found = true;
        result.plan = plan;
        result.forecast = f;
      }
    }
    if (!found) {
      throw InvalidArgument("residency", "no plan fits a budget of " + shown_bytes(options.budget_bytes) +
                            ": the smallest peak any plan reaches is " + shown_bytes(lowest));
    }
    return result;
  }

  // Everything that can leave the device at once. When even that does not fit and
  // some op alone needs more than the budget (what it uses, and its scratch, must be
  // on the device while it runs), say so now rather than search. Everything on the
  // host is not a lower bound (its copies queue behind one another and come back
  // early), so otherwise the search goes on, and its failure names both.
  const ResidencyForecast everything = simulate(plan_with(all, std::vector<bool>(all.size(), true)));
  const std::string everything_text =
      "with every candidate gap on the host the peak is still " + shown_bytes(everything.peak_bytes) + " at " +
      model.op_names[everything.peak_op] + " (" + std::to_string(all.size()) +
      " candidate gaps of storages of at least " + shown_bytes(options.min_bytes) + ")";
  if (!fits_budget(everything, options)) {
    std::vector<std::int64_t> needed(model.op_scratch.begin(), model.op_scratch.end());
    for (const ResidencyStorage& st : model.storages) {
      for (std::int32_t p : st.uses) needed[p] += st.bytes;
    }
    const auto most = std::max_element(needed.begin(), needed.end());
    if (most != needed.end() && *most > options.budget_bytes) {
      throw InvalidArgument("residency", "no plan fits a budget of " + shown_bytes(options.budget_bytes) + ": " +
                            everything_text + ", and " + model.op_names[most - needed.begin()] + " alone uses " +
                            shown_bytes(*most));
    }
  }
  std::vector<bool> chosen(all.size(), false);
  std::vector<std::int32_t> waits(all.size(), 0);
  std::vector<bool> banned(all.size(), false);  // dropped by a toggle: not taken again
  std::vector<std::size_t> order;  // chosen, in the order chosen
  auto choose = [&](std::size_t i) {
    if (!chosen[i]) order.push_back(i);
    chosen[i] = true;
  };
  ResidencyForecast f = result.unplanned;
  // Every round adds a gap, moves a wait earlier or bans a gap, so the search ends;
  // the cap only guards that reasoning.
  const std::size_t rounds = 8 * all.size() + 64;
  for (std::size_t round = 0; !fits_budget(f, options); ++round) {
    if (round == rounds) {
      throw InvalidArgument("residency", "no plan fits a budget of " + shown_bytes(options.budget_bytes) +
                            ": the greedy planner gave up after " + std::to_string(rounds) +
                            " rounds at a peak of " + shown_bytes(f.peak_bytes) + " at " +
                            model.op_names[f.peak_op]);
    }
    const std::int64_t excess = f.peak_bytes - options.budget_bytes;
    std::vector<std::size_t> covering;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (!chosen[i] && !banned[i] && gap_holds_off(all[i], f.peak_op, n)) covering.push_back(i);
    }
    if (!covering.empty()) {
      std::sort(covering.begin(), covering.end(), [&](std::size_t a, std::size_t b) {
        const GapCandidate& x = all[a];
        const GapCandidate& y = all[b];
        const bool hx = x.unhidden_ms <= 0;
        const bool hy = y.unhidden_ms <= 0;
        if (hx != hy) return hx;
        if (hx) return x.bytes > y.bytes;
        return x.unhidden_ms / static_cast<double>(x.bytes) < y.unhidden_ms / static_cast<double>(y.bytes);
      });
      std::int64_t left = excess;
      for (std::size_t i : covering) {
        choose(i);
        left -= all[i].bytes;
        if (left <= 0) break;
      }
      f = simulate(plan_with(all, chosen, waits));
      continue;
    }
    // Storages that should be off the device at the peak but whose write-backs have
    // not landed there (queued behind other copies): the compute stream waits for
    // them at the peak (HostGap::wait), those whose copies were issued first (they
    // land first) before the rest, those already chosen before new ones.
    std::vector<std::pair<std::size_t, std::int32_t>> late;  // candidate, unrolled peak position
    for (std::size_t i = 0; i < all.size(); ++i) {
      const GapCandidate& c = all[i];
      if (banned[i]) continue;
      const std::int32_t q = in_gap(c, f.peak_op, n, c.start + 1);  // before its copy back
      if (q < 0) continue;
      if (chosen[i] && !std::binary_search(f.in_flight_at_peak.begin(), f.in_flight_at_peak.end(),
                                           c.gap.storage)) {
        continue;  // gone there already
      }
      if (chosen[i] && waits[i] > 0 && c.start + waits[i] <= q) continue;  // waits only move earlier
      late.emplace_back(i, q);
    }
    if (!late.empty()) {
      std::sort(late.begin(), late.end(), [&](const auto& a, const auto& b) {
        if (chosen[a.first] != chosen[b.first]) return static_cast<bool>(chosen[a.first]);
        const GapCandidate& x = all[a.first];
        const GapCandidate& y = all[b.first];
        if (x.written != y.written) return x.written < y.written;
        return x.bytes > y.bytes;
      });
      std::int64_t left = excess;
      for (const auto& [i, q] : late) {
        choose(i);
        waits[i] = q - all[i].start;
        left -= all[i].bytes;
        if (left <= 0) break;
      }
      f = simulate(plan_with(all, chosen, waits));
      continue;
    }
    // Nothing left to take at the peak: try adding or dropping each gap around it,
    // keep the change that lowers the bytes above the budget (summed over positions)
    // most; a gap dropped so is not taken again.
    const std::int64_t budget = options.budget_bytes;
    std::size_t best = all.size();
    ResidencyForecast best_forecast;
    double best_excess = bytes_above(f, budget);
    // Only gaps around the peak can lower it: at most 64 of them, largest first.
    std::vector<std::size_t> near;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (!banned[i] && in_gap(all[i], f.peak_op, n, all[i].start + 1) >= 0) near.push_back(i);
    }
    std::sort(near.begin(), near.end(), [&](std::size_t a, std::size_t b) { return all[a].bytes > all[b].bytes; });
    if (near.size() > 64) near.resize(64);
    for (std::size_t i : near) {
      chosen[i] = !chosen[i];
      const ResidencyForecast trial = simulate(plan_with(all, chosen, waits));
      chosen[i] = !chosen[i];
      const double e = bytes_above(trial, budget);
      if (e < best_excess ||
          (best != all.size() && e == best_excess && trial.step_ms < best_forecast.step_ms)) {
        best = i;
        best_forecast = trial;
        best_excess = e;
      }
    }
    if (best == all.size()) {
      throw InvalidArgument("residency", "no plan fits a budget of " + shown_bytes(options.budget_bytes) +
                            ": " + everything_text + "; the greedy planner reached a peak of " +
                            shown_bytes(f.peak_bytes) + " at " + model.op_names[f.peak_op] +
                            ", and no gap left lowers what is above the budget");
    }
    if (chosen[best]) {
      chosen[best] = false;
      banned[best] = true;
      order.erase(std::find(order.begin(), order.end(), best));
    } else {
      choose(best);
    }
    f = best_forecast;
  }
  // Gaps whose storage never left the device (its write-back had not landed when its
  // copy back was issued) go, when the plan fits without them: their copies take the
  // link from the others' and pinned memory for nothing (the conservative duplex rule
  // may still time the step a little faster with them; the link does not).
  if (!f.never_left.empty()) {
    std::vector<bool> kept = chosen;
    for (const auto& [s, p] : f.never_left) {
      for (std::size_t i = 0; i < all.size(); ++i) {
        if (kept[i] && all[i].gap.storage == s && all[i].back % n == p) kept[i] = false;
      }
    }
    const ResidencyForecast pruned = simulate(plan_with(all, kept, waits));
    if (fits_budget(pruned, options)) {
      chosen = kept;
      order.erase(std::remove_if(order.begin(), order.end(), [&](std::size_t i) { return !chosen[i]; }),
                  order.end());
      f = pruned;
    }
  }
  // Drop chosen gaps, latest first, while the plan still fits and is no slower (a
  // peak covered by a later choice may not need an earlier one); else drop the wait.
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    chosen[*it] = false;
    const ResidencyForecast without = simulate(plan_with(all, chosen, waits));
    chosen[*it] = true;
    if (fits_budget(without, options) && without.step_ms <= f.step_ms + 1e-12) {
      chosen[*it] = false;
      f = without;
      continue;
    }
    if (waits[*it] == 0) continue;
    const std::int32_t wait = std::exchange(waits[*it], 0);
    const ResidencyForecast unwaited = simulate(plan_with(all, chosen, waits));
    if (fits_budget(unwaited, options) && unwaited.step_ms <= f.step_ms + 1e-12) {
      f = unwaited;
    } else {
      waits[*it] = wait;
    }
  }
  result.plan = plan_with(all, chosen, waits);
  if (options.tune_leads) tune_leads(simulation, model, options, result.plan, f);
  result.forecast = f;
  return result;
}

}  // namespace

ResidencyResult plan_residency(const ResidencyModel& model, const ResidencyOptions& options,
                               const CostModel& cost) {
  if (options.budget_bytes <= 0) {
    throw InvalidArgument("residency", "budget must be > 0 bytes, got " +
                          std::to_string(options.budget_bytes));
  }
  if (options.prefetch_slack < 1.0) {
    throw InvalidArgument("residency", "prefetch_slack must be >= 1, got " +
                          std::to_string(options.prefetch_slack));
  }
  // A budget the step already fits changes nothing, host updates included.
  const ResidencyForecast unplanned = simulate_residency(model, {}, cost);
  // The host updates in the order they can start: their gradients complete earliest
  // first (the last layers', in backward), so the update overlaps the most of the step.
  std::vector<std::int32_t> every(model.host_updates.size());
  std::vector<std::int32_t> ready(model.host_updates.size(), 0);
  for (std::size_t k = 0; k < every.size(); ++k) {
    every[k] = static_cast<std::int32_t>(k);
    const HostUpdate& u = model.host_updates[k];
    for (const std::int32_t g : u.grads) ready[k] = std::max(ready[k], gradient_complete_position(model, u, g));
  }
  std::stable_sort(every.begin(), every.end(), [&](std::int32_t a, std::int32_t b) { return ready[a] < ready[b]; });
  std::vector<std::vector<std::int32_t>> choices;
  using Mode = ResidencyOptions::HostUpdates;
  if (options.host_updates != Mode::kAll || every.empty()) choices.push_back({});
  if (options.host_updates != Mode::kNone && !every.empty() && !fits_budget(unplanned, options)) {
    // kFastest: the first eighth, quarter, half, three quarters and all of them.
    const std::size_t n = every.size();
    std::set<std::size_t> counts{n};
    if (options.host_updates == Mode::kFastest) {
      for (const std::size_t part : {n / 8, n / 4, n / 2, 3 * n / 4}) {
        if (part > 0) counts.insert(part);
      }
    }
    for (const std::size_t count : counts) {
      std::vector<std::int32_t> chosen(every.begin(), every.begin() + static_cast<std::ptrdiff_t>(count));
      std::sort(chosen.begin(), chosen.end());
      choices.push_back(std::move(chosen));
    }
  }
  // Each choice is planned on its own thread (the simulator is pure): on T3's step a
  // choice takes tens of seconds. The results are taken in the choices' order, so the
  // answer is the one a single thread gives.
  std::vector<std::future<ResidencyResult>> planned;
  planned.reserve(choices.size());
  for (const auto& host : choices) {
    planned.push_back(std::async(std::launch::async, [&model, &host, &options, &cost] {
      return plan_with_host_updates(model, host, options, cost);
    }));
  }
  std::optional<ResidencyResult> best;
  std::optional<InvalidArgument> refused;
  for (auto& future : planned) {
    try {
      ResidencyResult r = future.get();
      if (!best || r.forecast.step_ms < best->forecast.step_ms - 1e-9) best = std::move(r);
    } catch (const InvalidArgument& e) {
      refused = e;  // the last choice's (with host updates, the lower peak) is the one to report
    }
  }
  if (!best) throw *refused;
  best->unplanned = unplanned;
  return *best;
}

}  // namespace spillway
