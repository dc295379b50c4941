// Ranks agree on the program before they run it: each publishes a fingerprint of its program
// (schedule, pp, stages, microbatches, stage placement, a hash of every rank's action list,
// and the options both ends must share) in the process group's store and compares it with
// every peer's, so a rank built with another schedule or microbatch count fails every rank at
// once, naming both sides, instead of hanging on messages that never match.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "zbpipe/program.h"

namespace c10d {
class Store;
}

namespace zbpipe::runtime {

class FailureWatch;

// Readable and complete: "schedule=1f1b pp=2 stages=2 microbatches=4 stage_to_rank=[0,1]
// actions=#89ab... static_shapes=0".
std::string program_fingerprint(const Program& p, bool static_shapes);

// Publishes `fingerprint` under `key_prefix` and waits (bounded by `timeout`, polling the
// store; a failure published meanwhile through `watch` ends the wait) for every peer's. Between
// polls (at most 50 ms apart) calls `check`, which throws to give up (Ctrl-C: the executor's
// interrupt). Throws PipelineError on a mismatch (naming this rank's and the first differing
// rank's values), on a timeout (naming the ranks whose program never came) or on a peer's
// failure; what `check` throws.
void agree_on_program(c10d::Store& store, const std::string& key_prefix, int rank, int size,
                      const std::string& fingerprint, std::chrono::milliseconds timeout,
                      FailureWatch& watch, const std::function<void()>& check);

}  // namespace zbpipe::runtime
