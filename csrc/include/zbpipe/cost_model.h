// Per-stage execution costs fed to the simulator and to cost-driven builders.
#pragma once

#include <vector>

namespace zbpipe {

// Each vector holds one value per stage, or a single value that applies to every stage.
// f: forward, b: backward-input (I), w: backward-weight (W), b_full: full backward B
// (empty = b + w), comm: latency of one cross-rank transfer.
struct CostModel {
  std::vector<double> f{1.0};
  std::vector<double> b{1.0};
  std::vector<double> w{1.0};
  std::vector<double> b_full{};
  double comm = 0.0;

  double forward(int stage) const;
  double backward_input(int stage) const;
  double backward_weight(int stage) const;
  double backward_full(int stage) const;
  // Checks sizes (1 or num_stages) and finite non-negative values, and that a program of this
  // shape cannot overflow a time: its total work (every action's cost and two transfers per
  // (stage, microbatch)) times pp stays within kMaxTotalTime. Throws ScheduleError.
  void check(int num_stages, int microbatches, int pp) const;
};

// Any time the simulator or a search computes is at most the program's total work; bubble
// rates multiply it by pp and the search's bounds add a few such sums, so this leaves them
// finite with room to spare.
inline constexpr double kMaxTotalTime = 1e300;

}  // namespace zbpipe
