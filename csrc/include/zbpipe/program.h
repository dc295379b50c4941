// A Program: topology (stage -> rank) plus one ordered action list per rank.
#pragma once

#include <cstddef>
#include <cstdint>
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

// What a program does, readable: "pp=2 stages=2 microbatches=4 stage_to_rank=[0,1]
// actions=#89ab..." (the action lists as a 64-bit FNV-1a hash of their canonical strings). The
// schedule's name is left out: it is a label, and zb_auto may build zb_h1's very program. The
// runtime's program agreement adds the name and its options (runtime/program_agreement.h);
// Python's Program.__eq__ is same_program, its __hash__ this text's hash.
std::string fingerprint(const Program& p);
// Equal topology, microbatches and action lists (the name aside, as fingerprint).
bool same_program(const Program& a, const Program& b);

}  // namespace zbpipe
