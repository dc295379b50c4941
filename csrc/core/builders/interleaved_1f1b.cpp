// Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
// Clusters", section 2.2; PyTorch ScheduleInterleaved1F1B): v >= 2 stages per rank on the loop
// topology, depth first. Forwards and backwards move through the local stages in blocks of
// `per_round` microbatches (PyTorch's flexible rounds: max(1, m / p) rounds, so m need not be a
// multiple of p, only of the round count).
// Rank r: warm-up w_r = min((v-1)*per_round + 2*(p-1-r), v*m) forwards, then one forward and
// one full backward per step, then w_r backwards. Rank r peaks at min(w_r + 1, v*m)
// (stage, microbatch) units; bubble about 1/v of 1F1B's at equal costs.
#include <algorithm>

#include "interleaved_rank_ops.h"
#include "zbpipe/builders.h"
#include "zbpipe/error.h"

namespace zbpipe {

Program build_interleaved_1f1b(const BuildArgs& a) {
  check_basic_args("interleaved_1f1b", a);
  const int v = resolve_stages_per_rank("interleaved_1f1b", a, 0, 2, 2);
  // PyTorch's rule, kept on purpose: forwards and backwards walk the local stages in blocks of
  // m / rounds microbatches, so a remainder would give some stage more than m forwards. Lifting
  // it needs a different block layout, and so a different order from PyTorch's.
  const int rounds = std::max(1, a.microbatches / a.pp);
  ZB_SCHEDULE_CHECK(a.microbatches % rounds == 0, "interleaved_1f1b needs microbatches to be a "
                    "multiple of the rounds max(1, microbatches / pp) = ", rounds,
                    ", got microbatches=", a.microbatches, ", pp=", a.pp);
  Program p = make_program("interleaved_1f1b", a, v, "loop");
  const auto shape = detail::interleaved_shape(a.pp, v, a.microbatches);
  for (int r = 0; r < a.pp; ++r) {
    const int warmup = std::min((v - 1) * shape.per_round + 2 * (a.pp - 1 - r), v * a.microbatches);
    detail::interleaved_rank_ops(shape, r, warmup, /*zero_bubble=*/false, p.ranks[r]);
  }
  return p;
}

}  // namespace zbpipe
