// The data-parallel replicas of a stage meet before its gradient sync. The sync is a collective
// on the stage's data-parallel group (DDP's all-reduce inside its last backward, FSDP2's
// reduce-scatter after it) that nothing bounds but that group's own timeout (30 min by
// default) and that Gloo cannot abort. So before it, every replica checks in through the
// group's store and waits -- polling, against the step's deadline, giving up at once on a
// failure seen anywhere or on Ctrl-C -- until every replica has: the collective starts only
// when all replicas reached it, and a replica that failed earlier in its step never leaves
// the others blocked inside it (they get its failure through the FailureWatch instead). The
// replicas also meet at the start of every training step, before the forwards' collectives.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
}

namespace zbpipe::runtime {

// A process group held where c10d's headers are not included (the executor's files): a
// shared_ptr whose deleter, made here, keeps the group's intrusive_ptr.
std::shared_ptr<c10d::ProcessGroup> share_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// Not thread-safe: the executor's thread only.
class ReplicaBarrier {
 public:
  // `group`: the stage's data-parallel group; `key`: unique to the stage of this executor on
  // that group and equal on its ranks (executor id and stage). Does not communicate.
  ReplicaBarrier(std::shared_ptr<c10d::ProcessGroup> group, std::string key);

  // Checks in for this rank's next sync and waits until every rank of the group checked in
  // for it. Between polls calls `check`, which throws to give up (a peer's failure seen, an
  // interrupt). Throws PipelineError naming the ranks' progress when `timeout` passes first,
  // or when the store fails (its host exited).
  void arrive_and_wait(std::chrono::milliseconds timeout, const std::function<void()>& check,
                       const std::string& what);
  // The same at the start of each training step (a counter of its own): a stage's forwards
  // may run collectives on the group too (DDP's bucket rebuild at its second step and its
  // buffer broadcasts, FSDP2's all-gathers), so a replica that has not started the step (a
  // trainer that skipped it after an error) would leave the others blocked inside one.
  void arrive_at_step_start(std::chrono::milliseconds timeout, const std::function<void()>& check,
                            const std::string& what);

 private:
  void meet(const std::string& key, int64_t round, std::chrono::milliseconds timeout,
            const std::function<void()>& check, const std::string& what);

  std::shared_ptr<c10d::ProcessGroup> group_;  // its store holds the counters
  std::string key_;
  int size_ = 1;
  int64_t round_ = 0;   // syncs checked in so far
  int64_t starts_ = 0;  // step starts checked in so far
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
