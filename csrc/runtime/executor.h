// The executor: walks one rank's lowered program, posting receives (all at step start on
// tag-matched backends such as Gloo, else at their RECV action), waiting on them right before
// the compute that needs them, calling the stages' forwards, running their backward (B, or I
// then W) on the autograd engine, and sending each batch of adjacent communication actions
// (zbpipe::comm_batches) as one post. On stream-ordered backends (NCCL) it first checks the
// program with rendezvous sends (validate_rendezvous). OVERLAP_F_B units run their backward
// half on a worker thread while the forward half runs here (ExecutorOptions::overlap_f_b).
// The dispatch table (dispatch.h) is built once per program; a step allocates only its
// receive buffers. Before the first step the ranks compare program fingerprints
// (program_agreement.h); every step starts by agreeing on its shapes (the first stage's rank
// names the step's input signature, a new one is negotiated by the handshake, a known one
// reused), unless static_shapes; a failing rank publishes its failure through the group's
// store and its peers' pending communication is aborted (failure_watch.h). A data-parallel
// stage (DDP, FSDP2) gets begin/end_gradient_sync around its last backward action of the step,
// once its replicas have all reached it (replica_barrier.h); a failure crosses to the other
// replicas through the data-parallel groups' stores. Ctrl-C (interrupt()) ends a step within a
// poll interval, telling the peers.
//
// Rooms: executor.cpp (the step and its compute verbs), dispatch.cpp (the table),
// step_comms.cpp (posting and tracking messages), step_agreement.cpp (what ranks agree on
// before a step), step_failure.cpp (the failure watch, the step count, the interrupt and the
// failure report), custom_run.cpp (register_custom_function's protocol), executor_failure.cpp
// (the executor's side of a failure: its teardown, the replicas' meeting points).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/control_group.h"
#include "runtime/custom_run.h"
#include "runtime/device.h"
#include "runtime/dispatch.h"
#include "runtime/engine_error.h"
#include "runtime/local_stage.h"
#include "runtime/overlap_worker.h"
#include "runtime/p2p.h"
#include "runtime/step_agreement.h"
#include "runtime/step_comms.h"
#include "runtime/step_failure.h"
#include "runtime/trace.h"
#include "runtime/embed_run.h"
#include "runtime/vocab_run.h"
#include "zbpipe/program.h"

namespace zbpipe::runtime {

struct ExecutorOptions {
  std::chrono::milliseconds timeout{300000};  // every wait: receives, sends, handshake
  bool device_timing = false;                 // per-action device events (accelerators only)
  // Post every receive of the step when the step starts rather than at its RECV action. Only
  // where messages match by tag (P2P::Matching::Tag: Gloo): a Gloo send whose receive is
  // already posted goes out in one message; otherwise it waits for a receive-ready notice
  // from the peer (an extra round trip through both ranks' transport threads). Costs the step's
  // receive buffers up front. Unset: on exactly where it works; true on a stream-ordered
  // backend (NCCL matches by issue order: early receives would reorder it) is refused.
  std::optional<bool> prepost_receives;
  // Shapes fixed at the first step: no per-step signature message (a changed input shape
  // then fails at the first stage whose output differs).
  bool static_shapes = false;
  // Run the halves of an OVERLAP_F_B unit (a forward and a backward of different stages) at
  // the same time: the backward (C++ autograd) on a worker thread -- with its own stream on
  // accelerators, joined back by an event -- while this thread runs the forward (Python); the
  // forward's SEND goes out as soon as it finishes. False runs them in sequence.
  bool overlap_f_b = true;
  // Who is who in the world, for messages and for failures crossing groups: this rank's global
  // rank and the global rank of each rank of the group (empty: the group is the world).
  int global_rank = -1;
  std::vector<int> group_ranks;
  // Per stage of this rank (global index): the data-parallel groups its gradient sync runs a
  // collective on (DDP's group, FSDP2's shard and replicate groups). Their stores carry
  // failures between replicas, and the replicas meet before the sync (replica_barrier.h).
  std::map<int, std::vector<std::shared_ptr<c10d::ProcessGroup>>> sync_groups;  // see share_group
  // Call StageHandle::backward_input_done after every I (Executor::set_memory_probe; off by
  // default: a probe costs a call into the front end per I).
  bool memory_probe = false;
  // Makes the CPU control groups that carry each step's input signature and the replicas'
  // meetings (control_group.h), where the group's backend provides none (the binding: Gloo).
  ControlGroupFactory control_group;
  // This rank's shard of the vocabulary-parallel head: required exactly when the program has
  // vocabulary actions (vocab.h), which run on backends whose messages complete on the host.
  std::shared_ptr<VocabHandle> vocab;
  // This rank's shard of the vocabulary-parallel input embedding: required exactly when the
  // program has embedding actions (vocab.h), on the same backends.
  std::shared_ptr<EmbedHandle> embedding;
};

// Not thread-safe: one thread drives an executor (its worker thread is its own business).
class Executor {
 public:
  // `stages`: this rank's stages, keyed by global stage index (exactly prog.stages_of(rank)).
  // Does not communicate. Throws ScheduleError when the group's size is not the program's pp,
  // the program is compute-only (pp > 1), the stages are not the ones the program places on
  // this rank, the program would deadlock on a stream-ordered backend (validate_rendezvous), or
  // prepost_receives=True meets a stream-ordered backend; zbpipe::Error for an action this rank
  // cannot run (see build_dispatch).
  Executor(Program program, std::unique_ptr<P2P> p2p,
           std::map<int, std::shared_ptr<StageHandle>> stages, ExecutorOptions options);
  ~Executor();

  // Runs one step (every microbatch) on `data`, which every stage call of the step receives
  // (see StepData). The first call compares program fingerprints; each call agrees on the
  // step's shapes under `first_inputs`, the signature of the step's microbatch inputs given on
  // the rank of stage 0 (read there only, unless static_shapes; a new one runs the handshake).
  // Each microbatch loss starts its backward with gradient `loss_scale` (1/n: the gradient of
  // the mean loss). Blocks until the step's sends complete. Returns the last stage's losses and
  // kept outputs (StepResult; empty on other ranks). Throws PipelineError naming the rank and
  // failing action, with the program grid marked, and on a peer's failure naming that rank,
  // its action and message. After a failure the executor (and the process group's pending
  // traffic) is unusable. Call without the GIL.
  StepResult run(const StepData& data, const Signature& first_inputs, double loss_scale = 1.0);

  // Per-entry timing of the last step (valid after a run that returned).
  const std::vector<TraceRecord>& trace() const { return trace_; }
  const Program& program() const { return program_; }
  int rank() const { return p2p_->rank(); }
  // The number failure reports give the next step (run() and report_failure): the caller's
  // count of its steps, where one schedule runs several executors (train and eval, or
  // ScheduleAuto's programs). Without it, run() calls of this executor are counted.
  void set_step_number(int64_t n) { failures_.set_step_number(n); }
  // The bound of every wait from the next step on.
  void set_timeout(std::chrono::milliseconds t) { options_.timeout = t; }
  // From the next step on, call StageHandle::backward_input_done after every I (off by default:
  // a probe costs a call into the front end per I).
  void set_memory_probe(bool on) { options_.memory_probe = on; }
  // Agreed signatures of a local stage for the last step's inputs. Throws zbpipe::Error before
  // the first step or for a stage this rank does not hold.
  const StageSignatures& signatures(int stage) const { return agreement_.signatures(stage); }
  // Shape handshakes run so far (one per distinct input signature, see StepAgreement).
  int handshakes() const { return agreement_.handshakes(); }

  // A failure outside run() (the schedule's own checks before a step, on this rank): tells
  // every peer, as a failing step does, and leaves the executor unusable. Blocks on the
  // store only; never throws. (For a rank whose executor could not even be built:
  // StepFailures::report_setup_failure.)
  void report_failure(const std::string& what);
  // Ctrl-C: thread-safe, from any thread (the signal watcher of the binding). The running step
  // (or the next one) stops at its next wait or action, throws zbpipe::Cancelled, and its
  // peers are told "rank R was interrupted"; the executor is unusable afterwards.
  void interrupt();

  // Actions of `kinds` (compute kinds) run through `handler` from the next step on; an empty
  // list or a null handler restores the built-in computation. Call between steps. Throws
  // zbpipe::Error for a kind that is not a compute kind.
  void set_custom_actions(std::shared_ptr<CustomActions> handler, const std::vector<Kind>& kinds) {
    custom_.set(std::move(handler), kinds);
  }
  // From inside CustomActions::run only: runs `part`, the action being run or one of its
  // sub-actions, with the built-in computation (waiting on its receives, handing its result
  // on). Blocks as that computation does. Throws zbpipe::Error outside a custom function, for
  // a part not of the running action, or for one that already ran; what the part throws.
  void run_part(const Action& part);

 private:
  static constexpr int kStepStart = StepFailures::kStepStart;
  static constexpr int kStepEnd = StepFailures::kStepEnd;

  // The local stages from their handles (LocalStage), and the entries that sync gradients.
  void adopt_stages(std::map<int, std::shared_ptr<StageHandle>> stages);

  // ---- the step (executor.cpp) ---------------------------------------------------------
  // Sets up the failure watch, agrees on program and shapes (under `first_inputs`), meets the
  // replicas, posts early receives.
  void begin_step(const Signature& first_inputs, double loss_scale);
  // Whether entry `e` runs through custom_: the program's action decides (an OVERLAP_F_B
  // unit, not its parts). Inline: asked once per entry.
  bool runs_custom(const Entry& e) const {
    return !e.is_comm() && custom_.runs(program_.ranks[rank()][e.index].kind);
  }
  // Runs the action of entries[first] (all its entries) through custom_; returns the index
  // of its last entry.
  size_t run_custom(size_t first);
  void run_here(size_t i);             // entry i on this thread, timed; fails the step
  void start_on_worker(size_t i);      // waits entry i's receive here, runs it on the worker
  // Whether the worker may run entry `e` (a backward half) while this thread runs the unit's
  // forward half: not where its backward draws from the RNG on its own (a reentrant checkpoint).
  bool may_overlap(const Entry& e);
  void join_worker();                  // a failure of the worker's entry fails the step
  void end_step();                     // waits the sends, drops the step's tensors
  // Between entries (never blocks) or at the step's end (finish): the step's messages seen
  // complete, each by its deadline; a late one fails the step at its RECV action, else `index`.
  void check_comms(int index, bool finish);
  // The verbs: one entry, no timing, no failure handling.
  void run_entry(const Entry& e, TraceRecord& rec);
  // run_entry bracketed by the stage's gradient sync when the entry is its last backward of
  // the step (here and in a custom function's part alike).
  void run_synced(const Entry& e, TraceRecord& rec);
  void forward(const Entry& e, TraceRecord& rec);
  // Waits for an action's received input; its device time then starts anew (compute only).
  void await_input(Inbox& in, TraceRecord& rec);
  // B or I after its receive. `consumer`: on the worker, the caller's stream, on which the
  // tensors made here are recorded.
  void backward(const Entry& e, const c10::Stream* consumer);
  // B/I's input gradients (zeros where none flowed), checked, to the next stage or the SEND.
  void hand_on_input_grads(const Entry& e, const std::vector<at::Tensor>& inputs,
                           std::vector<at::Tensor>& in_grads, const c10::Stream* consumer);
  void weight(const Entry& e);
  // Runs `f`, an autograd engine call of stage `st`; what it throws, as the stage describes
  // it (StageHandle::describe_backward_error: a Python exception keeps its type; a torch C++
  // error gets its Python name, engine_error.h).
  template <typename F>
  auto described(LocalStage& st, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (...) {
      std::rethrow_exception(name_engine_error(st.handle->describe_backward_error(std::current_exception())));
    }
  }
  void check_outputs(const std::vector<at::Tensor>& outs, const std::vector<TensorSpec>& want,
                     const char* what, int stage, int mb) const;
  Slot& slot(int local, int mb) { return stages_[local].slot(mb); }

  // ---- the executor's side of a failure (executor_failure.cpp) ----------------------------
  // The failure watch on first use (groups of 2+ ranks, or data-parallel stages) and, with it,
  // the meeting points of each data-parallel stage's replicas.
  void ensure_watch();
  // The pipeline's control messages (each step's input signature), opened at their first use.
  P2P& control();
  // Stream-ordered backends, once (a step's start, every rank there): the vocabulary head's
  // collectives on a group of their own (vocab_run.h): the backend's own where it provides
  // side groups (the loopback world), else the front end's (VocabHandle::collective_group).
  void open_vocab_collectives();
  // Tells the peers first (StepFailures::publish), then tears the step down
  // (abort_communication, abandon_in_flight) and throws PipelineError naming the failing action
  // (`index`: its index, kStepStart or kStepEnd) and the cause `ex`, its text after `prefix`;
  // Cancelled when interrupted.
  [[noreturn]] void fail_step(int index, const std::exception& ex, const char* prefix = "");
  // Runs `f`; a std::exception it throws fails the step at `index`, its text after `prefix`.
  template <typename F>
  void or_fail_step(int index, F&& f, const char* prefix = "") {
    try {
      f();
    } catch (const std::exception& ex) {
      fail_step(index, ex, prefix);
    }
  }
  // Before a data-parallel stage's sync: every replica reached it (replica_barrier.h).
  void meet_replicas(const Entry& e);
  // At a training step's start, before any forward's collective: every replica of every
  // data-parallel stage started the step (replica_barrier.h).
  void meet_replicas_at_start();
  // After a failure: unfinished batches stay alive (see P2P::abandon), step state is dropped.
  void abandon_in_flight();
  // A failing rank's own communicators: its P2P batches (and, on accelerators or a backend
  // modelling one, the pipeline group's communicators, on which the compute stream may
  // already wait for a receive that never comes), its control messages, and the data-parallel
  // groups of the stage whose gradient sync was running (a collective the replicas will not
  // finish).
  void abort_communication();
  void clear_slots();

  // The running step: set by run, cleared when it returns or fails.
  struct RunningStep {
    const StepData* data = nullptr;  // reachable from stage calls only during run
    StepResult* result = nullptr;    // what run returns, filled by the last stage's forwards
    double loss_scale = 1.0;         // the gradient each microbatch loss starts its backward with
  };
  // The OVERLAP_F_B worker: created at the first overlapped unit.
  struct Overlap {
    std::unique_ptr<OverlapWorker> worker;
    int index = -1;  // action index of the unit it runs
  };
  // The stages' gradient sync on their data-parallel groups.
  struct GradientSync {
    // The groups that have a Gloo backend, once each (GlooTimeoutBound bounds them every step).
    std::vector<std::shared_ptr<c10d::ProcessGroup>> gloo_groups;
    int running = -1;  // local index of the stage inside its sync (its collective), or -1
  };

  Program program_;
  std::unique_ptr<P2P> p2p_;
  ExecutorOptions options_;         // set_timeout and set_memory_probe change them between steps
  std::vector<LocalStage> stages_;  // by local index (ascending global stage)
  DispatchTable table_;
  std::vector<TraceRecord> trace_;  // per entry of table_
  std::unique_ptr<DeviceTimer> timer_;
  std::unique_ptr<StepComms> comms_;
  RunningStep step_;
  Overlap overlap_;
  GradientSync sync_;
  StepFailures failures_;    // the watch, the step count, the interrupt, the report
  // The control P2Ps (the pipeline's, the replicas' groups'), aborted with the communication.
  std::shared_ptr<ControlLinks> links_ = std::make_shared<ControlLinks>();
  std::shared_ptr<P2P> control_;  // the pipeline's, once opened
  std::shared_ptr<P2P> vocab_collectives_;  // stream-ordered backends: the head's, once opened
  std::vector<std::shared_ptr<ReplicaGroup>> replica_groups_;  // per data-parallel group, once watched
  StepAgreement agreement_;  // program fingerprints and the known shape sets
  CustomRun custom_;         // register_custom_function's handler and the parts it ran
  std::unique_ptr<VocabRun> vocab_;  // the vocabulary head's passes (vocab.h), or null
  std::unique_ptr<EmbedRun> embed_;  // the vocabulary-parallel embedding's passes, or null
};

}  // namespace zbpipe::runtime
