// Lower bounds of every rank's span (first compute start to last compute end, the measure of
// the Zero Bubble paper's bubble rate) over all valid programs of one shape: a topology, a
// microbatch count, the costs, the memory model and a per-rank memory cap. Schedules are
// judged against them: a figure at its bound cannot be improved by any order.
//
// For rank r, whose lowest stage σ_r starts its span at s_r (every other compute on r waits
// for an F of σ_r), three arguments, the largest of which is the bound (the costs are
// per stage; c = comm between stages on different ranks, 0 on the same rank):
//   work     the compute of r: m * sum over its stages of (F + B + W).
//   chain    through any rank q whose lowest stage σ_q lies above σ_r: q starts no earlier than
//            s_r + the forwards σ_r .. σ_q - 1 with their comms; it then runs every F and I of
//            its own (and the W the cap forces before its last F) before its last I ends; that
//            microbatch's backward then travels down to r's stages below it, each I with its
//            comm, and r ends with that microbatch's W. The zero-bubble bound of a deep
//            pipeline with few microbatches: (p-1)(F+B+2c) + m(F+B) + W for rank 0 of a loop.
//   idle     work plus two idle times r cannot avoid. Before its first backward, r runs only
//            forwards, and only as many as the cap holds (nothing is freed yet), while the
//            first backward waits for a round trip of its microbatch through the later stages.
//            After its last F, the backward of that microbatch is again a round trip away, and
//            r can fill the wait only with the backward work of the microbatches it holds,
//            which the cap limits too. (The two windows are disjoint when the cap does not hold
//            every forward; otherwise the larger counts alone.)
// What they do not see: contention among several ranks at once, so a bound above a schedule's
// figure is impossible, one below it says how far from optimal the schedule may be.
#pragma once

#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/program.h"

namespace zbpipe {

struct SpanBound {
  std::vector<double> span;  // per rank: no valid program's span of that rank is shorter
  double max_span = 0.0;     // the largest of them
  double bubble_rate = 0.0;  // 1 - sum(work) / (pp * max_span): no valid program's is lower
};

// `shape` gives the topology and sizes (its actions are ignored); the bounds hold whether a
// program splits its backwards into I and W or runs full B. cap: one value per rank in mem_f's
// units, or a single value for every rank. Throws ScheduleError on costs, memory or caps that
// do not fit the shape, and on a forward-only program (the bounds count backward work).
SpanBound span_lower_bound(const Program& shape, const CostModel& costs,
                           const MemoryModel& memory, const std::vector<double>& cap);

}  // namespace zbpipe
