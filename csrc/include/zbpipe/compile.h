// build -> insert_send_recv -> validate: the one entry point users call.
#pragma once

#include <cstdint>
#include <string>

#include "zbpipe/builders.h"
#include "zbpipe/program.h"

namespace zbpipe {

// Checks the request against the size limits (limits.h), then runs the schedule's builder:
// the compute-only program, not lowered or validated.
Program build(const std::string& schedule, const BuildArgs& args);
// The size check of a build request on the caller's 64-bit values (a binding runs it before
// narrowing them to BuildArgs' ints): stages count as pp x max(stages_per_rank, 1) here, and
// every builder checks its exact stage count again when it lays out the program.
void check_build_size(const std::string& schedule, int64_t pp, int64_t microbatches,
                      int64_t stages_per_rank);
// build, then lower; with args.vocab_parallel, then insert_vocab (vocab.h) and validate.
// Refuses options in args.given that the schedule does not use (check_options).
Program compile(const std::string& schedule, const BuildArgs& args);
// Lowers and validates a compute-only program from elsewhere (CSV, a user list).
Program lower(const Program& compute_only);

}  // namespace zbpipe
