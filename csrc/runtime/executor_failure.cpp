// After a failure: the step's teardown (nothing in flight is freed under a late message) and
// the report every rank throws. Its first line names the culprit: "rank R failed in stage S at
// action A (microbatch k): <Type>: <message>" on the failing rank, "aborted because rank R
// failed ..." on every other; the failing rank alone adds the user's traceback. Then the
// program grid with this rank's action marked.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "runtime/errors.h"
#include "runtime/executor.h"
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

int Executor::global(int r) const {
  if (!options_.group_ranks.empty() && r >= 0 && r < static_cast<int>(options_.group_ranks.size()))
    return options_.group_ranks[r];
  if (r == rank_ && options_.global_rank >= 0) return options_.global_rank;
  return r;
}

std::string Executor::where(int index) const {
  const auto& acts = program_.ranks[rank_];
  if (index == kStepStart) return detail::str("at the start of step ", steps_);
  if (index < 0 || index >= static_cast<int>(acts.size()))
    return detail::str("at the end of step ", steps_, " (completing its sends)");
  const Action& a = acts[index];
  if (a.kind == Kind::OVERLAP_F_B && a.sub.size() == 2)
    return detail::str("in stages ", a.sub[0].stage, " and ", a.sub[1].stage, " at action ", to_string(a));
  return detail::str("in stage ", a.stage, " at action ", to_string(a), " (microbatch ", a.microbatch, ")");
}

void Executor::fail_step(int index, const std::exception& ex, const char* prefix) {
  abort_communication();
  abandon_in_flight();
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
  if (interrupted) throw Cancelled();  // the binding raises KeyboardInterrupt
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
  throw PipelineError(text + format_program(program_, rank_, index));
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

void Executor::abort_communication() {
  p2p_->abort_all();
  if (syncing_ < 0) return;
  for (const auto& g : stages_[syncing_].sync_groups) {
    try {
      g->abort();  // NCCL: ends the collective's kernels; Gloo cannot abort (a no-op there)
    } catch (const std::exception&) {
    }
  }
  syncing_ = -1;
}

void Executor::clear_slots() {
  for (auto& st : stages_) st.slots.assign(st.slots.size(), Slot{});
}

void Executor::check_stop() const {
  if (interrupted_.load()) throw Cancelled();
  if (watch_ && watch_->seen()) throw CommAborted("waiting was aborted (a peer failed)");
}

void Executor::meet_replicas_at_start() {
  for (auto& st : stages_)
    for (auto& r : st.replicas)
      r.arrive_at_step_start(options_.timeout, [this] { check_stop(); },
                             detail::str("the data-parallel replicas of stage ", st.stage, " to start step ", steps_));
}

void Executor::interrupt() {
  interrupted_ = true;
  p2p_->abort_all();  // a wait blocked now returns; the step then fails as interrupted
}

void Executor::report_failure(const std::string& what) {
  if (broken_) return;
  try {
    ensure_watch();
  } catch (const std::exception&) {
  }
  broken_ = true;
  if (watch_)
    watch_->report(StepFailure{global(rank_), false, detail::str("before step ", steps_ + 1), steps_ + 1, what});
}

}  // namespace zbpipe::runtime
