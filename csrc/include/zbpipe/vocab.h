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
//
// The input embedding, split the same way (the paper's input layer; optional, alone or with the
// head): rank r holds shard r of the embedding's rows; the embedding root is stage 0's rank.
// Per microbatch m:
//   E m            every rank: its shard's lookup of m's tokens (zeros off its rows)
//   REDUCE_E m     every rank: the lookups summed onto the embedding root: stage 0's input
//   BCAST_E m      every rank: stage 0's input gradient broadcast from the embedding root
//   EW m           every rank: its rows' weight gradient (weight-gradient-only: it fills idle
//                  time as W does)
// A forward-only program has E and REDUCE_E only. The rule: REDUCE_E m comes after E m on its
// rank; F of stage 0 for m needs REDUCE_E m posted on every rank; on the embedding root, the
// backward (B or I) of stage 0 for m runs before its BCAST_E m; EW m needs BCAST_E m posted on
// every rank. The embedding's collectives share the head's one order.
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
  // The input embedding's E and EW pass times (per rank; by default a tenth of a forward).
  std::vector<double> e{0.1};
  std::vector<double> ew{0.1};
  // Placement only: the most microbatches a rank holds between their S and their T.
  int backlog = 2;
  // Placement only (reorder_for_vocab): the forwards a rank may run ahead of its schedule's
  // order while it would otherwise wait for the head, each holding one more microbatch's
  // activations until its backward. 0 keeps the schedule's order.
  int lookahead = 2;

  double s_time(int rank) const;
  double t_time(int rank) const;
  double memory(int rank) const;
  double e_time(int rank) const;
  double ew_time(int rank) const;
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

// Whether the program has vocabulary actions (the head's or the embedding's).
bool has_vocab(const Program& p);
// Which of the two a program has: the head (S, T, BCAST_F, ALLREDUCE_S, REDUCE_B) and the
// input embedding (E, EW, REDUCE_E, BCAST_E).
struct VocabParts {
  bool head = false, embedding = false;
};
VocabParts vocab_parts(const Program& p);
// The rank of stage 0: the embedding's reduction's destination and its broadcast's source.
inline int embedding_root(const Program& p) { return p.rank_of(0); }
// Whether compute part `part` takes the embedding's reduced output: an F of stage 0.
inline bool needs_embedding(const Action& part) { return part.kind == Kind::F && part.stage == 0; }
// Whether compute part `part` gives the embedding its gradient: a backward of stage 0.
inline bool feeds_embedding(const Action& part) { return is_backward(part.kind) && part.stage == 0; }
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

// compile(..., vocab_embedding=True)'s pass: a lowered program (with or without the head's
// vocabulary actions, training or forward-only) without embedding actions gains every rank's E,
// REDUCE_E and, training, BCAST_E and EW, by a run of the program under `costs`, `memory` and
// `vocab`: REDUCE_E m is due when the root starts its F of stage 0 for m - 2 (the first two at
// the start: the reduction overlaps two forwards), BCAST_E m when the root's backward of stage
// 0 for m ends; they join the head's collectives in one order by that time. Each rank posts each
// one when it is due, or earlier where a later collective or a RECV comes first (a post never
// blocks; behind a blocking RECV it could wait on what waits for it), E right before its
// REDUCE_E; the root's BCAST_E follows its backward (the head's posts after it in the order wait
// with it). Each EW m then goes before the rank's first compute that a second run starts after
// BCAST_E m completed; where that program does not validate (the simulator passes a RECV at
// once, a blocking run waits), every EW stays at its rank's end. Throws ScheduleError for a
// program that already has embedding actions, a compute-only one, or one without a stage on
// every rank.
Program insert_embedding(const Program& lowered, const CostModel& costs, const VocabModel& vocab,
                         const MemoryModel& memory = {});

}  // namespace zbpipe
