// V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): V topology, 2 stages
// (chunks) per rank, I/W split, peak activations about half of 1F1B's for a bubble of ~p/(2m).
// Units: the simulator counts (stage, microbatch); a V chunk holds half a 1F1B stage's
// activations, so 1F1B's peak p is 2p units here and the paper's bound ceil((p+1)/2) 1F1B
// microbatches, (p+2)//2, is 2*((p+2)//2) units. The order inside that cap comes from the
// shared list scheduler (not the paper's hand-placed building block).
#include "list_scheduler.h"

namespace zbpipe {

Program build_v_half(const BuildArgs& a) {
  return detail::build_capped_v("v_half", a, 2 * ((a.pp + 2) / 2));
}

}  // namespace zbpipe
