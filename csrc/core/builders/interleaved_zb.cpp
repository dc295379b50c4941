// Interleaved zero bubble, ZB1P (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3;
// PyTorch ScheduleInterleavedZeroBubble): the interleaved 1F1B order with backward split into I
// (input gradient, on the critical path) and W (weight gradient, deferred to fill bubbles).
// v >= 2 stages per rank, loop topology, PyTorch's flexible rounds (m a multiple of
// max(1, m / p)). Rank r: warm-up w_r = min((v-1)*per_round + (p-1-r), v*m) forwards (one per
// hop where interleaved 1F1B has two), then F + I per step with one W per step once r W's are
// pending, then the cool-down I's (each followed by a W under the same rule), then the last r
// W's. In flight: w_r + 1 forwards plus r pending W's, so every rank peaks at
// min((v-1)*per_round + p, v*m) (stage, microbatch) units, the same on all ranks.
// PyTorch only pads this order with idle slots (_add_bubbles_to_actions); the order is the same.
#include <algorithm>

#include "interleaved_rank_ops.h"
#include "zbpipe/builders.h"
#include "zbpipe/error.h"

namespace zbpipe {

Program build_interleaved_zb(const BuildArgs& a) {
  check_basic_args("interleaved_zb", a);
  const int v = resolve_stages_per_rank("interleaved_zb", a, 0, 2, 2);
  // PyTorch's rule, kept on purpose: forwards and backwards walk the local stages in blocks of
  // m / rounds microbatches, so a remainder would give some stage more than m forwards. Lifting
  // it needs a different block layout, and so a different order from PyTorch's.
  const int rounds = std::max(1, a.microbatches / a.pp);
  ZB_SCHEDULE_CHECK(a.microbatches % rounds == 0, "interleaved_zb needs microbatches to be a "
                    "multiple of the rounds max(1, microbatches / pp) = ", rounds,
                    ", got microbatches=", a.microbatches, ", pp=", a.pp);
  Program p = make_program("interleaved_zb", a, v, "loop");
  const auto shape = detail::interleaved_shape(a.pp, v, a.microbatches);
  for (int r = 0; r < a.pp; ++r) {
    const int warmup = std::min((v - 1) * shape.per_round + (a.pp - 1 - r), v * a.microbatches);
    detail::interleaved_rank_ops(shape, r, warmup, /*zero_bubble=*/true, p.ranks[r]);
  }
  return p;
}

}  // namespace zbpipe
