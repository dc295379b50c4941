// A Program: topology (stage -> rank) plus one ordered action list per rank.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "zbpipe/action.h"

namespace zbpipe {

struct Program {
  std::string schedule;             // builder name ("zbv", "csv", ...), for messages
  int pp = 0;                       // pipeline ranks
  int num_stages = 0;               // global stages
  int microbatches = 0;
  std::vector<int> stage_to_rank;   // index = stage
  std::vector<std::vector<Action>> ranks;  // index = rank; compute-only or lowered

  int rank_of(int stage) const { return stage_to_rank[stage]; }
  std::vector<int> stages_of(int rank) const;  // ascending
  bool has_comms() const;
};

// Per-rank columns, one row per step, like PyTorch's _format_pipeline_order; the action at
// (mark_rank, mark_index) is wrapped in ">> <<" so error messages point at it. A program
// beyond kGridRanks ranks or kGridSteps steps shows the window around the mark (the first
// ranks / steps without one), with a line saying what is left out.
inline constexpr size_t kGridRanks = 32;
inline constexpr size_t kGridSteps = 64;
std::string format_program(const Program& p, int mark_rank = -1, int mark_index = -1);

}  // namespace zbpipe
