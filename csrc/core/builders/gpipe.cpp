// GPipe (Huang et al., 2019): every forward, then every full backward, one stage per rank.
// Peak activations m on every rank; bubble (p-1)/(m+p-1) at equal costs.
#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"

namespace zbpipe {

Program build_gpipe(const BuildArgs& a) {
  check_basic_args("gpipe", a);
  int spr = resolve_stages_per_rank("gpipe", a, 1, 1, 1);
  Program p = make_program("gpipe", a, spr, "loop");
  for (int r = 0; r < a.pp; ++r) {
    poll_cancel();
    for (int mb = 0; mb < a.microbatches; ++mb) p.ranks[r].emplace_back(r, Kind::F, mb);
    for (int mb = 0; mb < a.microbatches; ++mb) p.ranks[r].emplace_back(r, Kind::B, mb);
  }
  return p;
}

}  // namespace zbpipe
