// Discrete-event simulation of a program under a cost model: the oracle for every builder.
//
// Model: each rank runs its compute actions in program order, one at a time; an action starts
// when the rank is free and its inputs exist (cross-rank inputs arrive `comm` after the
// producer ends, same-rank ones at once). Communication actions take no rank time (the runtime
// overlaps them). Activations: one unit per (stage, microbatch) from the start of its F until
// the end of its last backward action (B, or W when split). Not modelled: bandwidth contention,
// stream overlap inside OVERLAP_F_B (its cost is F + B), optimizer step, memory of weights.
#pragma once

#include <string>
#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/program.h"

namespace zbpipe {

struct TimelineEvent {
  int rank;
  Action action;
  double start;
  double end;
};

struct SimResult {
  double makespan = 0.0;
  double bubble_rate = 0.0;               // idle share of pp * makespan
  std::vector<double> busy;               // compute time per rank
  std::vector<int> peak_activations;      // per rank, in microbatches
  std::vector<TimelineEvent> timeline;    // compute actions, sorted by (rank, start)
};

// Throws ScheduleError (with the grid) if the compute order deadlocks.
SimResult simulate(const Program& p, const CostModel& costs);

}  // namespace zbpipe
