// The one definition of what a compute action does to its rank's activation memory: the
// simulator, the list scheduler, the search, the paper heuristic and the refinement all read
// these deltas (dependencies.h defines what an action needs; this header, what it holds).
//
// The rule, per (stage, microbatch):
//   F adds mem_f when it starts (its saved activations);
//   a full B frees mem_f when it ends;
//   I frees mem_f - mem_w when it ends (what only the input gradient needed);
//   W frees mem_w when it ends (what the weight gradient kept: for a Linear, its input and the
//   output gradient captured at I).
// mem_w unset means mem_w = mem_f: I frees nothing and W frees it all, the model of a runtime
// that keeps every saved tensor until W. The Zero Bubble paper's (Qi et al. 2023, Table 1) is
// mem_f = M_B = 34h + 5as and mem_w = M_W = 32h per token and layer.
#pragma once

#include <vector>

#include "zbpipe/action.h"

namespace zbpipe {

// Each vector holds one value per stage, or a single value that applies to every stage; the
// units are the caller's (microbatches of one stage at the default mem_f = 1, or bytes).
struct MemoryModel {
  std::vector<double> mem_f{1.0};
  std::vector<double> mem_w{};  // empty: mem_w = mem_f

  double forward(int stage) const;  // mem_f
  double weight(int stage) const;   // mem_w, or mem_f when unset
  // What `part` (F, B, I or W; not OVERLAP_F_B: take its parts) adds when it starts, and frees
  // when it ends (a non-negative amount each); communication holds nothing.
  double added_at_start(const Action& part) const;
  double freed_at_end(const Action& part) const;
  // Checks sizes (1 or num_stages), mem_f > 0 and 0 <= mem_w <= mem_f; throws ScheduleError.
  void check(int num_stages) const;
};

// Whether `held` stays within `cap`, up to the rounding of summed deltas (relative to the cap,
// so that byte-sized values get the same slack as microbatch counts).
inline bool within_cap(double held, double cap) {
  return held <= cap + 1e-9 * (cap > 1.0 ? cap : 1.0);
}

}  // namespace zbpipe
