// Discrete-event simulation of a program under a cost model: the oracle for every builder.
//
// Model: each rank runs its compute actions in program order, one at a time; an action starts
// when the rank is free and its inputs exist (cross-rank inputs arrive `comm` after the
// producer ends, same-rank ones at once). Communication actions take no rank time (the runtime
// overlaps them). Activations: one unit per (stage, microbatch) from the start of its F until
// the end of its last backward action (B, or W when split). Memory: the deltas of
// memory_model.h (F adds mem_f at its start, B / I / W free their part at their end; the parts
// of an OVERLAP_F_B start and end together). Vocabulary actions follow vocab.h's rule (see the
// second overload). Not modelled: bandwidth contention,
// stream overlap inside OVERLAP_F_B (its cost is F + B), optimizer step, memory of weights.
//
// Bubble rate follows the Zero Bubble paper (Qi et al. 2023, section 2): a rank's time is its
// span, from its first compute start to its last compute end, and the bubble rate is
// 1 - sum(busy) / (pp * longest span). The warm-up offset of later ranks is not counted (the
// paper's optimizer post-validation removes the step-wide sync that would expose it). For 1F1B
// rank 0's span is the makespan, so this equals the classic (p-1)/(m+p-1) at equal costs.
// idle_rate is the stricter 1 - sum(busy) / (pp * makespan).
#pragma once

#include <string>
#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/program.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

struct TimelineEvent {
  int rank;
  Action action;
  double start;
  double end;
};

struct SimResult {
  double makespan = 0.0;
  double bubble_rate = 0.0;               // 1 - sum(busy) / (pp * max span), the paper's
  double idle_rate = 0.0;                 // 1 - sum(busy) / (pp * makespan)
  std::vector<double> busy;               // compute time per rank
  std::vector<double> span;               // per rank: last compute end - first compute start
  std::vector<int> peak_activations;      // per rank, in microbatches
  std::vector<double> peak_memory;        // per rank, in mem_f's units (memory_model.h)
  std::vector<TimelineEvent> timeline;    // compute actions, sorted by (rank, start)
  // Vocabulary collectives (vocab.h), one event per rank's post: from the post to the
  // collective's completion; sorted by (rank, start). Empty without vocabulary actions.
  std::vector<TimelineEvent> collectives;
};

// What a search or refinement minimizes first: the makespan, or the longest rank span, the Zero
// Bubble paper's measure (its bubble rate is monotone in it: with steps run back to back and no
// step-wide sync, a rank starts its next step's work as soon as its own span ends). The other
// one breaks ties.
enum class Objective { kMakespan, kSpan };

// Throws ScheduleError (with the grid) if the compute order deadlocks, or if the costs or the
// memory model do not fit the program. with_timeline=false leaves `timeline` empty (the
// searches score thousands of programs and read only the numbers).
SimResult simulate(const Program& p, const CostModel& costs, const MemoryModel& memory = {},
                   bool with_timeline = true);
// The same, with the vocabulary head's costs and memory for a program with vocabulary actions
// (vocab.h; the overload above uses VocabModel's defaults): S and T take their rank's time; a
// collective completes `vocab.collective` after its last post; a REDUCE_B is posted once its
// ALLREDUCE_S completed (the rank waits for it); an S adds the rank's mem_s at its start, which
// its T frees at its end (an S frees it at its own end in a program without T).
SimResult simulate(const Program& p, const CostModel& costs, const MemoryModel& memory,
                   const VocabModel& vocab, bool with_timeline = true);

}  // namespace zbpipe
