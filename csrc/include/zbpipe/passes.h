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

// Checks, throwing ScheduleError with the program grid and the offending action marked:
//  - shape: ranks == pp, stage_to_rank consistent, actions only on the rank owning the stage;
//  - each (stage, mb) runs F once and either B once or I then W once, nothing else;
//  - per rank, dependencies that are local hold in order (F before I/B before W, same-rank
//    neighbour stages in order);
//  - with comms: every SEND has its RECV, in the same order for each ordered rank pair, each
//    cross-rank compute has its RECV before it, and a blocking-receive run finishes.
void validate(const Program& p);

}  // namespace zbpipe
