// The post-passes of "Pipeline Parallelism with Controllable Memory" (Qi et al. 2024) over a V
// building block laid out in unit slots: W placement, warm-up / cool-down reordering, squeeze.
#pragma once

#include <vector>

#include "v_blocks.h"
#include "zbpipe/action.h"

namespace zbpipe::detail {

// Lays `blocks` (one per rank) out over `m` microbatches in unit slots (every pass takes one
// slot) and refines the layout the way the paper does before it meets the real costs:
//   1. each rank runs a pending W in every idle slot;
//   2. warm-up and cool-down passes, W included, move to the earliest free slot their inputs
//      allow, taken in slot order, unless that lifts the rank's peak above the block's highest
//      peak of any rank;
//   3. squeeze: every pass starts as soon as its inputs and its rank allow (unit time);
//   4. the W are taken out and the cool-down reordered once more with W implied in idle slots
//      (step 1's rule), then squeezed;
//   5. the W go back into the idle slots, chunk 1's before chunk 0's (the order in which the
//      backward reaches a rank), and each rank's order is read off the slots.
// The real costs enter only afterwards: simulating the order is the paper's final "squeeze to
// as-soon-as-possible". Memory is counted as the simulator does (one unit per (stage,
// microbatch) from F to W) and no rank ends above the laid-out block's highest peak, which
// the caller's cap bounds. Returns one compute-only action list per rank, chunk 0 = stage r,
// chunk 1 = stage 2p-1-r, every pass I/W split. Never throws for a valid block (see
// VBlock: the four passes of a rank never share a slot modulo 6).
std::vector<std::vector<Action>> reorder_v_block(const std::vector<VBlock>& blocks, int m);

}  // namespace zbpipe::detail
