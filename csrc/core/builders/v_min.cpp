// V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", section 4): V
// topology, 2 stages (chunks) per rank, I/W split; peak activations about a third of 1F1B's
// for a bubble of about 2p/(3m) at equal pass times.
//
// Block of rank i (slots of microbatch 0; +6 per microbatch), with g = 2 when p % 3 == 0, else
// 0 so that the four passes never share a slot modulo 6:
//   F chunk 0: i      F chunk 1: 2p-i-1      I chunk 1: 2p+g+i      I chunk 0: 4p+g-i-1
// Every pass follows its dependency by one slot (the V is traversed as fast as it can), which
// gives the shortest lifespans, and so the least memory, of the V family.
// Units as in v_half.cpp: one (stage, microbatch) = half a 1F1B stage's activations; the paper's
// bound of (p+4)//3 1F1B microbatches is 2*((p+4)//3) units on every rank.
#include "v_blocks.h"

namespace zbpipe {

Program build_v_min(const BuildArgs& a) {
  const int p = a.pp, g = p % 3 == 0 ? 2 : 0;
  std::vector<detail::VBlock> blocks;
  for (int i = 0; i < p; ++i) blocks.push_back({i, 2 * p - i - 1, 2 * p + g + i, 4 * p + g - i - 1});
  return detail::build_v_from_blocks("v_min", a, blocks, 2 * ((p + 4) / 3));
}

}  // namespace zbpipe
