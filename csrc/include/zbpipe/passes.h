// Pure Program -> Program passes (one file each under csrc/core/passes/).
#pragma once

#include "zbpipe/program.h"

namespace zbpipe {

// Lowers a compute-only program: after each compute whose result crosses ranks, a SEND on the
// producer and the matching RECV on the consumer. Stages on the same rank hand over directly
// (no comm). RECVs are placed so that a blocking-receive execution never deadlocks.
Program insert_send_recv(const Program& compute_only);

// Drops communication actions (the inverse view of insert_send_recv).
Program strip_comms(const Program& p);

// The forward-only variant of a compute-only program: its forwards in the same order and
// topology (OVERLAP_F_B pairs keep their F), for evaluation with any schedule.
Program strip_backward(const Program& compute_only);

// The shape every pass relies on before it indexes anything: pp, stages and microbatches >= 1,
// one action list per rank, and stage_to_rank with one rank in [0, pp) per stage. Throws
// ScheduleError; insert_send_recv and validate run it first.
void check_shape(const Program& p);

// Checks, throwing ScheduleError with the program grid and the offending action marked:
//  - shape: ranks == pp, stage_to_rank consistent, actions only on the rank owning the stage;
//  - each (stage, mb) runs F once and either B once or I then W once, nothing else;
//  - per rank, dependencies that are local hold in order (F before I/B before W, same-rank
//    neighbour stages in order);
//  - with comms: every SEND has its RECV, in the same order for each ordered rank pair, each
//    cross-rank compute has its RECV before it, and a blocking-receive run finishes.
void validate(const Program& p);

// How the runtime posts one rank's communication: each maximal run of adjacent SEND/RECV
// actions is one batch (one coalesced group), except that with `split_overlap` a run right
// after an OVERLAP_F_B that opens with the SEND_F of the unit's F half posts that send alone
// first (it goes out as soon as F finishes, while the unit's backward half still runs; also
// when it is the whole run).
// Ranges of action indices, in program order.
struct CommBatch {
  int begin = 0, end = 0;
  bool after_f_half = false;  // the split-off SEND_F: posted when the unit's F half finishes
};
std::vector<CommBatch> comm_batches(const std::vector<Action>& acts, bool split_overlap);

// The rendezvous check of a lowered, validated program: runs it under the rules of a
// stream-ordered backend such as NCCL, where each batch (comm_batches) is one group posted
// atomically on a stream of its own rank (groups in program order, each after the compute
// before it), a send completes only once its receive's group is running, and a compute waits
// for the whole group holding its receive. Throws ScheduleError (grid marked) on a deadlock
// that validate()'s buffered-send run cannot see, for both settings of split_overlap. The
// vocabulary collectives run on a communicator of their own and the head's actions on a lane of
// their own, as the executor runs them (validate_rendezvous.cpp, vocab_run.h).
void validate_rendezvous(const Program& p);

}  // namespace zbpipe
