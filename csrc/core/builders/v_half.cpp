// V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", section 4): V
// topology, 2 stages (chunks) per rank, I/W split; peak activations about half of 1F1B's for a
// bubble of about p/(2m) at equal pass times.
//
// Block of rank i (slots of microbatch 0; +6 per microbatch), with g = 3 when p is even, else 0
// so that the four passes never share a slot modulo 6:
//   F chunk 0: 2i      F chunk 1: 3p-i-2      I chunk 1: 3p+g+2i-1      I chunk 0: 6p+g-i-2
// Forwards of consecutive ranks are 2 slots apart (1F1B's and ZB-V's are 1), which stretches
// the block but shortens every microbatch's lifespan to about half.
// Units: the simulator counts (stage, microbatch); a V chunk holds half a 1F1B stage's
// activations, so 1F1B's peak of p microbatches is 2p units and the paper's bound of
// ceil((p+1)/2) = (p+2)//2 1F1B microbatches is 2*((p+2)//2) units on every rank.
#include "v_blocks.h"

namespace zbpipe {

Program build_v_half(const BuildArgs& a) {
  const int p = a.pp, g = p % 2 == 0 ? 3 : 0;
  std::vector<detail::VBlock> blocks;
  for (int i = 0; i < p; ++i)
    blocks.push_back({2 * i, 3 * p - i - 2, 3 * p + g + 2 * i - 1, 6 * p + g - i - 2});
  return detail::build_v_from_blocks("v_half", a, blocks, 2 * ((p + 2) / 2));
}

}  // namespace zbpipe
