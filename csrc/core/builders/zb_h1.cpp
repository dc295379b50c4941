// ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3.1, figure 3 top): 1F1B
// with the backward split into I (input gradient) and W (weight gradient), one stage per rank.
// Rank r: w_r = min(m, p-1-r) warm-up forwards as in 1F1B; then F, I per step, plus one W once
// r W's are pending (rank r defers r weight passes, so rank p-1 runs F I F I ... at first and
// its I's, on the critical path, reach the earlier ranks sooner); then the cool-down I's, each
// followed by a W under the same rule; then the r deferred W's.
// Peak activations (F start to W end): at most min(m, p) on every rank, never above 1F1B's peak
// (rank 0's min(m, p)). At equal F/I/W costs rank r's span holds p-1-r idle units (waiting for
// its first I) and no other, so the span-based bubble is (p-1)/(3m+p-1): about 1/3 of 1F1B's
// (p-1)/(m+p-1) for large m.
#include <algorithm>

#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"

namespace zbpipe {

Program build_zb_h1(const BuildArgs& a) {
  check_basic_args("zb_h1", a);
  const int spr = resolve_stages_per_rank("zb_h1", a, 1, 1, 1);
  Program p = make_program("zb_h1", a, spr, "loop");
  const int m = a.microbatches;
  for (int r = 0; r < a.pp; ++r) {
    poll_cancel();
    auto& acts = p.ranks[r];
    acts.reserve(static_cast<size_t>(3) * m);
    int nf = 0, ni = 0, nw = 0;
    auto weight_if_due = [&] {
      if (ni - nw > r) acts.emplace_back(r, Kind::W, nw++);
    };
    // Phase 1: warm-up forwards.
    const int warmup = std::min(m, a.pp - 1 - r);
    while (nf < warmup) acts.emplace_back(r, Kind::F, nf++);
    // Phase 2: steady state, F then I (then W once r are pending).
    while (nf < m) {
      acts.emplace_back(r, Kind::F, nf++);
      acts.emplace_back(r, Kind::I, ni++);
      weight_if_due();
    }
    // Phase 3: cool-down I's.
    while (ni < m) {
      acts.emplace_back(r, Kind::I, ni++);
      weight_if_due();
    }
    // Phase 4: the deferred W's (min(m, r) of them).
    while (nw < m) acts.emplace_back(r, Kind::W, nw++);
  }
  return p;
}

}  // namespace zbpipe
