// Looped BFS (Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism"; PyTorch ScheduleLoopedBFS):
// v = stages_per_rank stages per rank on the loop topology (stage s on rank s % p). Rank r runs
// every forward of its local stages in ascending stage order (all m microbatches per stage, so
// the earliest stage wins when several are ready), then every full backward of its stages in
// descending stage order, microbatches in reverse (m-1 .. 0) as PyTorch does.
// Peak activations v*m per rank (like GPipe over v stages). v = 1 is legal (GPipe with the
// backwards newest first): PyTorch's class takes one stage too, only its visualizer insists on 2.
#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"

namespace zbpipe {

Program build_looped_bfs(const BuildArgs& a) {
  check_basic_args("looped_bfs", a);
  const int v = resolve_stages_per_rank("looped_bfs", a, 0, 2, 1);
  Program p = make_program("looped_bfs", a, v, "loop");
  const int m = a.microbatches;
  for (int r = 0; r < a.pp; ++r) {
    poll_cancel();
    auto& acts = p.ranks[r];
    acts.reserve(static_cast<size_t>(2) * v * m);
    // Phase 1: v*m forwards, local stage 0 first.
    for (int j = 0; j < v; ++j)
      for (int mb = 0; mb < m; ++mb) acts.emplace_back(j * a.pp + r, Kind::F, mb);
    // Phase 2: v*m full backwards, last local stage first, newest microbatch first.
    for (int j = v - 1; j >= 0; --j)
      for (int mb = m - 1; mb >= 0; --mb) acts.emplace_back(j * a.pp + r, Kind::B, mb);
  }
  return p;
}

}  // namespace zbpipe
