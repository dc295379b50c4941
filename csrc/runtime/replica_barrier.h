// The data-parallel replicas of a stage meet before its gradient sync. The sync is a collective
// on the stage's data-parallel group (DDP's all-reduce inside its last backward, FSDP2's
// reduce-scatter after it) that nothing bounds but that group's own timeout (30 min by
// default) and that Gloo cannot abort. So before it, every replica checks in and waits --
// against the step's deadline, giving up at once on a failure seen anywhere or on Ctrl-C --
// until every replica has: the collective starts only when all replicas reached it, and a
// replica that failed earlier in its step never leaves the others blocked inside it (they get
// its failure through the FailureWatch instead). The replicas also meet at the start of every
// training step, before the forwards' collectives.
//
// A meeting is a dissemination barrier (round k: a token to the replica 2^k ahead, one from the
// replica 2^k behind; ceil(log2 D) rounds). The first meeting on a group goes through the
// group's store, as messages into the replicas' inboxes (failure_watch.h); it shows every
// replica present, so the group's control group (control_group.h) opens right after it, and
// every later meeting goes through that: no store request per step.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/control_group.h"

namespace c10d {
class ProcessGroup;
class Store;
}

namespace zbpipe::runtime {

// A process group held where c10d's headers are not included (the executor's files): a
// shared_ptr whose deleter, made here, keeps the group's intrusive_ptr.
std::shared_ptr<c10d::ProcessGroup> share_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

class FailureWatch;

// The meetings of one data-parallel group's replicas, for one executor (shared by the barriers
// of its stages on that group). Not thread-safe: the executor's thread only.
class ReplicaGroup {
 public:
  // `group`: the data-parallel group; `watch`: the executor's, whose channel `channel` is that
  // group (the first meeting's messages); `control_name`: its control group's name
  // (open_control); `factory`, `links`: the executor's (they outlive this object). Does not
  // communicate.
  ReplicaGroup(std::shared_ptr<c10d::ProcessGroup> group, FailureWatch& watch, size_t channel,
               std::string control_name, const ControlGroupFactory& factory, ControlLinks& links);

  // Meets every replica at meeting `tag` (unique to a stage and kind of meeting, < 2^20), its
  // `round`-th (from 1). Between messages calls `check`, which throws to give up (a peer's
  // failure seen, an interrupt). Throws PipelineError naming a replica that did not come when
  // `timeout` passes first ("did not reach it within"), or when the store or the control group
  // fails; CommAborted on a peer's failure.
  void meet(int tag, int64_t round, std::chrono::milliseconds timeout, const std::function<void()>& check,
            const std::string& what);
  int size() const { return size_; }

 private:
  void meet_through_control(int tag, int64_t round, std::chrono::steady_clock::time_point deadline,
                            std::chrono::milliseconds timeout, const std::string& what);
  // Until `until`: throws CommAborted once a peer's failure is seen (see kReportGrace).
  void await_report(std::chrono::steady_clock::time_point until, const std::string& what);

  std::shared_ptr<c10d::ProcessGroup> group_;
  FailureWatch& watch_;
  size_t channel_;
  std::string control_name_;
  const ControlGroupFactory& factory_;
  ControlLinks& links_;
  std::shared_ptr<P2P> control_;  // after the first meeting
  std::vector<std::shared_ptr<Batch>> previous_sends_;  // the last meeting's tokens, completed at the next
  int rank_ = 0, size_ = 1;
};

// A meeting through the store: the dissemination barrier of ReplicaGroup::meet over the inboxes
// of `watch`'s channel `channel` (a group of `size`, this rank `rank`), bounded by `timeout`;
// throws as ReplicaGroup::meet does. What a group's first meeting is (and the control-plane
// benchmark's replicas' meeting).
void meet_through_store(FailureWatch& watch, size_t channel, int rank, int size, int tag, int64_t round,
                        std::chrono::milliseconds timeout, const std::function<void()>& check, const std::string& what);

// One stage's meeting points on one of its data-parallel groups. Not thread-safe.
class ReplicaBarrier {
 public:
  ReplicaBarrier(std::shared_ptr<ReplicaGroup> group, int stage) : group_(std::move(group)), stage_(stage) {}

  // Checks in for this rank's next sync and waits until every replica checked in for it (see
  // ReplicaGroup::meet).
  void arrive_and_wait(std::chrono::milliseconds timeout, const std::function<void()>& check,
                       const std::string& what);
  // The same at the start of each training step (a counter of its own): a stage's forwards
  // may run collectives on the group too (DDP's bucket rebuild at its second step and its
  // buffer broadcasts, FSDP2's all-gathers), so a replica that has not started the step (a
  // trainer that skipped it after an error) would leave the others blocked inside one.
  void arrive_at_step_start(std::chrono::milliseconds timeout, const std::function<void()>& check,
                            const std::string& what);

 private:
  std::shared_ptr<ReplicaGroup> group_;
  int stage_;
  int64_t round_ = 0;   // syncs met so far
  int64_t starts_ = 0;  // step starts met so far
};

// Bounds the collectives of the Gloo data-parallel groups by the schedule's timeout for one
// step: Gloo cannot abort a collective, and DDP/FSDP start theirs with the group's own timeout
// (30 min by default). Lowers each Gloo group's timeout to `timeout` (where it is larger) and
// restores it on destruction. Other backends are left alone: NCCL's communicators are aborted
// on a failure instead, and a lower NCCL timeout would let its watchdog end the process.
// `groups`: the ones with a Gloo backend (gloo_groups), resolved once per executor.
// The groups of `groups` that have a Gloo backend, each once (asked once per executor: c10d
// answers "no such backend" by throwing).
std::vector<std::shared_ptr<c10d::ProcessGroup>> gloo_groups(const std::vector<std::shared_ptr<c10d::ProcessGroup>>& groups);

class GlooTimeoutBound {
 public:
  GlooTimeoutBound(const std::vector<std::shared_ptr<c10d::ProcessGroup>>& groups, std::chrono::milliseconds timeout);
  ~GlooTimeoutBound();
  GlooTimeoutBound(const GlooTimeoutBound&) = delete;
  GlooTimeoutBound& operator=(const GlooTimeoutBound&) = delete;

 private:
  std::vector<std::pair<std::shared_ptr<c10d::ProcessGroup>, std::chrono::milliseconds>> lowered_;
};

}  // namespace zbpipe::runtime
