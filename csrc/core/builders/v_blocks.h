// The V-shape building blocks of "Pipeline Parallelism with Controllable Memory" (Qi et al.
// 2024), shared by v_half and v_min: a schedule is one block per rank repeated every microbatch.
#pragma once

#include <string>
#include <vector>

#include "zbpipe/builders.h"
#include "zbpipe/program.h"

namespace zbpipe::detail {

// A rank spends 6 slots per microbatch: two F, two I, two W.
inline constexpr int kSlotsPerMicrobatch = 6;

// Slots (unit-cost time steps) of one rank's four passes of microbatch 0 in the repeating
// block; microbatch k runs each at slot + kSlotsPerMicrobatch * k. Chunk 0 is stage r (the V's
// way down), chunk 1 stage 2p-1-r (the way back up).
struct VBlock {
  int f_chunk0;  // F of stage r
  int f_chunk1;  // F of stage 2p-1-r
  int i_chunk1;  // I of stage 2p-1-r (the backward reaches the way up first)
  int i_chunk0;  // I of stage r
};

// Checks the request (V topology, 2 stages per rank fixed, memory_cap 0 for the paper's cap of
// `cap_units`, or any cap that holds one microbatch of both stages of every rank), lays
// `blocks` (one per rank) out over every microbatch twice, as is and refined by the paper's
// post-passes (v_post_passes.h), and returns the best of those two and what the list scheduler
// finds under the same cap and costs (a searched program must match or beat both layouts on
// makespan and span to be chosen; failing that, the refined layout is the bar). `cap_units`
// counts (stage, microbatch) units; both layouts are checked to stay within it. Unless
// a.refine is false, the pick then goes through the refinement pass (refine.h) under the same
// cap: never worse on makespan or longest span.
Program build_v_from_blocks(const std::string& name, const BuildArgs& a,
                            const std::vector<VBlock>& blocks, int cap_units);

}  // namespace zbpipe::detail
