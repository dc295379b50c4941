// The rank program shared by interleaved_1f1b and interleaved_zb: PyTorch's _get_1f1b_rank_ops
// (warm-up forwards, then one forward + one backward per step, then cool-down backwards) on the
// loop topology, with closed-form stage indices per step.
#pragma once

#include <vector>

#include "zbpipe/action.h"

namespace zbpipe::detail {

struct InterleavedShape {
  int pp = 0;            // p
  int local_stages = 0;  // v
  int microbatches = 0;  // m
  int per_round = 0;     // microbatches per round: the forward / backward block size per stage
};

// Rounds as PyTorch computes them: max(1, m / p) rounds of m / rounds microbatches; the caller
// must have checked that m is a multiple of the rounds.
InterleavedShape interleaved_shape(int pp, int local_stages, int microbatches);

// Emits rank r's compute actions. warmup: forwards before the first backward. With
// zero_bubble, backwards are I, and a W (oldest pending first) follows every step from step r of
// the steady phase on; the remaining W's drain at the end (ZB1P). Without it, backwards are B.
void interleaved_rank_ops(const InterleavedShape& s, int r, int warmup, bool zero_bubble,
                          std::vector<Action>& out);

}  // namespace zbpipe::detail
