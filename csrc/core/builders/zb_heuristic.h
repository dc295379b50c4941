// The Zero Bubble paper's own greedy scheduler (Qi et al. 2023, section 3.1: the initial
// solution its ILP starts from), one of zb_auto's candidate generators next to the list
// scheduler's grid. It builds one stage per rank microbatch by microbatch: a timed warm-up of
// forwards, then per microbatch one F and one I on every stage, with W placed into the gaps the
// dependencies leave (or to make room for an F) and the rest drained at the end.
#pragma once

#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/program.h"
#include "list_scheduler.h"

namespace zbpipe::detail {

// The heuristic's three binary knobs.
struct ZbHeuristicKnobs {
  // Warm-up: an extra forward must end before the first backward's input arrives (the rank
  // may idle until then); false: it need only start before, and may delay that backward.
  bool idle_before_first_backward = true;
  // Steady state: a stage already two forwards ahead of the next one skips its forward when it
  // would keep the next stage waiting for its backward longer than the bubble allows.
  bool prioritize_backward = true;
  // Before an F or I whose input is still on its way, the W that fit in the gap run; a gap left
  // shorter than the next W gets that W too (its overrun delays the F or I) when the gap is more
  // than this stage's idle time may grow (the most any stage has idled, minus its own), and,
  // with this knob, also when it is not.
  bool fill_short_gaps = true;
};

// Fills `p.ranks` (one stage per rank, loop topology, compute only, I/W split) with the
// heuristic's order under `knobs`; every rank stays within cap[r] (memory_model.h). Returns
// the simulator's numbers for it (the heuristic times each action as zbpipe::simulate does),
// or complete=false, leaving `p.ranks` unspecified, when a forward finds no room and no W left
// to free it (caps below one microbatch per stage, or knobs that strand the order).
ListRunResult zb_heuristic_order(Program& p, const CostModel& costs, const MemoryModel& memory,
                                 const std::vector<double>& cap, const ZbHeuristicKnobs& knobs);

// The heuristic's distinct orders over its 8 knob settings (in the paper's order of trying
// them: every knob true first), each a candidate seed with its timing.
std::vector<Seed> zb_heuristic_candidates(const Program& shell, const CostModel& costs,
                                          const MemoryModel& memory,
                                          const std::vector<double>& cap);

}  // namespace zbpipe::detail
