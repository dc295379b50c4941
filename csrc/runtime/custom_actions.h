// The interface of register_custom_function: a user function replacing how the actions of
// some kinds run (Executor::set_custom_actions, CustomRun in custom_run.h).
#pragma once

#include "zbpipe/action.h"

namespace zbpipe::runtime {

// The executor calls run(action) once per such action instead of its built-in computation,
// from its own thread, without the Python GIL. run must execute every compute part of the
// action (the action itself, or each sub-action of an OVERLAP_F_B) exactly once through
// Executor::run_part, in any order, and may do other work around them; it blocks as long as
// it likes (the step waits) and reports a failure by throwing (the step fails at the action).
class CustomActions {
 public:
  virtual ~CustomActions() = default;
  virtual void run(const Action& action) = 0;
};

}  // namespace zbpipe::runtime
