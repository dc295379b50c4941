// Partition planning: contiguous splits of a chain of measured units (a model's layers, its
// embedding, its head) into the stages of a compiled program, scored by the simulator, searched
// jointly over candidate programs under a per-rank memory budget (zbpipe.plan_partition).
//
// A split is `bounds`: num_stages + 1 unit indices 0 = b0 < b1 < ... < bS = units; stage s
// holds units [b_s, b_{s+1}). A stage's costs are the sums of its units' (f, i, w, fused b) and
// its memory the sums of their saved bytes (mem_f, mem_w; the runtime's probe counts a
// stage's received inputs as a unit's own saved tensors, so the sums hold), but for the first
// stage, whose input needs no gradient: its I is 0, its W the units' I + W, and its mem_w its
// mem_f ([Note: first stage's I] in partition.cpp). A rank's peak is
// the simulated activation peak (memory_model.h) plus the static bytes (parameters, gradients,
// optimizer state) of its stages.
#pragma once

#include <cstdint>
#include <vector>

#include "zbpipe/program.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

// Per unit, one value each (seconds, bytes). b: a fused backward; empty (or any value <= 0)
// means i + w.
struct UnitProfile {
  std::vector<double> f, i, w, b;
  std::vector<double> mem_f, mem_w, static_bytes;
  int size() const { return static_cast<int>(f.size()); }
  void check() const;  // equal sizes, >= 1 unit, non-negative values; ScheduleError
};

struct SplitScore {
  std::vector<int> bounds;
  double makespan = 0.0;            // simulated step
  std::vector<double> peak_bytes;   // per rank: activation peak + static bytes
  bool fits = true;                 // every rank within the budget
};

// Vocabulary parallelism in the plan (vocab.h): the head is no unit; every rank does its
// shard's S and T per microbatch (`model`, seconds and bytes per rank) and holds its shard's
// static bytes. A split is then scored on its program with the S and T passes placed
// (insert_vocab under the split's stage costs) and simulated with them.
struct VocabPlan {
  VocabModel model;
  std::vector<double> static_bytes;  // per rank (one value for all, or one per rank)
};

struct PartitionOptions {
  double comm = 0.0;              // cross-rank latency (seconds)
  const VocabPlan* vocab = nullptr;  // vocabulary parallelism (null: none)
  double memory_budget = 0.0;     // bytes per rank; <= 0: no budget
  // Enumerate every split of a program when there are at most this many (after the local
  // search, pruned by the work bound); beyond it the local search's answer stands.
  int64_t exhaustive_limit = 50'000;
  int64_t local_search_evals = 200;  // simulations the local search may spend per program
};

struct PartitionResult {
  int program = -1;               // index into the candidates; -1 when none fits
  SplitScore best;
  bool exact = true;              // every candidate's splits were enumerated
  int64_t simulated = 0;          // simulations run
  // The split of least max peak seen (what the budget would have to allow), for the error.
  int least_peak_program = -1;
  SplitScore least_peak;
  std::vector<SplitScore> per_program;  // the best split found for each candidate (makespan 0, fits false: none)
};

// Stage costs of a split scored on one program (the simulator with with_timeline=false).
SplitScore score_split(const Program& program, const UnitProfile& units, const std::vector<int>& bounds,
                       double comm, double memory_budget, const VocabPlan* vocab = nullptr);

// num_stages + 1 bounds giving each stage units / num_stages units, the first stages one more
// when it does not divide.
std::vector<int> even_bounds(int units, int num_stages);

// The least simulated step over every candidate program and split that fits the budget (ties:
// the first program, then the first split in enumeration order). ScheduleError when a program
// has more stages than there are units.
PartitionResult plan_partition(const std::vector<Program>& programs, const UnitProfile& units,
                               const PartitionOptions& options);

}  // namespace zbpipe
