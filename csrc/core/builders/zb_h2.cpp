// ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.2 and figure 3):
// twice 1F1B's warm-up forwards fill the bubble before the first I, and W's deferred to the
// tail fill the bubble after the last one. One stage per rank, backward split into I and W.
//
// Rank r of p, the paper's hand schedule (its efficiency.py get_hand_schedule, warmup_c=2):
//   Phase 1  w_r = min(m, 2(p-1-r)) warm-up forwards
//   Phase 2  for i = 0..m-1: F (while forwards remain), I_i, and W_{i-2r} once i >= 2r
//            (rank r keeps 2r weight passes pending, so rank 0's W's start at once)
//   Phase 3  the 2r W's still pending
// Bubble per rank span: (p-1)(T_F + T_B + 2 T_comm - 2 T_W) (the paper's Table 2 plus comm),
// so zero at equal F/I/W costs without comm, for m >= 2p. Peak activations 2p-1 (rank 0 holds
// 2(p-1) warm-up forwards plus the one in flight; rank p-1 defers 2(p-1) W's).
#include <algorithm>

#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"
#include "zbpipe/error.h"

namespace zbpipe {

Program build_zb_h2(const BuildArgs& a) {
  check_basic_args("zb_h2", a);
  const int spr = resolve_stages_per_rank("zb_h2", a, 1, 1, 1);
  Program p = make_program("zb_h2", a, spr, "loop");
  const int m = a.microbatches, pp = a.pp;
  for (int r = 0; r < pp; ++r) {
    poll_cancel();
    auto& acts = p.ranks[r];
    acts.reserve(static_cast<size_t>(3) * m);
    const int warmup = std::min(m, 2 * (pp - 1 - r));
    const int lag = 2 * r;  // W's rank r keeps pending behind its I's
    int nf = 0, nw = 0;
    // Phase 1: warm-up forwards.
    while (nf < warmup) acts.emplace_back(r, Kind::F, nf++);
    // Phase 2: steady state, F / I / deferred W.
    for (int i = 0; i < m; ++i) {
      if (nf < m) acts.emplace_back(r, Kind::F, nf++);
      acts.emplace_back(r, Kind::I, i);
      if (i >= lag) acts.emplace_back(r, Kind::W, nw++);
    }
    // Phase 3: the pending W's.
    while (nw < m) acts.emplace_back(r, Kind::W, nw++);
    ZB_CHECK(nf == m && static_cast<int>(acts.size()) == 3 * m, "zb_h2 counts: nf=", nf,
             " actions=", acts.size(), " m=", m, " rank=", r);
  }
  return p;
}

}  // namespace zbpipe
