// build -> insert_send_recv -> validate: the one entry point users call.
#pragma once

#include <string>

#include "zbpipe/builders.h"
#include "zbpipe/program.h"

namespace zbpipe {

// Refuses options in args.given that the schedule does not use (check_options).
Program compile(const std::string& schedule, const BuildArgs& args);
// Lowers and validates a compute-only program from elsewhere (CSV, a user list).
Program lower(const Program& compute_only);

}  // namespace zbpipe
