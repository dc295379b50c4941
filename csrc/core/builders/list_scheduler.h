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

// A fixed schedule's compute-only program offered to the search, and how much it binds it.
struct Seed {
  enum class Role { kCandidate, kReference, kPrimary };
  Program program;
  Role role = Role::kCandidate;
};

// Runs list_schedule for every policy in the grid and every warm-up vector given, scores each
// candidate with zbpipe::simulate and returns the best. Seeds that fit the cap (on the same
// topology) are candidates too. The pick matches or beats, on both makespan and longest span
// (bubble rate is monotone in it), every fitting reference if some candidate does; failing
// that, the primary one (at most one; it is a candidate itself, so this always holds when it
// fits). Within that pool: lowest worst ratio to any reference on either metric, then makespan,
// bubble rate and total peak activations. Makespan and span can disagree (a schedule may end
// later on the last rank yet keep every rank's span shorter), which is why both are compared.
Program search_list_schedules(const Program& shell, const CostModel& costs,
                              const std::vector<int>& cap,
                              const std::vector<std::vector<int>>& warmups,
                              const std::vector<Seed>& seeds);

}  // namespace zbpipe::detail
