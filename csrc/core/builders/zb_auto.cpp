// zb_auto: the Zero Bubble paper's automatic scheduling (Qi et al. 2023, section 3.1) without
// the ILP refinement. Given per-stage T_F, T_B (= I), T_W, T_comm and a per-rank activation cap
// M_limit (in microbatches; default p, 1F1B's peak), a greedy list scheduler builds one
// candidate per hyper-parameter setting and the simulator's numbers pick among them (the search
// skips the work that cannot change the pick, see search_list_schedules):
//   - warm-up depth: the units a rank may hold before its first I: M_limit, 1F1B's p-r, or
//     ZB-H2's 2(p-r)-1 (each clipped to M_limit);
//   - when a rank idles, fill the gap with a W if gap >= k * T_W, k in {0, 1/2, 1, never}
//     (any gap before stage 0's I, whose delay costs nobody else);
//   - whether an F may delay a backward that is about to become ready (the paper's binary knob);
//   - I-first, F-first or alternating when both are ready; W before I when memory-bound.
// The hand-made ZB-H1, ZB-H2 and 1F1B (B split into I + W) orders join the pool when they fit
// the cap. The pick matches or beats ZB-H1 and ZB-H2 on both makespan and bubble whenever some
// candidate does, and always the one the cap is meant for: ZB-H2 when memory_cap >= 2p-1, else
// ZB-H1 (when it fits, i.e. memory_cap >= p); see search_list_schedules. One stage per rank,
// I/W split; peak activations never exceed M_limit on any rank.
#include <algorithm>

#include "list_scheduler.h"
#include "zbpipe/builders.h"
#include "zbpipe/error.h"

namespace zbpipe {

namespace {

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
// one that rejects (pp, m) is left out): the primary one is ZB-H2 when the cap allows its 2p-1,
// else ZB-H1. 1F1B is one more candidate.
std::vector<detail::Seed> seed_programs(const BuildArgs& a, int cap) {
  using Role = detail::Seed::Role;
  BuildArgs plain;
  plain.pp = a.pp;
  plain.microbatches = a.microbatches;
  const bool h2_fits = cap >= 2 * a.pp - 1;
  std::vector<detail::Seed> seeds;
  auto add = [&](Program (*build)(const BuildArgs&), Role role) {
    try {
      seeds.push_back({build(plain), role});
    } catch (const ScheduleError&) {
    }
  };
  add(build_zb_h1, h2_fits ? Role::kReference : Role::kPrimary);
  add(build_zb_h2, h2_fits ? Role::kPrimary : Role::kReference);
  seeds.push_back({split_backwards(build_1f1b(plain)), Role::kCandidate});
  return seeds;
}

}  // namespace

Program build_zb_auto(const BuildArgs& a) {
  check_basic_args("zb_auto", a);
  const int spr = resolve_stages_per_rank("zb_auto", a, 1, 1, 1);
  ZB_SCHEDULE_CHECK(a.memory_cap >= 0,
                    "zb_auto: memory_cap must be >= 1 microbatch (0 = pp), got memory_cap=",
                    a.memory_cap);
  Program p = make_program("zb_auto", a, spr, "loop");
  a.costs.check(p.num_stages);
  const int cap = a.memory_cap == 0 ? a.pp : a.memory_cap;
  std::vector<std::vector<int>> warmups(3, std::vector<int>(a.pp));
  for (int r = 0; r < a.pp; ++r) {
    warmups[0][r] = cap;
    warmups[1][r] = std::min(cap, a.pp - r);
    warmups[2][r] = std::min(cap, 2 * (a.pp - r) - 1);
  }
  std::sort(warmups.begin(), warmups.end());
  warmups.erase(std::unique(warmups.begin(), warmups.end()), warmups.end());
  Program best = detail::search_list_schedules(p, a.costs, std::vector<int>(a.pp, cap),
                                               detail::PolicyGrid::standard(warmups, false),
                                               seed_programs(a, cap),
                                               {a.exhaustive_search, a.search_threads});
  best.schedule = "zb_auto";
  return best;
}

}  // namespace zbpipe
