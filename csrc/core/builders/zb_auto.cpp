// zb_auto: the Zero Bubble paper's automatic scheduling (Qi et al. 2023, section 3.1) without
// the ILP refinement. Given per-stage T_F, T_B (= I), T_W, T_comm, the memory deltas of
// memory_model.h and a per-rank memory cap M_limit (in mem_f's units; default p * mem_f,
// 1F1B's peak), two generators offer candidates and the simulator's numbers pick among them:
// the paper's own greedy heuristic (zb_heuristic.h) under each of its 8 knob settings, and a
// greedy list scheduler, one candidate per hyper-parameter setting (the search skips the work
// that cannot change the pick, see search_list_schedules):
//   - warm-up depth: the forwards a rank may hold before its first I: all M_limit holds,
//     1F1B's p-r, or ZB-H2's 2(p-r)-1 (each clipped to what M_limit holds);
//   - when a rank idles, fill the gap with a W if gap >= k * T_W, k in {0, 1/2, 1, never}
//     (any gap before stage 0's I, whose delay costs nobody else);
//   - whether an F may delay a backward that is about to become ready (the paper's binary knob);
//   - I-first, F-first or alternating when both are ready; W before I when memory-bound.
// The hand-made ZB-H1, ZB-H2 and 1F1B (B split into I + W) orders join the pool when they fit
// the cap. The pick minimizes the longest rank span (the paper's measure: its bubble rate),
// then the makespan, and matches or beats ZB-H1 and ZB-H2 on the bubble whenever some candidate
// does, and always the one the cap is meant for: ZB-H2 when it fits M_limit, else ZB-H1 (when
// it fits, e.g. M_limit >= p * mem_f); see search_list_schedules. The makespan can end above
// theirs (the paper's own picks do, by a fraction of a percent). One stage per rank, I/W split;
// peak memory never exceeds M_limit on any rank.
#include <algorithm>
#include <cmath>

#include "list_scheduler.h"
#include "zb_heuristic.h"
#include "zbpipe/builders.h"
#include "zbpipe/error.h"
#include "zbpipe/refine.h"
#include "zbpipe/span_bound.h"

namespace zbpipe {

namespace {

// Actions the refinement may time (refine.h): about 5 ms on a 2-CPU machine at pp=32, m=128,
// where the search takes the rest of the 50 ms budget; small pipelines converge long before.
constexpr long kZbAutoRefineBudget = 300'000;

// 1F1B's order with each B as I then W: the same timing, in zb_auto's I/W vocabulary.
Program split_backwards(Program p) {
  for (auto& acts : p.ranks) {
    std::vector<Action> out;
    for (const Action& a : acts) {
      if (a.kind != Kind::B) {
        out.push_back(a);
        continue;
      }
      out.emplace_back(a.stage, Kind::I, a.microbatch);
      out.emplace_back(a.stage, Kind::W, a.microbatch);
    }
    acts = std::move(out);
  }
  return p;
}

// ZB-H1 and ZB-H2 are the references zb_auto must not lose to (each only where it fits the cap;
// one that rejects (pp, m) is left out): the primary one is ZB-H2 when it fits the cap, else
// ZB-H1 (the last fitting seed marked primary). 1F1B and the paper heuristic's distinct orders
// are more candidates.
std::vector<detail::Seed> seed_programs(const BuildArgs& a, const Program& shell,
                                        const std::vector<double>& cap) {
  using Role = detail::Seed::Role;
  BuildArgs plain;
  plain.pp = a.pp;
  plain.microbatches = a.microbatches;
  std::vector<detail::Seed> seeds;
  for (Program (*build)(const BuildArgs&) : {build_zb_h1, build_zb_h2}) {
    try {
      seeds.push_back({build(plain), Role::kPrimary});
    } catch (const ScheduleError&) {
    }
  }
  seeds.push_back({split_backwards(build_1f1b(plain)), Role::kCandidate});
  for (detail::Seed& seed : detail::zb_heuristic_candidates(shell, a.costs, a.memory, cap))
    seeds.push_back(std::move(seed));
  return seeds;
}

}  // namespace

Program build_zb_auto(const BuildArgs& a) {
  check_basic_args("zb_auto", a);
  const int spr = resolve_stages_per_rank("zb_auto", a, 1, 1, 1);
  ZB_SCHEDULE_CHECK(a.memory_cap >= 0.0,
                    "zb_auto: memory_cap must hold at least one microbatch (0 = pp * mem_f), got "
                    "memory_cap=", a.memory_cap);
  Program p = make_program("zb_auto", a, spr, "loop");
  a.costs.check(p.num_stages, p.microbatches, p.pp);
  a.memory.check(p.num_stages);
  std::vector<double> cap(a.pp);
  std::vector<std::vector<int>> warmups(3, std::vector<int>(a.pp));
  for (int r = 0; r < a.pp; ++r) {
    const double mem_f = a.memory.forward(r);
    cap[r] = a.memory_cap == 0.0 ? a.pp * mem_f : a.memory_cap;
    ZB_SCHEDULE_CHECK(within_cap(mem_f, cap[r]), "zb_auto: memory_cap=", cap[r],
                      " must hold at least one microbatch of stage ", r, " (mem_f=", mem_f, ")");
    // Nothing is freed before a rank's first I: the cap holds this many forwards until then.
    // A rank never holds more than its m forwards, so any depth >= m warms up alike; above
    // depth_cap (>= m, and above the two depths below, so the warm-up vectors keep their order
    // and distinctness) the count stops: an infinite or huge cap is no cap, found at once.
    const int depth_cap = std::max(a.microbatches, 2 * a.pp);
    const double ratio = cap[r] / mem_f;
    int held = depth_cap;
    if (ratio < depth_cap + 2.0) {
      held = std::max(1, static_cast<int>(ratio) - 1);
      while (held < depth_cap && within_cap((held + 1) * mem_f, cap[r])) ++held;
    }
    warmups[0][r] = held;
    warmups[1][r] = std::min(held, a.pp - r);
    warmups[2][r] = std::min(held, 2 * (a.pp - r) - 1);
  }
  std::sort(warmups.begin(), warmups.end());
  warmups.erase(std::unique(warmups.begin(), warmups.end()), warmups.end());
  // No order's longest span is below this: the search and the refinement stop there.
  const double floor = span_lower_bound(p, a.costs, a.memory, cap).max_span;
  Program best = detail::search_list_schedules(p, a.costs, a.memory, cap,
                                               detail::PolicyGrid::standard(warmups, false),
                                               seed_programs(a, p, cap),
                                               {a.exhaustive_search, a.search_threads,
                                                Objective::kSpan, floor});
  best.schedule = "zb_auto";
  if (!a.refine) return best;
  RefineOptions refine;
  refine.objective = Objective::kSpan;
  refine.budget = kZbAutoRefineBudget;
  refine.target = floor;
  return refine_order(best, a.costs, a.memory, cap, refine);
}

}  // namespace zbpipe
