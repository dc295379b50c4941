// Interleaved zero bubble, ZB1P (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3;
// PyTorch ScheduleInterleavedZeroBubble): the interleaved 1F1B order with backward split into I
// (input gradient, on the critical path) and W (weight gradient, deferred to fill bubbles).
// v >= 1 stages per rank (v = 1 as PyTorch runs it), loop topology, PyTorch's flexible rounds
// (m a multiple of max(1, m / p)). Rank r: warm-up w_r = min((v-1)*per_round + (p-1-r), v*m)
// forwards (one per hop where interleaved 1F1B has two), then F + I per step with one W per
// step once r W's are pending, then the cool-down I's (each followed by a W under the same
// rule), then the last r W's. In flight: w_r + 1 forwards plus r pending W's, so every rank peaks at
// min((v-1)*per_round + p, v*m) (stage, microbatch) units, the same on all ranks.
// PyTorch only pads this order with idle slots (_add_bubbles_to_actions); the order is the same.
#include "interleaved_rank_ops.h"

namespace zbpipe {

Program build_interleaved_zb(const BuildArgs& a) {
  return detail::build_interleaved("interleaved_zb", a, /*zero_bubble=*/true);
}

}  // namespace zbpipe
