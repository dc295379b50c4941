// Shared rank program of the interleaved schedules (see interleaved_rank_ops.h).
#include "interleaved_rank_ops.h"

#include <algorithm>

#include "zbpipe/cancel.h"
#include "zbpipe/error.h"

namespace zbpipe::detail {

InterleavedShape interleaved_shape(int pp, int local_stages, int microbatches) {
  InterleavedShape s;
  s.pp = pp;
  s.local_stages = local_stages;
  s.microbatches = microbatches;
  s.per_round = microbatches / std::max(1, microbatches / pp);
  return s;
}

void interleaved_rank_ops(const InterleavedShape& s, int r, int warmup, bool zero_bubble,
                          std::vector<Action>& out) {
  const int v = s.local_stages, total = v * s.microbatches;  // forwards (= backwards) on rank r
  // Step `op` of the forward sequence runs local stage (op / per_round) % v; backward step `op`
  // (counted from the end of warm-up) runs the local stages in reverse.
  auto fwd_stage = [&](int op) { return ((op / s.per_round) % v) * s.pp + r; };
  auto bwd_stage = [&](int op) {
    return (v - 1 - ((op - warmup) / s.per_round) % v) * s.pp + r;
  };
  // Next microbatch per local stage for F, backward and W (stage / p is the local index).
  std::vector<int> next(static_cast<size_t>(3) * v, 0);
  auto take = [&](int kind_slot, int stage) { return next[kind_slot * v + stage / s.pp]++; };
  const Kind bwd_kind = zero_bubble ? Kind::I : Kind::B;
  int weights = 0;  // W's emitted; W number k belongs to backward step warmup + k
  auto emit_weight = [&] {
    const int stage = bwd_stage(warmup + weights++);
    out.emplace_back(stage, Kind::W, take(2, stage));
  };
  out.reserve(out.size() + static_cast<size_t>(zero_bubble ? 3 : 2) * total);

  for (int op = 0; op < warmup + total; ++op) {
    if (op < total) {  // warm-up (op < warmup) and steady phase: one forward
      const int fs = fwd_stage(op);
      out.emplace_back(fs, Kind::F, take(0, fs));
    }
    if (op >= warmup) {  // steady and cool-down phases: one backward
      const int bs = bwd_stage(op);
      out.emplace_back(bs, bwd_kind, take(1, bs));
      // ZB1P: rank r keeps r weight passes pending, filling the cool-down bubble with them.
      if (zero_bubble && op - warmup >= r) emit_weight();
    }
  }
  while (zero_bubble && weights < total) emit_weight();
  // End state: every local stage ran m forwards and m backwards (and m W's when split); this
  // is what the rounds rule guarantees.
  for (int j = 0; j < v; ++j)
    ZB_CHECK(next[j] == s.microbatches && next[v + j] == s.microbatches &&
                 next[2 * v + j] == (zero_bubble ? s.microbatches : 0),
             "interleaved rank ", r, " local stage ", j, ": F ", next[j], ", backward ", next[v + j],
             ", W ", next[2 * v + j], ", m=", s.microbatches);
}

Program build_interleaved(const char* schedule, const BuildArgs& a, bool zero_bubble) {
  check_basic_args(schedule, a);
  // One stage per rank is legal, as in PyTorch (its single-stage tests run these classes).
  const int v = resolve_stages_per_rank(schedule, a, 0, 2, 1);
  // PyTorch's rule, kept on purpose: forwards and backwards walk the local stages in blocks of
  // m / rounds microbatches, so a remainder would give some stage more than m forwards. Lifting
  // it needs a different block layout, and so a different order from PyTorch's.
  const int rounds = std::max(1, a.microbatches / a.pp);
  ZB_SCHEDULE_CHECK(a.microbatches % rounds == 0, schedule, " needs microbatches to be a "
                    "multiple of the rounds max(1, microbatches / pp) = ", rounds,
                    ", got microbatches=", a.microbatches, ", pp=", a.pp);
  Program p = make_program(schedule, a, v, "loop");
  const auto shape = interleaved_shape(a.pp, v, a.microbatches);
  const int hops = zero_bubble ? 1 : 2;
  for (int r = 0; r < a.pp; ++r) {
    poll_cancel();
    const int warmup = std::min((v - 1) * shape.per_round + hops * (a.pp - 1 - r), v * a.microbatches);
    interleaved_rank_ops(shape, r, warmup, zero_bubble, p.ranks[r]);
  }
  return p;
}

}  // namespace zbpipe::detail
