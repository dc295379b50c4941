// Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
// Clusters", section 2.2; PyTorch ScheduleInterleaved1F1B): v stages per rank on the loop
// topology, depth first (v = 1 runs PyTorch's formula too: warm-up 2*(p-1-r), as torch does). Forwards and backwards move through the local stages in blocks of
// `per_round` microbatches (PyTorch's flexible rounds: max(1, m / p) rounds, so m need not be a
// multiple of p, only of the round count).
// Rank r: warm-up w_r = min((v-1)*per_round + 2*(p-1-r), v*m) forwards, then one forward and
// one full backward per step, then w_r backwards. Rank r peaks at min(w_r + 1, v*m)
// (stage, microbatch) units; bubble about 1/v of 1F1B's at equal costs.
#include "interleaved_rank_ops.h"

namespace zbpipe {

Program build_interleaved_1f1b(const BuildArgs& a) {
  return detail::build_interleaved("interleaved_1f1b", a, /*zero_bubble=*/false);
}

}  // namespace zbpipe
