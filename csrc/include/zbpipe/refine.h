// The refinement pass: a bounded local search over the per-rank orders of a compute-only
// program, with the simulator's timing as the oracle, run after a heuristic (zb_auto's pick).
//
// A move takes one action and moves it earlier on its rank. Ranks are visited longest span (or
// latest end) first, and their idle gaps largest first; for a gap: the first later action of
// some (stage, kind) moves into it, or the action after it moves a few places earlier (what ran
// before it then fills the gap behind it), or that action's producer on another rank moves a
// few places earlier there, so that the gap's input arrives sooner. A move is kept only when the
// program stays valid (each stage's F,
// I and W keep their microbatch order, every dependency holds, nothing deadlocks) and within
// the memory cap under the memory model, and when it lowers the objective's figure (longest
// span or makespan), or keeps it and lowers the sum of that figure over the ranks, without
// raising the other figure above the input's. The search stops when no move helps, when the
// figure reaches `target` (a lower bound: nothing can do better), or when it has timed
// `budget` actions in all; the result does not depend on time or threads.
#pragma once

#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/program.h"
#include "zbpipe/simulator.h"

namespace zbpipe {

struct RefineOptions {
  Objective objective = Objective::kSpan;
  // Actions timed in all, summed over the candidate programs tried (a program of N actions
  // costs N per try): bounds the work whatever the size.
  long budget = 1'000'000;
  // Stop once the objective's figure is at or below this (e.g. span_lower_bound's max_span).
  double target = 0.0;
};

// Returns `compute_only` with its per-rank orders refined: the same topology and actions, no
// worse than the input on either makespan or longest span, within cap (one value per rank)
// under `memory`. A program with OVERLAP_F_B actions, or one that already breaks the cap, comes
// back unchanged. Throws ScheduleError on a lowered program or on costs, memory or caps that do
// not fit it.
Program refine_order(const Program& compute_only, const CostModel& costs,
                     const MemoryModel& memory, const std::vector<double>& cap,
                     const RefineOptions& options = {});

}  // namespace zbpipe
