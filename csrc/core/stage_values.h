// Per (stage, compute kind): its duration under the cost model and what it adds and frees under
// the memory model (memory_model.h), read once per program for the inner loops of the
// simulator, the list scheduler, the paper heuristic and the refinement.
#pragma once

#include <vector>

#include "zbpipe/action.h"
#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"

namespace zbpipe::detail {

class StageTable {
 public:
  struct Row {
    double duration = 0.0, added = 0.0, freed = 0.0;
  };

  StageTable(int num_stages, const CostModel& costs, const MemoryModel& memory)
      : rows_(static_cast<size_t>(num_stages) * kNumKinds) {
    for (int s = 0; s < num_stages; ++s) {
      const double times[] = {costs.forward(s), costs.backward_full(s), costs.backward_input(s),
                              costs.backward_weight(s)};
      const Kind kinds[] = {Kind::F, Kind::B, Kind::I, Kind::W};
      for (int k = 0; k < 4; ++k) {
        const Action a(s, kinds[k], 0);
        rows_[index(s, kinds[k])] = {times[k], memory.added_at_start(a), memory.freed_at_end(a)};
      }
    }
  }

  // Communication kinds take no time and hold nothing.
  const Row& of(int stage, Kind k) const { return rows_[index(stage, k)]; }
  const Row& of(const Action& a) const { return of(a.stage, a.kind); }
  // The durations the schedulers read most.
  double f(int s) const { return of(s, Kind::F).duration; }
  double b(int s) const { return of(s, Kind::I).duration; }
  double w(int s) const { return of(s, Kind::W).duration; }
  // What a forward of stage s adds (mem_f).
  double held_by_forward(int s) const { return of(s, Kind::F).added; }

 private:
  static size_t index(int s, Kind k) {
    return static_cast<size_t>(s) * kNumKinds + static_cast<int>(k);
  }
  std::vector<Row> rows_;
};

}  // namespace zbpipe::detail
