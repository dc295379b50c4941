// After a failure: the step's teardown (nothing in flight is freed under a late message) and
// the report every rank throws, naming the rank, action and cause with the program grid marked.
#include "runtime/errors.h"
#include "runtime/executor.h"

namespace zbpipe::runtime {

void Executor::fail_step(int index, const std::string& what) {
  abandon_in_flight();
  throw PipelineError(failure_report(index, what));
}

void Executor::abandon_in_flight() {
  if (worker_ && worker_->busy()) {  // it uses the step's slots: let it finish first
    try {
      worker_->join();
    } catch (...) {
    }
  }
  worker_index_ = -1;
  part_ = CustomRun{};
  comms_->abandon();
  clear_slots();
}

void Executor::clear_slots() {
  for (auto& st : stages_) st.slots.assign(st.slots.size(), Slot{});
}

std::string Executor::failure_report(int index, const std::string& what) {
  broken_ = true;
  const auto& acts = program_.ranks[rank_];
  std::string action = index >= 0 && index < static_cast<int>(acts.size()) ? to_string(acts[index])
                       : index == kStepStart                                 ? "(start of step)"
                                                                             : "(end of step)";
  // A peer's failure seen first is the cause: name it (and what it did here); otherwise this
  // rank's failure is the one every peer is told about.
  std::optional<StepFailure> cause = watch_ ? watch_->seen() : std::nullopt;
  if (!cause && watch_) {
    StepFailure stands = watch_->report(StepFailure{rank_, action, steps_, what});
    if (stands.rank != rank_) cause = stands;
  }
  std::string why = what;
  if (cause) {
    why = cause->describe();
    if (what.find(why) == std::string::npos) why += detail::str("\n  (on this rank: ", what, ")");
  }
  return detail::str(
      "zbpipe: rank ", rank_, " failed at action ", action, " (index ", index, ") of schedule '",
      program_.schedule, "' (pp=", program_.pp, ", stages=", program_.num_stages,
      ", microbatches=", program_.microbatches, "):\n  ", why,
      "\nprogram (failing action marked >> <<):\n", format_program(program_, rank_, index));
}

void Executor::report_failure(const std::string& what) {
  if (broken_) return;
  try {
    ensure_watch();
  } catch (const std::exception&) {
  }
  broken_ = true;
  if (watch_) watch_->report(StepFailure{rank_, "(before the step)", steps_ + 1, what});
}

}  // namespace zbpipe::runtime
