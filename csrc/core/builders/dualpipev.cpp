// DualPipeV (DeepSeek-V3 report, arXiv 2412.19437; deepseek-ai/DualPipe dualpipev.py; PyTorch
// ScheduleDualPipeV): the V-shaped half of DualPipe. Two stages per rank on the V topology
// (chunk 0 = stage r, chunk 1 = stage 2p-1-r); in the main phase a forward of one chunk and a
// full backward of the other form one OVERLAP_F_B unit, whose halves the runtime runs at the
// same time (the backward on a worker thread, the forward's SEND posted as soon as the forward
// ends; see ExecutorOptions::overlap_f_b; model-level overlap of MoE dispatch/combine inside a
// unit is not there yet). Rank r of p, m microbatches (m >= 2p so the main phase is non-empty):
//   Step 1  2(p-r-1) times: F0
//   Step 2  r+1 times: F0 F1
//   Step 3  p-r-1 times: I1 W1 F1                       (zero bubble)
//   Step 4  m-2p+r+1 times: (F0;B1) (F1;B0)             (last rank: first pair not overlapped)
//   Step 5  p-r-1 times: B1 (F1;B0)
//   Step 6  r+1 times: B1 B0, switching to I from the middle iteration on (I1 first on odd
//           ranks, I0 first on even ones)
//   Step 7  p-r-1 times: W, then I0
//   Step 8  r+1 times: W
// W's run oldest-first from one queue of pending I's, as DualPipe's WeightGradStore does.
#include <algorithm>

#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"
#include "zbpipe/error.h"

namespace zbpipe {

Program build_dualpipev(const BuildArgs& a) {
  check_basic_args("dualpipev", a);
  const int spr = resolve_stages_per_rank("dualpipev", a, 2, 2, 2);
  ZB_SCHEDULE_CHECK(a.microbatches >= 2 * a.pp, "dualpipev needs microbatches >= 2 * pp = ",
                    2 * a.pp, ", got microbatches=", a.microbatches, ", pp=", a.pp);
  Program p = make_program("dualpipev", a, spr, "v");
  const int pp = a.pp, m = a.microbatches;
  // Pending weight passes (stage, microbatch), oldest first; reused across ranks.
  std::vector<std::pair<int, int>> weights;
  weights.reserve(2 * pp);
  for (int r = 0; r < pp; ++r) {
    poll_cancel();
    auto& acts = p.ranks[r];
    acts.reserve(static_cast<size_t>(4) * m);
    const int stage[2] = {r, 2 * pp - 1 - r};
    int fwd[2] = {0, 0}, bwd[2] = {0, 0};  // next microbatch for F and for B / I, per chunk
    weights.clear();
    size_t weight_head = 0;
    auto F = [&](int c) { acts.emplace_back(stage[c], Kind::F, fwd[c]++); };
    auto B = [&](int c) { acts.emplace_back(stage[c], Kind::B, bwd[c]++); };
    auto I = [&](int c) {
      weights.emplace_back(stage[c], bwd[c]);
      acts.emplace_back(stage[c], Kind::I, bwd[c]++);
    };
    auto backward = [&](int c, bool split) { split ? I(c) : B(c); };
    auto W = [&] {  // no-op when nothing is pending, as in DualPipe
      if (weight_head == weights.size()) return;
      const auto [s, mb] = weights[weight_head++];
      acts.emplace_back(s, Kind::W, mb);
    };
    auto overlap = [&](int fc, int bc) {
      acts.push_back(Action::overlap({Action(stage[fc], Kind::F, fwd[fc]++),
                                      Action(stage[bc], Kind::B, bwd[bc]++)}));
    };

    for (int k = 0; k < 2 * (pp - r - 1); ++k) F(0);                       // step 1
    for (int k = 0; k < r + 1; ++k) { F(0); F(1); }                         // step 2
    for (int k = 0; k < pp - r - 1; ++k) { I(1); W(); F(1); }               // step 3
    for (int k = 0; k < m - 2 * pp + r + 1; ++k) {                          // step 4
      if (k == 0 && r == pp - 1) {
        F(0);  // DualPipe: not overlapping these two shortens the bubble
        B(1);
      } else {
        overlap(0, 1);
      }
      overlap(1, 0);
    }
    for (int k = 0; k < pp - r - 1; ++k) { B(1); overlap(1, 0); }          // step 5
    bool split = false;                                                     // step 6
    for (int k = 0; k < r + 1; ++k) {
      if (k == (r + 1) / 2 && r % 2 == 1) split = true;
      backward(1, split);
      if (k == (r + 1) / 2 && r % 2 == 0) split = true;
      backward(0, split);
    }
    for (int k = 0; k < pp - r - 1; ++k) { W(); backward(0, split); }      // step 7
    for (int k = 0; k < r + 1; ++k) W();                                    // step 8
    ZB_CHECK(fwd[0] == m && fwd[1] == m && bwd[0] == m && bwd[1] == m &&
                 weight_head == weights.size(),
             "dualpipev counts on rank ", r, ": F ", fwd[0], "/", fwd[1], ", B ", bwd[0], "/",
             bwd[1], ", W pending ", weights.size() - weight_head, ", m=", m);
  }
  return p;
}

}  // namespace zbpipe
