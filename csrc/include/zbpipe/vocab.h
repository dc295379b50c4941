// Vocabulary parallelism in the program: the LM head and its loss split by vocabulary rows over
// every pipeline rank (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary
// Parallelism", MLSys 2025; its "Vocab-1" variant: one all-reduce barrier per microbatch in the
// forward). Rank r holds shard r of the head; its vocabulary actions carry r as their leading
// number ("1S0" is shard 1's S pass of microbatch 0, run on rank 1).
//
// Per microbatch m (the root is the rank of the last stage, whose output feeds the head):
//   BCAST_F m      every rank: the last stage's output (the head's input) broadcast from the root
//   S m            every rank: its shard's logits, their max and sum of exponentials and the
//                  target's logit, the shard's softmax (kept for T) and its part of the input
//                  gradient under its own statistics
//   ALLREDUCE_S m  every rank: every shard's statistics to every rank (the one barrier)
//   REDUCE_B m     every rank: its input-gradient part rescaled by the global statistics, summed
//                  onto the root, where the last stage's backward of m starts from it
//   T m            every rank: its shard's weight (and bias) gradient
// A forward-only program (eval) has BCAST_F, S and ALLREDUCE_S only (the losses).
//
// The rule every pass, the simulator and the executor read (dependencies.h's, extended):
//   on the root, F of the last stage for m runs before its BCAST_F m;
//   S m needs BCAST_F m posted on every rank; ALLREDUCE_S m comes after S m on its rank;
//   REDUCE_B m (its post: it rescales by the global statistics) and T m need ALLREDUCE_S m
//   posted on every rank; on the root, the backward (B or I) of the last stage for m needs
//   REDUCE_B m posted on every rank.
// A collective completes once every rank has posted it, and every rank posts the collectives in
// the same order (a process group matches collectives by their order).
#pragma once

#include <cstdint>
#include <vector>

#include "zbpipe/action.h"
#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/program.h"

namespace zbpipe {

// The vocabulary head's costs and memory, per rank (one value for all, or one per rank).
struct VocabModel {
  std::vector<double> s{1.0};  // S pass time
  std::vector<double> t{1.0};  // T pass time
  double collective = 0.0;     // latency of a collective, from its last post to its completion
  // Memory an S holds until its T (its shard's softmax and the head's input), in the memory
  // model's units (memory_model.h); empty: none.
  std::vector<double> mem_s{};
  // Placement only: the most microbatches a rank holds between their S and their T.
  int backlog = 2;
  // Placement only (reorder_for_vocab): the forwards a rank may run ahead of its schedule's
  // order while it would otherwise wait for the head, each holding one more microbatch's
  // activations until its backward. 0 keeps the schedule's order.
  int lookahead = 2;

  double s_time(int rank) const;
  double t_time(int rank) const;
  double memory(int rank) const;
  // Checks sizes (1 or pp values), finite non-negative values, backlog >= 1 and lookahead >= 0;
  // ScheduleError.
  void check(int pp) const;
};

// Which pass a rank runs first when the S of its next microbatch and its own next compute could
// both start (the placement's one free choice besides T, which always fills idle time):
enum class VocabPriority : uint8_t {
  kVocabFirst,     // the S: the last stage's backward waits for every rank's
  kBackwardFirst,  // its own backward (the pipeline's backward chain), else the S
  kOwnFirst,       // its own compute
};

// How the placement decides (insert_vocab, reorder_for_vocab): the priority, and `lag`: how
// many microbatches' broadcasts may go out before a reduction (the collective order is, per
// microbatch m, BCAST_F m, ALLREDUCE_S m, REDUCE_B m - lag). A lag of 1 lets every rank start
// the S of m + 1 before the reduction of m, where the last stage runs a forward ahead of its
// backward.
struct VocabPolicy {
  VocabPriority priority = VocabPriority::kVocabFirst;
  int lag = 0;
};

// Whether the program has vocabulary actions.
bool has_vocab(const Program& p);
// The rank of the last stage: the broadcast's source and the reduction's destination.
inline int vocab_root(const Program& p) { return p.rank_of(p.num_stages - 1); }
// Whether compute part `part` starts from the vocabulary head's gradient: the backward (B or I)
// of the last stage, in a training program with vocabulary actions.
inline bool needs_vocab_grad(const Program& p, const Action& part) {
  return is_backward(part.kind) && part.stage == p.num_stages - 1;
}

// The vocabulary pass: a lowered training (or forward-only) program without vocabulary actions
// gains every rank's S, T and collectives, placed by a simulation of the program under `costs`
// and `vocab`: at each moment a rank runs an S whose input has arrived before its own next
// compute, its own compute before a T (T fills the rank's idle time, as W does), and a T before
// its own compute once `backlog` microbatches wait between S and T; each collective is posted as
// soon as its turn (the order BCAST_F m, ALLREDUCE_S m, REDUCE_B m, then m + 1) and its input
// allow. The base program's actions keep their order. Throws ScheduleError for a program that
// already has vocabulary actions, or if the placement finds no way on (the grid marked).
Program insert_vocab(const Program& lowered, const CostModel& costs, const VocabModel& vocab,
                     const VocabPolicy& policy = {});

// Before lowering: the compute-only program's order with forwards moved ahead where the same
// timed run (with S and T placed as insert_vocab places them) finds a rank waiting, at most
// `vocab.lookahead` ahead per rank (the schedules whose last stage runs each backward right
// after its forward, 1F1B's, would otherwise wait for every rank's S each microbatch; the
// paper's Vocab-1 runs the last stage ahead the same way). The result has no vocabulary
// actions; compile() lowers it and then runs insert_vocab.
Program reorder_for_vocab(const Program& compute_only, const CostModel& costs, const VocabModel& vocab,
                          const VocabPolicy& policy = {});

// compile()'s vocabulary step: a compute-only program without vocabulary actions gets them as
// reorder_for_vocab, lowering and insert_vocab place them, under each of a few policies (S or
// the rank's own backward first; forwards ahead 0 or vocab.lookahead; lag 0 or 1, skipped
// where the order cannot keep it), each simulated under
// `costs`, `memory` and `vocab`; the least makespan wins (ties: the first tried). Lowered, not
// validated.
Program place_vocab(const Program& compute_only, const CostModel& costs, const VocabModel& vocab,
                    const MemoryModel& memory = {});

}  // namespace zbpipe
