// Ctrl-C during a step (the runtime's side of interrupt.h, which serves the core's long calls).
// A step's thread spends its time blocked in waits on peers, with the GIL released, where
// Python's own SIGINT handler cannot run. While a step runs on the main thread, Python's C-level
// signal handler also writes each signal's number to a pipe of ours (signal.set_wakeup_fd's
// mechanism); a watcher thread reading it calls `on_sigint` (Executor::interrupt), which aborts
// the step's waits, so the step ends within a poll interval and the binding raises
// KeyboardInterrupt (the handler's own exception). Bytes are passed on to the wakeup fd that
// was set before (asyncio's, for instance).
#pragma once

#include <functional>

namespace zbpipe::python {

// Contract: constructed and destroyed with the GIL held, on the thread that runs the step;
// does nothing off the main thread (Python delivers signals to the main thread only). Not
// nested. `on_sigint` runs on the watcher thread, never after the destructor returns.
class StepInterrupt {
 public:
  explicit StepInterrupt(std::function<void()> on_sigint);
  ~StepInterrupt();
  StepInterrupt(const StepInterrupt&) = delete;
  StepInterrupt& operator=(const StepInterrupt&) = delete;

 private:
  bool armed_ = false;
  int previous_fd_ = -1;  // the wakeup fd set before this step
};

}  // namespace zbpipe::python
