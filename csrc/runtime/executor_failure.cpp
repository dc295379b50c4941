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
  // Accelerators, or a backend modelling one: their communicators end a collective in flight
  // only when aborted. (Gloo cannot abort one: the replicas' meetings keep them out of it.)
  const bool abort_groups = p2p_->aborts_group();
  // A peer's failure, in a step or between steps: this rank's waits end now, and so does a
  // collective of the trainer's own blocked on these groups (an all-reduce after the step).
  const auto ids = failures_.start_watch(p2p_->store(), p2p_->size(), groups, [p2p, groups, links = links_, abort_groups] {
    p2p->abort_all();
    links->abort_all();
    if (abort_groups)
      for (const auto& g : groups) {
        try {
          g->abort();
        } catch (const std::exception&) {
        }
      }
  });
  if (!ids) return;
  replica_groups_.clear();
  for (size_t i = 0; i < groups.size(); ++i)  // the watch's channel i + 1
    replica_groups_.push_back(std::make_shared<ReplicaGroup>(groups[i], *failures_.watch(), i + 1,
                                                             detail::str("zbpipe/x", (*ids)[i], "/control/"),
                                                             options_.control_group, *links_));
  for (auto& st : stages_) {  // each stage's replicas meet on its groups
    st.replicas.clear();
    for (const auto& g : st.sync_groups)
      st.replicas.emplace_back(replica_groups_[std::find(groups.begin(), groups.end(), g) - groups.begin()], st.stage);
  }
}

void Executor::open_vocab_collectives() {
  if (!vocab_ || vocab_collectives_ || !p2p_->stream_ordered() || program_.pp == 1) return;
  const std::string name = detail::str("zbpipe/x", failures_.id(), "/vocab/");
  const auto& pipeline = p2p_->group();
  c10::intrusive_ptr<c10d::ProcessGroup> group = options_.vocab->collective_group(pipeline, name, options_.timeout);
  if (!group) {
    c10::intrusive_ptr<c10d::Backend> backend;
    try {
      backend = pipeline->getBackend(c10::DeviceType::CPU);
    } catch (const std::exception&) {
    }
    if (auto* own = dynamic_cast<ProvidesControlGroups*>(backend.get())) group = own->control_group(name);
  }
  ZB_SCHEDULE_CHECK(group, "the vocabulary-parallel head's collectives need a process group of their own on this "
                    "stream-ordered backend (", p2p_->backend_name(), "), of the pipeline's ranks: give "
                    "VocabParallelOutput(..., collective_group=dist.new_group(ranks))");
  ZB_SCHEDULE_CHECK(group->getSize() == pipeline->getSize() && group->getRank() == pipeline->getRank(),
                    "the vocabulary head's collective group has rank ", group->getRank(), " of ", group->getSize(),
                    ", the pipeline group ", pipeline->getRank(), " of ", pipeline->getSize(),
                    ": it must hold the pipeline's ranks in the same order");
  P2POptions options;
  options.stream_ordered = true;
  vocab_collectives_ = std::make_shared<P2P>(group, p2p_->device(), options);
  links_->add(vocab_collectives_);  // aborted and abandoned with the rest of the communication
  vocab_->set_collectives(*vocab_collectives_);
}

P2P& Executor::control() {
  if (!control_) {
    control_ = open_control(p2p_->group(), detail::str("zbpipe/x", failures_.id(), "/control/"),
                            options_.control_group, options_.timeout);
    links_->add(control_);
  }
  return *control_;
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
  const StepFailures::Report report = failures_.publish(index, ex, prefix);  // the peers learn it first
  abort_communication();
  abandon_in_flight();
  StepFailures::raise(report);
}

void Executor::abandon_in_flight() {
  if (overlap_.worker && overlap_.worker->busy()) {  // it uses the step's slots: let it finish first
    try {
      overlap_.worker->join();
    } catch (...) {
    }
  }
  overlap_.index = -1;
  // The vocabulary head's lane (a thread on hosts without streams) waits on its collectives'
  // P2P: it ends (its waits were aborted) before that P2P's batches are abandoned.
  if (vocab_) vocab_->end();
  comms_->abandon();
  links_->abandon_all();
  clear_slots();
}

void Executor::abort_communication() {
  p2p_->abort_all();
  links_->abort_all();
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
  if (embed_) embed_->end();
}

void Executor::interrupt() {
  failures_.interrupt();  // wakes a wait on the watch (the program agreement, a first meeting)
  p2p_->abort_all();      // a wait blocked now returns; the step then fails as interrupted
  links_->abort_all();
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
