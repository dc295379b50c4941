// A step's failures, as one rank sees them: the failure watch that carries them between ranks
// (failure_watch.h), the step count they are numbered by, the interrupt (Ctrl-C), and the
// report every rank throws. Its first line names the culprit: "rank R failed in stage S at
// action A (microbatch k): <Type>: <message>" on the failing rank, "aborted because rank R
// failed ..." on every other; the failing rank alone adds the user's traceback. Then the
// program grid with this rank's action marked.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/failure_watch.h"
#include "zbpipe/program.h"

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace zbpipe::runtime {

// Not thread-safe but for interrupt(), interrupted() and check_stop() (any thread): the
// executor's thread drives it.
class StepFailures {
 public:
  static constexpr int kStepStart = -2;  // an action index: a failure before the step's first action
  static constexpr int kStepEnd = -1;    // one after the last (waiting for the sends)

  // `program` outlives this object. `rank`: this rank in the pipeline group; `global_rank` and
  // `group_ranks`: who is who in the world (ExecutorOptions), the numbering every message uses.
  StepFailures(const Program& program, int rank, int global_rank, std::vector<int> group_ranks);
  ~StepFailures();

  // The global rank of group rank `r`.
  int global(int r) const;

  // ---- the watch ----------------------------------------------------------------------
  // Sets the watch up, unless there is nothing to watch (one rank and no `dp_groups`) or no
  // `store` (the pipeline group's: then no propagation, no program agreement): the executor's
  // id on the pipeline group (`size` ranks), then one id per group of `dp_groups` (distinct,
  // in the stages' order: the replicas build their schedules in the same order, so the ids
  // match), each group a failure channel (channel i + 1 for dp_groups[i]). `on_peer_failure`:
  // what a watcher calls on a peer's failure, in a step or between steps (the executor aborts
  // its communication). Returns the ids of `dp_groups`, nullopt where no watch was set up.
  // Blocks on the stores; throws PipelineError naming the store when it fails. Call while
  // watch() is null.
  std::optional<std::vector<int64_t>> start_watch(c10::intrusive_ptr<c10d::Store> store, int size,
                                                  const std::vector<std::shared_ptr<c10d::ProcessGroup>>& dp_groups,
                                                  std::function<void()> on_peer_failure);
  FailureWatch* watch() const { return watch_.get(); }  // null: none (yet)
  int64_t id() const { return id_; }  // the executor's id on the pipeline group (its store keys)
  // A step runs between arm and disarm (polled stores look more often then). No-ops without
  // a watch.
  void arm();
  void disarm();

  // ---- the step count and stopping -----------------------------------------------------
  // A step starts: throws PipelineError once a step has failed (the executor is unusable),
  // else counts it.
  void start_step();
  int64_t step() const { return steps_; }  // the running step's number in failure reports
  // The number the next step gets (the caller's count of its steps, see
  // Executor::set_step_number).
  void set_step_number(int64_t n) { steps_ = n - 1; }
  // Ctrl-C: from any thread. Wakes a wait on the watch; the caller then aborts the waits
  // blocked on messages.
  void interrupt();
  bool interrupted() const { return interrupted_.load(std::memory_order_relaxed); }
  // Throws (to end a wait) when a peer's failure was seen or this rank was interrupted.
  void check_stop() const;
  // At a step's end, before it reports success: on a polled store, one look at the failure
  // keys (FailureWatch::look_now); then throws as check_stop does for a peer's failure in this
  // step or an earlier one (one in a later step leaves this completed step a success).
  void check_before_success() const;

  // ---- failing -------------------------------------------------------------------------
  bool broken() const { return broken_; }
  // Where action `index` of this rank is (or kStepStart, kStepEnd), for a failure's first
  // line: "in stage 1 at action 1F2 (microbatch 2)", "at the start of step 3", ...
  std::string where(int index) const;
  // What a failing step throws on this rank: PipelineError's text, or Cancelled (interrupted).
  struct Report {
    bool interrupted = false;
    std::string text;
  };
  // Marks the executor broken and tells the peers (or names the peer's failure that caused this
  // one): the report whose first line names the failing rank, stage and action (`index`, or
  // kStepStart, kStepEnd) and the cause `ex` (its text after `prefix`), with the program grid
  // marked. The failing rank publishes before it tears its step down and aborts its
  // communicators (an NCCL abort may take its time): the peers learn it first.
  Report publish(int index, const std::exception& ex, const char* prefix = "");
  // Throws `report`: PipelineError, or zbpipe::Cancelled when this rank was interrupted.
  [[noreturn]] static void raise(const Report& report);
  // A failure outside a step (the schedule's own checks, "before step N"): marks the executor
  // broken and tells the peers through the watch, where there is one. Never throws.
  void report(const std::string& what);
  // For a rank whose executor could not even be built: the peers' executor of the same number,
  // on `group` and on each of `sync_groups`, learns `what` (the numbering of start_watch).
  // Touches only the groups' stores (whatever the device); never throws.
  static void report_setup_failure(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   const std::vector<std::shared_ptr<c10d::ProcessGroup>>& sync_groups,
                                   int global_rank, const std::string& what);

 private:
  const Program& program_;
  int rank_;
  int global_rank_;              // ExecutorOptions::global_rank
  std::vector<int> group_ranks_;  // ExecutorOptions::group_ranks
  std::unique_ptr<FailureWatch> watch_;
  std::atomic<FailureWatch*> watch_for_interrupt_{nullptr};  // watch_, once set: interrupt() reads it
  int64_t id_ = -1;              // executor id on the pipeline group (failure_watch.h)
  int64_t steps_ = 0;            // the running step's number (set_step_number)
  bool broken_ = false;          // a step failed, or a failure was reported
  std::atomic<bool> interrupted_{false};  // interrupt() was called
};

}  // namespace zbpipe::runtime
