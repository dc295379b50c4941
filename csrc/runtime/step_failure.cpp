// StepFailures: the failure watch's setup, the step count, Ctrl-C, and the report a failing
// step throws on every rank (step_failure.h).
#include "runtime/step_failure.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "runtime/errors.h"
#include "zbpipe/cancel.h"

namespace zbpipe::runtime {

namespace {

// What failed here: `message` is told to every rank, `detail` (a traceback) stays here.
struct LocalFailure {
  std::string message, detail;
};

LocalFailure describe_local(const std::exception& ex, const char* prefix) {
  if (const auto* se = dynamic_cast<const StageError*>(&ex)) return {prefix + se->summary(), se->traceback()};
  if (const auto* hf = dynamic_cast<const HandshakeFailed*>(&ex)) return {prefix + hf->summary, hf->traceback};
  if (dynamic_cast<const Cancelled*>(&ex)) return {"KeyboardInterrupt", ""};
  return {prefix + std::string(ex.what()), ""};
}

}  // namespace

StepFailures::StepFailures(const Program& program, int rank, int global_rank, std::vector<int> group_ranks)
    : program_(program), rank_(rank), global_rank_(global_rank), group_ranks_(std::move(group_ranks)) {}

StepFailures::~StepFailures() = default;

int StepFailures::global(int r) const {
  if (!group_ranks_.empty() && r >= 0 && r < static_cast<int>(group_ranks_.size())) return group_ranks_[r];
  if (r == rank_ && global_rank_ >= 0) return global_rank_;
  return r;
}

// ---- the watch ------------------------------------------------------------------------------

std::optional<std::vector<int64_t>> StepFailures::start_watch(
    c10::intrusive_ptr<c10d::Store> store, int size, const std::vector<std::shared_ptr<c10d::ProcessGroup>>& dp_groups,
    std::function<void()> on_peer_failure) {
  if (program_.pp < 2 && dp_groups.empty()) return std::nullopt;
  if (!store) return std::nullopt;
  try {
    id_ = next_executor_id(*store, rank_);
    std::vector<FailureChannel> channels{{store, id_, rank_, size}};
    std::vector<int64_t> ids;
    for (const auto& g : dp_groups) {
      ids.push_back(next_executor_id(*g->getStore(), g->getRank()));
      channels.push_back({g->getStore(), ids.back(), g->getRank(), g->getSize()});
    }
    watch_ = std::make_unique<FailureWatch>(std::move(channels), global(rank_), std::move(on_peer_failure));
    watch_for_interrupt_.store(watch_.get());
    return ids;
  } catch (const std::exception& e) {
    throw PipelineError(detail::str("setting up the failure watch through the process group's store (",
                                    describe_store(*store), ") failed (the process hosting it may have exited): ",
                                    short_what(e)));
  }
}

void StepFailures::arm() {
  if (watch_) watch_->arm();
}

void StepFailures::disarm() {
  if (watch_) watch_->disarm();
}

// ---- the step count and stopping ---------------------------------------------------------

void StepFailures::start_step() {
  if (broken_)
    throw PipelineError(detail::str(
        "zbpipe: rank ", rank_, ": this schedule failed in an earlier step; its process group "
        "may hold unmatched messages. Create a new process group and schedule."));
  ++steps_;
}

void StepFailures::interrupt() {
  interrupted_ = true;
  if (FailureWatch* w = watch_for_interrupt_.load()) w->wake();
}

void StepFailures::check_stop() const {
  if (interrupted_.load()) throw Cancelled();
  if (watch_ && watch_->seen()) throw CommAborted("waiting was aborted (a peer failed)");
}

void StepFailures::check_before_success() const {
  if (interrupted_.load()) throw Cancelled();
  if (!watch_) return;
  watch_->look_now();
  // A peer's failure in a later step (it ran ahead into its next step; every action of this
  // one is done here): this step succeeded, and the next one fails at its start.
  if (auto f = watch_->seen(); f && f->step <= steps_) throw CommAborted("waiting was aborted (a peer failed)");
}

// ---- failing ------------------------------------------------------------------------------

std::string StepFailures::where(int index) const {
  const auto& acts = program_.ranks[rank_];
  if (index == kStepStart) return detail::str("at the start of step ", steps_);
  if (index < 0 || index >= static_cast<int>(acts.size()))
    return detail::str("at the end of step ", steps_, " (completing its sends)");
  const Action& a = acts[index];
  if (is_vocab(a.kind))
    return detail::str("in vocabulary shard ", a.stage, " at action ", to_string(a), " (microbatch ", a.microbatch, ")");
  if (a.kind == Kind::OVERLAP_F_B && a.sub.size() == 2)
    return detail::str("in stages ", a.sub[0].stage, " and ", a.sub[1].stage, " at action ", to_string(a));
  return detail::str("in stage ", a.stage, " at action ", to_string(a), " (microbatch ", a.microbatch, ")");
}

StepFailures::Report StepFailures::publish(int index, const std::exception& ex, const char* prefix) {
  broken_ = true;
  const bool interrupted = interrupted_.load() || dynamic_cast<const Cancelled*>(&ex) != nullptr;
  const int me = global(rank_);
  const LocalFailure local = describe_local(ex, prefix);
  StepFailure mine{me, interrupted, where(index), steps_, local.message};
  const auto* handshake = dynamic_cast<const HandshakeFailed*>(&ex);
  if (handshake) {  // every rank learnt the culprit from the handshake: name it, not this rank
    mine.rank = global(handshake->rank);
    mine.where = detail::str("in stage ", handshake->stage, " at the start of step ", steps_,
                             " (inferring its output shapes)");
  }
  // A peer's failure seen first is the cause: name it; otherwise this rank's failure (or the
  // handshake's culprit) is the one every peer is told about.
  std::optional<StepFailure> cause = watch_ ? watch_->seen() : std::nullopt;
  if (!cause) {
    const StepFailure stands = watch_ ? watch_->report(mine) : mine;
    if (stands.rank != me) cause = stands;
  }
  if (interrupted) return Report{true, ""};  // the binding raises KeyboardInterrupt
  const std::string context = detail::str(
      "  schedule '", program_.schedule, "' (pp=", program_.pp, ", stages=", program_.num_stages,
      ", microbatches=", program_.microbatches, "), step ", steps_,
      me != rank_ ? detail::str(", rank ", me, " is rank ", rank_, " of its pipeline group") : std::string());
  std::string text;
  if (cause) {
    text = "aborted because " + cause->describe() + "\n";
    if (!handshake) text += detail::str("  on rank ", me, ", ", where(index), ": ", local.message, "\n");
    text += context + "\nprogram (this rank's action marked >> <<):\n";
  } else {
    text = mine.describe() + "\n" + context + "\n";
    if (!local.detail.empty()) text += local.detail + (local.detail.back() == '\n' ? "" : "\n");
    text += "program (failing action marked >> <<):\n";
  }
  return Report{false, text + format_program(program_, rank_, index)};
}

void StepFailures::raise(const Report& report) {
  if (report.interrupted) throw Cancelled();
  throw PipelineError(report.text);
}

void StepFailures::report(const std::string& what) {
  broken_ = true;
  if (watch_)
    watch_->report(StepFailure{global(rank_), false, detail::str("before step ", steps_ + 1), steps_ + 1, what});
}

void StepFailures::report_setup_failure(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                        const std::vector<std::shared_ptr<c10d::ProcessGroup>>& sync_groups,
                                        int global_rank, const std::string& what) {
  // The same numbering as start_watch: the pipeline group's id, then one per distinct group.
  std::vector<const c10d::ProcessGroup*> seen;
  auto publish = [&](const c10d::ProcessGroup* g) {
    if (!g || std::find(seen.begin(), seen.end(), g) != seen.end()) return;
    seen.push_back(g);
    try {
      auto store = g->getStore();
      if (!store) return;
      const int64_t id = next_executor_id(*store, g->getRank());  // the number the peers' executor has
      publish_failure(FailureChannel{store, id, g->getRank(), g->getSize(), store_waits(*store)},
                      StepFailure{global_rank >= 0 ? global_rank : group->getRank(), false,
                                  "while building its executor", 1, what});
    } catch (const std::exception&) {
    }
  };
  if (!group) return;
  if (group->getSize() >= 2 || !sync_groups.empty()) publish(group.get());
  for (const auto& g : sync_groups) publish(g.get());
}

}  // namespace zbpipe::runtime
