// ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6; PyTorch
// ScheduleZBVZeroBubble): two stages per rank on the V topology (rank r holds chunk 0 = stage r
// and chunk 1 = stage 2p-1-r), backward split into I and W. Rank r, with n = max(m, 2p-1):
//   Phase 1  2(p-r)-1 forwards of chunk 0
//   Phase 2  r times: F chunk 1, F chunk 0
//   Phase 3  p-r times: F, I, W of chunk 1
//   Phase 4  until both chunks have run n forwards: [F0 while < n], I0, W0, F1, I1, W1
//   Phase 5  r times: I0, I1;  then p-r times: I0, W0 (oldest pending);  then the W's left,
//            chunk 1 first
// Like PyTorch, the order is built for n >= 2p-1 microbatches and those >= m are dropped, so
// any m >= 1 is legal (a valid program minus whole microbatches stays valid). Bubble-free at
// equal F/I/W costs once m >= 2p-1; peak activations 2p (stage, microbatch) units per rank,
// each half of a rank's model slice: the memory of 1F1B's p microbatches on rank 0.
#include <algorithm>

#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"
#include "zbpipe/error.h"

namespace zbpipe {

Program build_zbv(const BuildArgs& a) {
  check_basic_args("zbv", a);
  const int spr = resolve_stages_per_rank("zbv", a, 2, 2, 2);
  Program p = make_program("zbv", a, spr, "v");
  const int pp = a.pp, m = a.microbatches, n = std::max(m, 2 * pp - 1);
  for (int r = 0; r < pp; ++r) {
    poll_cancel();
    auto& acts = p.ranks[r];
    acts.reserve(static_cast<size_t>(6) * m);
    const int s0 = r, s1 = 2 * pp - 1 - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    auto emit = [&](int stage, Kind k, int mb) {
      if (mb < m) acts.emplace_back(stage, k, mb);  // drop phantom microbatches
    };
    // Phase 1: chunk 0 warm-up.
    for (int k = 0; k < 2 * (pp - r) - 1; ++k) emit(s0, Kind::F, f0++);
    // Phase 2: both chunks.
    for (int k = 0; k < r; ++k) {
      emit(s1, Kind::F, f1++);
      emit(s0, Kind::F, f0++);
    }
    // Phase 3: chunk 1 turns around at the bottom of the V.
    for (int k = 0; k < pp - r; ++k) {
      emit(s1, Kind::F, f1++);
      emit(s1, Kind::I, b1);
      emit(s1, Kind::W, b1++);
    }
    // Phase 4: steady state.
    while (f1 < f0 || f0 < n) {
      if (f0 < n) emit(s0, Kind::F, f0++);
      emit(s0, Kind::I, b0);
      emit(s0, Kind::W, b0++);
      emit(s1, Kind::F, f1++);
      emit(s1, Kind::I, b1);
      emit(s1, Kind::W, b1++);
    }
    // Phase 5: cool-down I's, W's filling the gaps, then the W's left.
    int w0 = b0, w1 = b1;
    for (int k = 0; k < r; ++k) {
      emit(s0, Kind::I, b0++);
      emit(s1, Kind::I, b1++);
    }
    for (int k = 0; k < pp - r; ++k) {
      emit(s0, Kind::I, b0++);
      emit(s0, Kind::W, w0++);
    }
    while (w1 < b1) emit(s1, Kind::W, w1++);
    while (w0 < b0) emit(s0, Kind::W, w0++);
    ZB_CHECK(f0 == n && b0 == n && w0 == n && f1 == n && b1 == n && w1 == n, "zbv counts: f0=", f0,
             " b0=", b0, " w0=", w0, " f1=", f1, " b1=", b1, " w1=", w1, " n=", n);
  }
  return p;
}

}  // namespace zbpipe
