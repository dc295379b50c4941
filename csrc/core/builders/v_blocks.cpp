// Lays a V building block out over the microbatches (see v_blocks.h).
#include "v_blocks.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <utility>

#include "list_scheduler.h"
#include "v_post_passes.h"
#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"
#include "zbpipe/error.h"
#include "zbpipe/refine.h"
#include "zbpipe/span_bound.h"

namespace zbpipe::detail {

namespace {

// Actions the refinement may time (refine.h), on programs of up to kFullRefineActions
// actions: about 15 ms on a 2-CPU machine. 1M takes V-Half at p=8, m=24 (1.5B costs) from the
// reference's 0.1702 to 0.1687 (3M: 0.1671, at 45 ms of its own).
constexpr long kVRefineBudget = 1'000'000;

// Larger programs get kVRefineBudget * kFullRefineActions / actions, so that the refinement's
// time (about proportional to its budget) falls while the search's grows: at p=32, m=128
// (24576 actions) a third, about 5 ms, which keeps compile under issue #20's 50 ms there. The
// full budget kept no move on either V schedule under the 1.5B or 28.3B costs from p=16, m=64
// up; over 104 programs above this size (p 8..32, those costs and jittered ones) the cut
// changed none. See docs/benchmarks.md#compile-time-of-the-searched-schedules.
constexpr long kFullRefineActions = 8192;

long refine_budget(const Program& p) {
  long actions = 0;
  for (const auto& rank : p.ranks) actions += static_cast<long>(rank.size());
  if (actions <= kFullRefineActions) return kVRefineBudget;
  return kVRefineBudget * kFullRefineActions / actions;
}

// One rank's compute order: the block's passes at their slots, each free slot taking the oldest
// pending W (the paper's W placement), the W left over drained at the end.
std::vector<Action> lay_out_rank(const VBlock& blk, int s0, int s1, int m) {
  // Phase 1: F and I passes at slot + 6k (an empty Action: a free slot).
  const std::pair<int, Action> passes[] = {{blk.f_chunk0, {s0, Kind::F, 0}},
                                           {blk.f_chunk1, {s1, Kind::F, 0}},
                                           {blk.i_chunk1, {s1, Kind::I, 0}},
                                           {blk.i_chunk0, {s0, Kind::I, 0}}};
  int last = 0;
  for (const auto& pass : passes) last = std::max(last, pass.first + kSlotsPerMicrobatch * (m - 1));
  std::vector<Action> slots(last + 1);
  for (int k = 0; k < m; ++k, poll_cancel())
    for (const auto& [slot, pass] : passes) {
      Action& at = slots[slot + kSlotsPerMicrobatch * k];
      ZB_CHECK(at.stage < 0, "V block puts two passes in slot ", slot + kSlotsPerMicrobatch * k);
      at = Action(pass.stage, pass.kind, k);
    }
  // Phase 2: walk the slots; an empty one runs the oldest pending W.
  std::vector<Action> out;
  out.reserve(static_cast<size_t>(kSlotsPerMicrobatch) * m);
  std::deque<Action> pending_w;
  for (const Action& at : slots) {
    if (at.stage >= 0) {
      out.push_back(at);
      if (at.kind == Kind::I) pending_w.emplace_back(at.stage, Kind::W, at.microbatch);
    } else if (!pending_w.empty()) {
      out.push_back(pending_w.front());
      pending_w.pop_front();
    }
  }
  // Phase 3: the W still pending.
  out.insert(out.end(), pending_w.begin(), pending_w.end());
  return out;
}

}  // namespace

Program build_v_from_blocks(const std::string& name, const BuildArgs& a,
                            const std::vector<VBlock>& blocks, int cap_units) {
  check_basic_args(name, a);
  const int spr = resolve_stages_per_rank(name, a, 2, 2, 2);
  Program shell = make_program(name, a, spr, "v");
  a.costs.check(shell.num_stages, shell.microbatches, shell.pp);
  a.memory.check(shell.num_stages);
  // The paper's cap: cap_units / 2 microbatches of both of a rank's stages, in mem_f's units.
  // Any other memory_cap (one number for every rank, in mem_f's units) is searched under: the
  // block layouts then seed the search only where they fit it.
  std::vector<double> one_each(a.pp);  // one microbatch of both of a rank's stages
  for (int r = 0; r < a.pp; ++r) one_each[r] = a.memory.forward(r) + a.memory.forward(2 * a.pp - 1 - r);
  bool paper_cap = true;  // memory_cap 0, or the paper's cap on every rank
  for (int r = 0; r < a.pp && a.memory_cap != 0.0; ++r) {
    const double paper = cap_units / 2 * one_each[r];
    paper_cap = paper_cap && std::abs(a.memory_cap - paper) <= 1e-9 * paper;
  }
  std::vector<double> cap(a.pp);
  for (int r = 0; r < a.pp; ++r) {
    cap[r] = paper_cap ? cap_units / 2 * one_each[r] : a.memory_cap;
    ZB_SCHEDULE_CHECK(cap[r] >= one_each[r] * (1 - 1e-12), name, " needs memory_cap >= ", one_each[r],
                      " on rank ", r, " (one microbatch of both its stages, in mem_f's units), got ",
                      a.memory_cap);
  }
  ZB_CHECK(static_cast<int>(blocks.size()) == a.pp, "one V block per rank");
  Program laid_out = shell;
  for (int r = 0; r < a.pp; ++r)
    laid_out.ranks[r] = lay_out_rank(blocks[r], r, 2 * a.pp - 1 - r, a.microbatches);
  // Two seeds: the block as laid out, and the block after the paper's post-passes, which never
  // raise a rank above the laid-out block's highest peak of (stage, microbatch) units
  // (v_post_passes.h). Both hold the cap by construction when a rank's two stages hold the
  // same mem_f (a unit then holds at most mem_f); the search's simulation confirms it. The
  // post-passed one is primary; the laid-out one stays a reference, so the pick is never
  // behind it on makespan or span when some candidate matches both.
  bool even = paper_cap;
  for (int r = 0; r < a.pp; ++r)
    even = even && a.memory.forward(r) == a.memory.forward(2 * a.pp - 1 - r);
  // Warm-up depth in (stage, microbatch) units: the paper's, and under another cap also what
  // the cap holds in microbatches of both stages (the cap itself binds during the run).
  std::vector<std::vector<int>> warmups{std::vector<int>(a.pp, cap_units)};
  if (!paper_cap) {
    std::vector<int> held(a.pp);
    for (int r = 0; r < a.pp; ++r)
      // In double first: an infinite or huge cap holds all 2m units, no int overflow.
      held[r] = static_cast<int>(std::min(2.0 * a.microbatches, 2 * std::floor(cap[r] / one_each[r] * (1 + 1e-12))));
    if (held != warmups[0]) warmups.push_back(held);
  }
  Program reordered = shell;
  reordered.ranks = reorder_v_block(blocks, a.microbatches);
  std::vector<Seed> seeds;
  seeds.push_back({std::move(reordered), Seed::Role::kPrimary, /*must_fit=*/even});
  seeds.push_back({std::move(laid_out), Seed::Role::kReference, /*must_fit=*/even});
  // Under a cap of the caller's (ScheduleAuto and plan_partition budget zbv's own peak), ZB-V's
  // order is a candidate too: on uneven measured costs the blocks' search can land above it,
  // and a program planned under a budget zbv fits should never be behind zbv.
  if (!paper_cap) seeds.push_back({build_zbv(a), Seed::Role::kCandidate, /*must_fit=*/false});
  Program best = search_list_schedules(
      shell, a.costs, a.memory, cap, PolicyGrid::standard(warmups, true),
      seeds, {a.exhaustive_search, a.search_threads});
  best.schedule = name;
  if (!a.refine) return best;
  // The search picks by makespan; the refinement lowers the longest span (the bubble rate the
  // papers report) without raising the makespan, within the same cap.
  RefineOptions refine;
  refine.objective = Objective::kSpan;
  refine.budget = refine_budget(best);
  refine.target = span_lower_bound(shell, a.costs, a.memory, cap).max_span;
  return refine_order(best, a.costs, a.memory, cap, refine);
}

}  // namespace zbpipe::detail
