// inference: forward passes only, one stage per rank, microbatches in order.
#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"

namespace zbpipe {

Program build_inference(const BuildArgs& a) {
  check_basic_args("inference", a);
  int spr = resolve_stages_per_rank("inference", a, 1, 1, 1);
  Program p = make_program("inference", a, spr, "loop");
  for (int r = 0; r < a.pp; ++r) {
    poll_cancel();
    for (int mb = 0; mb < a.microbatches; ++mb) p.ranks[r].emplace_back(r, Kind::F, mb);
  }
  return p;
}

}  // namespace zbpipe
