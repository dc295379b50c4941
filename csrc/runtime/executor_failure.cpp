// The executor's side of a failure (StepFailures keeps the rest: step_failure.h): setting up the
// failure watch with the meeting points of the data-parallel replicas, meeting them, and after
// a failure the step's teardown, in which nothing in flight is freed under a late message.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "runtime/executor.h"

namespace zbpipe::runtime {

void Executor::ensure_watch() {
  if (failures_.watch()) return;
  std::vector<std::shared_ptr<c10d::ProcessGroup>> groups;  // each data-parallel group once, in the stages' order
  for (const auto& st : stages_)
    for (const auto& g : st.sync_groups)
      if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  P2P* p2p = p2p_.get();
  const bool host = p2p_->device().is_cpu();
  const auto ids = failures_.start_watch(p2p_->store(), groups, [p2p, groups, host] {
    p2p->abort_all();
    // Accelerators: a data-parallel collective in flight ends only with its communicator.
    // (Gloo cannot abort one: the replicas' barrier keeps them out of it instead.)
    if (!host)
      for (const auto& g : groups) {
        try {
          g->abort();
        } catch (const std::exception&) {
        }
      }
  });
  if (!ids) return;
  for (auto& st : stages_) {  // each stage's replicas meet under its group's executor id
    st.replicas.clear();
    for (const auto& g : st.sync_groups) {
      const int64_t id = (*ids)[std::find(groups.begin(), groups.end(), g) - groups.begin()];
      st.replicas.emplace_back(g, detail::str("zbpipe/x", id, "/stage", st.stage, "/replicas"));
    }
  }
}

void Executor::meet_replicas(const Entry& e) {
  LocalStage& st = stages_[e.local];
  for (auto& r : st.replicas)
    r.arrive_and_wait(options_.timeout, [this] { failures_.check_stop(); },
                      detail::str("the data-parallel replicas of stage ", st.stage, " to reach its gradient sync"));
}

void Executor::meet_replicas_at_start() {
  for (auto& st : stages_)
    for (auto& r : st.replicas)
      r.arrive_at_step_start(options_.timeout, [this] { failures_.check_stop(); },
                             detail::str("the data-parallel replicas of stage ", st.stage, " to start step ",
                                         failures_.step()));
}

void Executor::fail_step(int index, const std::exception& ex, const char* prefix) {
  abort_communication();
  abandon_in_flight();
  failures_.fail(index, ex, prefix);
}

void Executor::abandon_in_flight() {
  if (overlap_.worker && overlap_.worker->busy()) {  // it uses the step's slots: let it finish first
    try {
      overlap_.worker->join();
    } catch (...) {
    }
  }
  overlap_.index = -1;
  comms_->abandon();
  clear_slots();
}

void Executor::abort_communication() {
  p2p_->abort_all();
  if (sync_.running < 0) return;
  for (const auto& g : stages_[sync_.running].sync_groups) {
    try {
      g->abort();  // NCCL: ends the collective's kernels; Gloo cannot abort (a no-op there)
    } catch (const std::exception&) {
    }
  }
  sync_.running = -1;
}

void Executor::clear_slots() {
  for (auto& st : stages_) st.slots.assign(st.slots.size(), Slot{});
  if (vocab_) vocab_->end();
}

void Executor::interrupt() {
  failures_.interrupt();
  p2p_->abort_all();  // a wait blocked now returns; the step then fails as interrupted
}

void Executor::report_failure(const std::string& what) {
  if (failures_.broken()) return;
  try {
    ensure_watch();
  } catch (const std::exception&) {
  }
  failures_.report(what);
}

}  // namespace zbpipe::runtime
