// Greedy list scheduler shared by the cost-driven builders (zb_auto, v_half, v_min): it plays
// the pipeline forward in time under the simulator's cost model and, whenever a rank is free,
// picks its next F / I / W by a small policy, never exceeding a per-rank activation cap.
#pragma once

#include <limits>
#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/program.h"

namespace zbpipe::detail {

// The hyper-parameters of the Zero Bubble paper's heuristic (Qi et al. 2023, section 3.1),
// one value each; search_list_schedules() tries a small grid of them.
struct ListPolicy {
  enum class Order { kBackwardFirst, kForwardFirst, kAlternate };
  // When both an I and an F are ready: which goes first (kAlternate: not the kind run last).
  Order order = Order::kBackwardFirst;
  // An idle gap is filled with a W when gap >= fill_ratio * T_W; a negative value never fills
  // (W then runs only to free memory, or once the rank has nothing else left).
  double fill_ratio = 1.0;
  // The paper's binary warm-up knob: do not start an F that would delay a backward whose input
  // arrives before that F could end; idle (or fill with a W) instead.
  bool avoid_delaying_backward = false;
  // When a forward is held back only by the memory cap, run a W first even if an I is ready
  // (I frees nothing; with this, a full rank behaves like 1F1B, whose B is I + W).
  bool recycle_first = false;
  // With several stages per rank: among ready forwards prefer the later stage (depth first).
  bool deep_first = true;
};

// Activation accounting is the simulator's: one unit per (stage, microbatch) from F start to
// W end; every rank stays within cap[r] units. With 2 stages per rank (V), a microbatch enters a
// rank only if it leaves room for one more F: the later-stage F that the oldest admitted
// microbatch still owes runs first (stages run F in microbatch order), that microbatch then needs
// no more memory to finish its backward and W, so a full rank never deadlocks. 1 or 2 stages per
// rank, cap[r] >= stages per rank. warmup[r] additionally bounds the units held before a
// microbatch enters a rank that has not run its first backward yet (the warm-up depth). Fills
// `p.ranks` (compute-only, I/W split); `p` comes with its topology and empty rank lists.
void list_schedule(Program& p, const CostModel& costs, const std::vector<int>& cap,
                   const std::vector<int>& warmup, const ListPolicy& policy);

// A fixed schedule's compute-only program offered to the search; a reference is one the pick
// must match or beat (when some candidate does).
struct Seed {
  Program program;
  bool reference = false;
};

// Runs list_schedule for every policy in the grid and every warm-up vector given, scores each
// candidate with zbpipe::simulate and returns the best. `seeds` (on the same topology) are
// candidates too when they fit the cap, and so are references then: candidates are ranked by
// their worst ratio to any fitting reference on makespan or longest span
// (anything matching or beating every reference ties at 1), then by makespan, bubble rate and
// total peak activations. Makespan and span can disagree (a schedule may end later on the last
// rank yet keep every rank's span shorter), which is why both are compared.
Program search_list_schedules(const Program& shell, const CostModel& costs,
                              const std::vector<int>& cap,
                              const std::vector<std::vector<int>>& warmups,
                              const std::vector<Seed>& seeds);

}  // namespace zbpipe::detail
