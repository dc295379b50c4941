// Greedy list scheduler shared by the cost-driven builders (zb_auto, v_half, v_min): it plays
// the pipeline forward in time under the simulator's cost model and, whenever a rank is free,
// picks its next F / I / W by a small policy, never exceeding a per-rank memory cap.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/program.h"
#include "zbpipe/simulator.h"

namespace zbpipe::detail {

// The hyper-parameters of the Zero Bubble paper's heuristic (Qi et al. 2023, section 3.1),
// one value each; search_list_schedules() tries a small grid of them.
struct ListPolicy {
  enum class Order { kBackwardFirst, kForwardFirst, kAlternate };
  // When both an I and an F are ready: which goes first (kAlternate: not the kind run last).
  Order order = Order::kBackwardFirst;
  // An idle gap is filled with a W when gap >= fill_ratio * T_W; a negative value never fills
  // (W then runs only to free memory, or once the rank has nothing else left).
  double fill_ratio = 1.0;
  // The paper's binary warm-up knob: do not start an F that would delay a backward whose input
  // arrives before that F could end; idle (or fill with a W) instead.
  bool avoid_delaying_backward = false;
  // When a forward is held back only by the memory cap, run a W first even if an I is ready
  // (with this, a full rank behaves like 1F1B, whose B is I + W).
  bool recycle_first = false;
  // With several stages per rank: among ready forwards prefer the later stage (depth first).
  bool deep_first = true;
};

// The knobs a search enumerates; the warm-up vector (the warm-up depth per rank, see the
// memory note below) is one of them.
enum Knob : int { kWarmup, kOrder, kFill, kAvoid, kRecycle, kDeep, kNumKnobs };

// The values each knob takes in a search, in the order candidates are tried.
struct PolicyGrid {
  std::vector<std::vector<int>> warmups;  // one value per rank each
  std::vector<ListPolicy::Order> orders;
  std::vector<double> fills;
  std::vector<bool> avoids, recycles, deeps;
  int size(Knob k) const;
  // The Zero Bubble heuristic's grid under the given warm-up vectors: every order, fill ratios
  // {0, 1/2, 1, never}, both binary knobs, and depth-first only with several stages per rank.
  static PolicyGrid standard(std::vector<std::vector<int>> warmups, bool several_stages_per_rank);
};

// One grid point: the index of each knob's value.
using PolicyIndex = std::array<int, kNumKnobs>;

// A product set of grid points: bit i of bits[k] stands for value i of knob k (<= 32 values).
struct PolicySet {
  std::array<uint32_t, kNumKnobs> bits{};
  static PolicySet all(const PolicyGrid& g);
};

// The simulator's numbers for the program a run built (zbpipe::simulate's arithmetic, in the
// same order, so they are equal to the last bit), or complete=false when the run stopped early
// because its objective could no longer stay within the bound it was given.
struct ListRunResult {
  bool complete = false;
  double makespan = 0.0, max_span = 0.0, bubble_rate = 0.0;
  std::vector<double> peak_memory;  // per rank
};

// Memory accounting is the simulator's (memory_model.h: F adds mem_f at its start, I frees
// mem_f - mem_w and W frees mem_w at their ends); every rank stays within cap[r]. With 2 stages
// per rank (V), a microbatch enters a rank only if it leaves room for one more F: the
// later-stage F that the oldest admitted microbatch still owes runs first (stages run F in
// microbatch order), that microbatch then needs no more memory to finish its backward and W, so
// a full rank never deadlocks. 1 or 2 stages per rank; cap[r] holds at least one microbatch of
// each of the rank's stages. The warm-up vector additionally bounds, per rank, the
// (stage, microbatch) units held before a microbatch enters a rank that has not run its first
// backward yet (the warm-up depth; nothing is freed before it, so units count forwards).
//
// A run stops (complete=false) as soon as a lower bound of its objective exceeds
// bound.objective_bar or one of the other metric exceeds bound.other_bar: a rank's last end is
// at least its clock plus its remaining work, or its last microbatch's drain (one stage per
// rank, or a V rank under whole-microbatch memory, where the cap also forces one round trip per
// cap - 1 microbatches: [Note: the V chain bound]), and rank 0's at least a later rank's last I
// plus that microbatch's way back; a span is a last end less the rank's first start.
struct RunBound {
  Objective objective = Objective::kMakespan;
  double objective_bar = std::numeric_limits<double>::infinity();
  double other_bar = std::numeric_limits<double>::infinity();
};

namespace list_run {
class ListScheduler;
}

// The run of every grid point of a product set at once: the search's unit of work. It plays
// the set's first point (the lowest value of every knob); a knob check on which the set's
// points disagree splits it, and the points that decide otherwise leave as a fork, a run of
// their own that resumes from that moment under its own first point. Every point left in a
// run's set when it ends builds exactly its program (or stops where it stopped), so a prefix
// common to many grid points is played once.
class ListRun {
 public:
  ListRun(const Program& shell, const CostModel& costs, const MemoryModel& memory,
          const std::vector<double>& cap, const PolicyGrid& grid, const PolicySet& set);
  explicit ListRun(std::unique_ptr<list_run::ListScheduler> run);
  ListRun(ListRun&&) noexcept;
  ListRun& operator=(ListRun&&) noexcept;
  ~ListRun();

  // Plays on to the end or until `bound` stops the run; forks made on the way are appended to
  // `forks`. The inputs given at construction must outlive the run and its forks.
  ListRunResult play(const RunBound& bound, std::vector<ListRun>& forks);
  const PolicySet& set() const;       // the grid points still in the run
  const PolicyIndex& policy() const;  // the one it plays: the set's first
  // Moves the compute order into `into` (which has the shell's topology).
  void take_program(Program& into);

 private:
  std::unique_ptr<list_run::ListScheduler> run_;
};

// A fixed schedule's compute-only program offered to the search, and how much it binds it: a
// reference is one the pick must match, the primary one (a reference; of several seeds marked
// primary, the last that fits the cap) one it must match even when no candidate matches all.
struct Seed {
  enum class Role { kCandidate, kReference, kPrimary };
  Program program;
  Role role = Role::kCandidate;
  bool must_fit = false;  // the builder guarantees it fits the cap: a breach is an internal error
  // The simulator's numbers for `program`, when its builder timed it the simulator's way (the
  // search then skips the simulation, except in exhaustive mode, which always simulates).
  ListRunResult timing{};
};

// Plays every point of the grid (ListRun), scores each candidate with the simulator's
// numbers and returns the best. Seeds that fit the cap (on the same topology) are candidates
// too. The pick matches or beats, on both makespan and longest span (bubble rate is monotone in
// it; under Objective::kSpan on the span alone), every fitting reference if some candidate
// does; failing that, the primary one (it is a candidate itself, so this always holds when it
// fits). Within that pool: lowest
// worst ratio to any reference on either metric, then the objective (makespan, or longest
// span), the other one, bubble rate and total peak memory; among equals the first tried.
// Makespan and span can disagree (a schedule may end later on the last rank yet keep every
// rank's span shorter), which is why both are compared.
//
// The pick is the one an exhaustive run of the grid would make, found with less work: the
// grid is played as one run that forks where a knob check splits it (ListRun), so grid points
// that no check tells apart build one program and a prefix common to several is played once;
// once some candidate matches every reference, a run stops as soon as it can no longer reach
// that candidate's objective (or, once that objective sits at `floor`, where nothing can beat
// it, its other metric); only the best candidate is kept; the runs are shared out among
// `threads` workers (0: one per CPU this process may use, at most 8), which pick the same
// program as one. `exhaustive` runs every grid point to the end on one thread and scores
// it with zbpipe::simulate instead (the reference the savings are checked against).
struct SearchMode {
  bool exhaustive = false;
  int threads = 0;
  Objective objective = Objective::kMakespan;
  double floor = 0.0;  // a lower bound of the objective over every program (0: none known)
};
Program search_list_schedules(const Program& shell, const CostModel& costs,
                              const MemoryModel& memory, const std::vector<double>& cap,
                              const PolicyGrid& grid,
                              const std::vector<Seed>& seeds, const SearchMode& mode = {});

}  // namespace zbpipe::detail
