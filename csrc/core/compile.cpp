// The compile pipeline: build (compute only) -> insert_send_recv -> validate.
#include "zbpipe/compile.h"

#include "zbpipe/error.h"
#include "zbpipe/passes.h"

namespace zbpipe {

Program lower(const Program& compute_only) {
  ZB_SCHEDULE_CHECK(!compute_only.has_comms(), "lower() expects a compute-only program, but '",
                    compute_only.schedule, "' already has communication actions");
  Program lowered = insert_send_recv(compute_only);
  validate(lowered);
  return lowered;
}

Program compile(const std::string& schedule, const BuildArgs& args) {
  const ScheduleInfo& info = find_schedule(schedule);
  check_options(info, args);
  return lower(info.build(args));
}

}  // namespace zbpipe
