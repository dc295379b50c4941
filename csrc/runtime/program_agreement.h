// Ranks agree on the program before they run it: each sends a fingerprint of its program
// (schedule, pp, stages, microbatches, stage placement, a hash of every rank's action list,
// and the options both ends must share) into every peer's inbox (failure_watch.h) and compares
// it with every peer's, so a rank built with another schedule or microbatch count fails every
// rank at once, naming both sides, instead of hanging on messages that never match.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "zbpipe/program.h"

namespace zbpipe::runtime {

class FailureWatch;

// Readable and complete: "schedule=1f1b pp=2 stages=2 microbatches=4 stage_to_rank=[0,1]
// actions=#89ab... static_shapes=0".
std::string program_fingerprint(const Program& p, bool static_shapes);

// Sends `fingerprint` to every other rank of the pipeline group (the watch's channel 0, of
// `size` ranks, this rank `rank`) and waits, bounded by `timeout`, for every peer's. The wait
// blocks on the watch (no request while it waits), waking for each message, a failure seen,
// Ctrl-C (FailureWatch::wake, then `check`, which throws) and, past kAskAfter, to ask silent
// peers whether their process runs (kPingEvery). Throws PipelineError on a mismatch (naming
// this rank's and the first differing rank's values), on a timeout (naming the ranks whose
// program never came), on a peer that died ("no program from rank R: its process stopped"),
// when the store fails (naming it and its address), CommAborted on a peer's failure; what
// `check` throws.
void agree_on_program(FailureWatch& watch, int rank, int size, const std::string& fingerprint,
                      std::chrono::milliseconds timeout, const std::function<void()>& check);

}  // namespace zbpipe::runtime
