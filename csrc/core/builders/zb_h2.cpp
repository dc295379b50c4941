// ZB-H2 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3.1, figure 3 bottom): more
// warm-up forwards than 1F1B fill the bubble before the first I, and W's deferred to the tail
// fill the bubble after the last one. One stage per rank, backward split into I and W.
//
// Rank r (of p) for m >= 2p-1 microbatches, slots of one unit at equal F/I/W costs:
//   Phase 1  2p-1-2r forwards (rank 0 then holds 2p-1 microbatches, its peak)
//   Phase 2  I, then p-1 times: X, I   where X = F for the first r, else W
//   Phase 3  m-2p+1 times: W, F, I
//   Phase 4  p-1 times: X, I           where X = F for the first r, else W
//   Phase 5  the 2r+1 W's still pending
// Every rank runs its I_k exactly one unit after rank r+1 does (the I slots sit at the same
// offsets from each rank's phase-2 start, and that start is one unit later per rank up the
// pipeline), and its forwards stay two slots behind rank r-1's, so with f=b=w=1 and comm=0 each
// rank is busy from its first start to its last end: span 3m, bubble 0. That needs m >= 2p-1
// (phase 3 non-negative). For smaller m the order is built for 2p-1 microbatches and the
// phantom ones are dropped (a valid program minus whole microbatches stays valid), which keeps
// it correct but not bubble-free (2p-1-m idle units on the busiest rank). Peak activations
// <= 2p-1 on every rank (rank p-1 reaches it at the end of phase 4).
#include <algorithm>

#include "zbpipe/builders.h"
#include "zbpipe/error.h"

namespace zbpipe {

Program build_zb_h2(const BuildArgs& a) {
  check_basic_args("zb_h2", a);
  const int spr = resolve_stages_per_rank("zb_h2", a, 1, 1, 1);
  Program p = make_program("zb_h2", a, spr, "loop");
  const int m = a.microbatches, pp = a.pp;
  const int full = std::max(m, 2 * pp - 1);  // microbatches the closed form is built for
  for (int r = 0; r < pp; ++r) {
    auto& acts = p.ranks[r];
    acts.reserve(static_cast<size_t>(3) * m);
    int nf = 0, ni = 0, nw = 0;
    auto emit = [&](Kind k, int& counter) {
      const int mb = counter++;
      if (mb < m) acts.emplace_back(r, k, mb);  // drop phantom microbatches
    };
    auto F = [&] { emit(Kind::F, nf); };
    auto I = [&] { emit(Kind::I, ni); };
    auto W = [&] { emit(Kind::W, nw); };
    // Phase 1: warm-up forwards.
    for (int k = 0; k < 2 * pp - 1 - 2 * r; ++k) F();
    // Phase 2: fill between the first I's (forwards on later ranks, W's on earlier ones).
    I();
    for (int k = 0; k < pp - 1; ++k) {
      if (k < r) F(); else W();
      I();
    }
    // Phase 3: steady state.
    for (int k = 0; k < full - 2 * pp + 1; ++k) {
      W();  // before F: the W frees an activation before the F takes one
      F();
      I();
    }
    // Phase 4: the last forwards, between the last I's.
    for (int k = 0; k < pp - 1; ++k) {
      if (k < r) F(); else W();
      I();
    }
    // Phase 5: the deferred W's.
    ZB_CHECK(nf == full && ni == full && nw == full - (2 * r + 1), "zb_h2 phase counts: nf=", nf,
             " ni=", ni, " nw=", nw, " full=", full, " rank=", r);
    while (nw < full) W();
  }
  return p;
}

}  // namespace zbpipe
