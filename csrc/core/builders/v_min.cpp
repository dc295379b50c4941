// V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): V topology, 2 stages
// (chunks) per rank, I/W split, peak activations about a third of 1F1B's for a bubble of
// ~2p/(3m). Units as in v_half.cpp: one (stage, microbatch) = half a 1F1B stage's activations;
// the paper's bound (p+4)//3 1F1B microbatches is 2*((p+4)//3) units. The order inside that cap
// comes from the shared list scheduler (not the paper's hand-placed building block).
#include "list_scheduler.h"

namespace zbpipe {

Program build_v_min(const BuildArgs& a) {
  return detail::build_capped_v("v_min", a, 2 * ((a.pp + 4) / 3));
}

}  // namespace zbpipe
