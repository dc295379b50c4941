// 1F1B (PipeDream-flush / Megatron): rank r runs w = min(m, p-1-r) warm-up forwards, then
// alternates one forward and one full backward, then drains the remaining backwards.
// Peak activations on rank r: min(m, p-r). Bubble (p-1)/(m+p-1) at equal costs.
#include <algorithm>

#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"

namespace zbpipe {

Program build_1f1b(const BuildArgs& a) {
  check_basic_args("1f1b", a);
  int spr = resolve_stages_per_rank("1f1b", a, 1, 1, 1);
  Program p = make_program("1f1b", a, spr, "loop");
  const int m = a.microbatches;
  for (int r = 0; r < a.pp; ++r) {
    poll_cancel();
    auto& acts = p.ranks[r];
    const int warmup = std::min(m, a.pp - 1 - r);
    int next_f = 0, next_b = 0;
    // Phase 1: warm-up forwards.
    while (next_f < warmup) acts.emplace_back(r, Kind::F, next_f++);
    // Phase 2: steady state, one forward then one backward.
    while (next_f < m) {
      acts.emplace_back(r, Kind::F, next_f++);
      acts.emplace_back(r, Kind::B, next_b++);
    }
    // Phase 3: cool-down backwards.
    while (next_b < m) acts.emplace_back(r, Kind::B, next_b++);
  }
  return p;
}

}  // namespace zbpipe
