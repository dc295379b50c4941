// The executor: walks one rank's lowered program, posting receives (all at step start on
// tag-matched backends such as Gloo, else at their RECV action), waiting on them right before
// the compute that needs them, calling the stages' forwards, running their backward (B, or I
// then W) on the autograd engine, and sending each batch of adjacent communication actions
// (zbpipe::comm_batches) as one post. On stream-ordered backends (NCCL) it first checks the
// program with rendezvous sends (validate_rendezvous). OVERLAP_F_B units run their backward
// half on a worker thread while the forward half runs here (ExecutorOptions::overlap_f_b).
// The dispatch table is built once per program; a step allocates only its receive buffers.
// Before the first step the ranks compare program fingerprints (program_agreement.h); every
// step starts by agreeing on its shapes (the first stage's rank names the step's input
// signature, a new one is negotiated by the handshake, a known one reused), unless
// static_shapes; a failing rank publishes its failure through the group's store and its peers'
// pending communication is aborted (failure_watch.h). A data-parallel stage (DDP, FSDP2) gets
// begin/end_gradient_sync around its last backward action of the step.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <memory>
#include <vector>

#include "runtime/device.h"
#include "runtime/failure_watch.h"
#include "runtime/handshake.h"
#include "runtime/overlap_worker.h"
#include "runtime/p2p.h"
#include "runtime/stage_backward.h"
#include "runtime/stage_handle.h"
#include "runtime/trace.h"
#include "zbpipe/program.h"

namespace zbpipe::runtime {

struct ExecutorOptions {
  std::chrono::milliseconds timeout{300000};  // every wait: receives, sends, handshake
  bool device_timing = false;                 // per-action device events (accelerators only)
  // Post every receive of the step when the step starts rather than at its RECV action. Only
  // where messages complete on the host (P2P::host_completes: Gloo): a Gloo send whose receive
  // is already posted goes out in one message; otherwise it waits for a receive-ready notice
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
};

// A user function replacing how the actions of some kinds run (Python's
// register_custom_function). The executor calls run(action) once per such action instead of
// its built-in computation; run must execute every compute part of the action (the action
// itself, or each sub-action of an OVERLAP_F_B) exactly once through Executor::run_part, in any
// order, and may do other work around them. Called without the Python GIL.
class CustomActions {
 public:
  virtual ~CustomActions() = default;
  virtual void run(const Action& action) = 0;
};

class Executor {
 public:
  // `stages`: this rank's stages, keyed by global stage index (exactly prog.stages_of(rank)).
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

  const std::vector<TraceRecord>& trace() const { return trace_; }
  const Program& program() const { return program_; }
  int rank() const { return rank_; }
  void set_timeout(std::chrono::milliseconds t) { options_.timeout = t; }
  // Agreed signatures of a local stage for the last step's inputs (after the first run).
  const StageSignatures& signatures(int stage) const;
  // Shape handshakes run so far (one per distinct input signature, see negotiate_shapes).
  int handshakes() const { return handshakes_; }

  // A failure outside run() (the schedule's own checks before a step, on this rank): tells
  // every peer, as a failing step does, and leaves the executor unusable.
  void report_failure(const std::string& what);
  // The same for a rank whose executor could not even be built (e.g. stages placed where the
  // program does not put them): its peers' executor of the same number learns `what`.
  static void report_setup_failure(P2P& p2p, const std::string& what);

  // Actions of `kinds` (compute kinds) run through `handler` from the next step on; an empty
  // list or a null handler restores the built-in computation. Call between steps.
  void set_custom_actions(std::shared_ptr<CustomActions> handler, const std::vector<Kind>& kinds);
  // From inside CustomActions::run only: runs `part`, the action being run or one of its
  // sub-actions, with the built-in computation (waiting on its receives, handing its result on).
  void run_part(const Action& part);

 private:
  enum class Op : uint8_t { Forward, BackwardInput, BackwardWeight, BackwardFull, Comm };
  // One dispatch entry, precomputed from the program.
  struct Entry {
    Op op;
    int index;         // action index in the rank's program (first one for a comm batch)
    int stage = -1;
    int local = -1;    // index into stages_ / per-stage tables
    int mb = -1;
    Kind kind = Kind::F;      // compute: the action's kind (F, B, I or W)
    bool needs_recv = false;  // input comes from another rank: wait its receive first
    int handoff = -1;         // local index of the same-rank neighbour receiving the result
    bool to_send = false;     // result is sent later by a SEND action
    int comm_begin = 0, comm_end = 0;  // Comm: range in comms_
    bool sync_grads = false;  // the stage's last backward (B or W) of a step, and it syncs grads
    bool on_worker = false;   // the backward half of an overlapped unit: runs on worker_
    bool concurrent = false;  // runs while worker_ may be busy (the forward half, its SEND)
  };
  struct Comm {
    Kind kind;       // SEND_F / RECV_F / SEND_B / RECV_B
    int stage, local, mb, peer, tag, index;
    std::string desc;  // "1RECV_F0 from rank 0", for error messages
  };
  // Per local stage and microbatch, the tensors in flight during a step.
  struct Slot {
    std::vector<at::Tensor> fwd_in, grad_in, fwd_out, grad_out;
    std::vector<at::Tensor> saved_in, roots;  // from F to B/I: the backward's leaves and roots
    WeightWork weight;                        // from I to W
    std::shared_ptr<Batch> fwd_recv, grad_recv;
    int fwd_recv_comm = -1, grad_recv_comm = -1;  // index in comms_ of the pending receive
  };

  void build_dispatch();
  void mark_gradient_sync();  // Entry::sync_grads, once the handles are known
  void run_entry(const Entry& e, TraceRecord& rec);
  // Runs the action of entries_[first] (all its entries) through custom_; returns the index
  // of its last entry.
  size_t run_custom(size_t first);
  bool is_custom(Kind k) const { return custom_ && (custom_kinds_ >> static_cast<int>(k) & 1u); }
  // B or I after its receive: the backward and the input gradients it hands on. `consumer`:
  // on the worker, the caller's stream, on which tensors made here are recorded.
  void run_backward(const Entry& e, const c10::Stream* consumer);
  // Waits the receive of entries_[i] here, then runs its backward on the worker.
  void start_on_worker(size_t i);
  // Joins the worker if busy; a failure of its backward half fails the step at that unit.
  void join_worker();
  // Posts the sends of a comm entry and, unless they were preposted, its receives.
  void post_comm(const Entry& e);
  // Allocates the slot's buffers for receive action `k` and appends its receive ops.
  void add_recv_ops(const Comm& k, std::vector<P2POp>& ops);
  // Posts every receive of the step, one batch per action (waiting on one waits on no other).
  void prepost_receives();
  // Records `batch` as the pending receive of receive action comms_[c] in its slot.
  void track_recv(int c, std::shared_ptr<Batch> batch);
  void wait_recv(std::shared_ptr<Batch>& batch, int comm, TraceRecord& rec);
  void check_outputs(const std::vector<at::Tensor>& outs, const std::vector<TensorSpec>& want,
                     const char* what, int stage, int mb) const;
  Slot& slot(int local, int mb) { return slots_[static_cast<size_t>(local) * program_.microbatches + mb]; }
  // `index`: the failing action's, kStepStart before the first, or past the end after the last.
  [[noreturn]] void fail(int index, const std::string& what);
  static constexpr int kStepStart = -2;
  // After a failure: unfinished batches stay alive (see P2P::abandon), step state is dropped.
  void abandon_in_flight();

  // Step-start agreement (executor_agreement.cpp).
  void ensure_watch();       // executor id + failure watch, on first use (groups of 2+ ranks)
  // Program fingerprints (first step), then negotiate_shapes.
  void agree_before_step(const Signature& first_inputs);
  // The first stage's rank sends the index of the step's input signature (`first_inputs`) to
  // every rank; a new signature runs the handshake (every rank learns it is new from the index).
  void negotiate_shapes(const Signature& first_inputs);
  void adopt_shapes(int set);  // make shape set `set` the current one

  // One negotiated signature set: the key (the first stage's step inputs) and what follows.
  struct ShapeSet {
    Signature key;
    std::vector<StageSignatures> sigs;  // local index ->
    std::vector<std::vector<TensorSpec>> grad_specs, in_grad_specs;
  };

  Program program_;
  std::unique_ptr<P2P> p2p_;
  int rank_;
  ExecutorOptions options_;
  std::vector<int> stage_ids_;                       // local index -> global stage
  std::vector<std::shared_ptr<StageHandle>> stages_; // local index -> handle
  std::vector<StageSignatures> sigs_;                // local index -> agreed signatures
  std::vector<std::vector<TensorSpec>> grad_specs_;  // local index -> differentiable outputs
  std::vector<std::vector<TensorSpec>> in_grad_specs_;  // local index -> differentiable inputs
  std::vector<uint8_t> trains_;                      // local index -> has backward actions
  std::vector<uint8_t> queues_weight_;               // local index -> stage queues its own W work
  std::vector<SplitPlanCache> split_plans_;          // local index -> I/W analysis per graph shape
  double loss_scale_ = 1.0;
  const StepData* step_ = nullptr;  // the running step's data (set by run, null between steps)
  StepResult* result_ = nullptr;    // what run returns, filled by the last stage's forwards
  std::vector<Entry> entries_;
  std::vector<Comm> comms_;
  std::vector<Slot> slots_;
  std::vector<std::shared_ptr<Batch>> pending_sends_;
  std::vector<TraceRecord> trace_;
  std::unique_ptr<DeviceTimer> timer_;
  std::shared_ptr<CustomActions> custom_;  // register_custom_function's handler, or null
  uint32_t custom_kinds_ = 0;              // bit k: Kind k runs through custom_
  size_t part_begin_ = 0, part_end_ = 0;   // entries of the custom action running now
  std::vector<uint8_t> part_done_;         // per entry in [part_begin_, part_end_): ran
  std::unique_ptr<OverlapWorker> worker_;  // created at the first overlapped unit
  int worker_index_ = -1;                  // action index of the unit the worker runs
  bool prepost_ = false; // receives are posted at step start (see ExecutorOptions)
  bool ready_ = false;   // handshake done
  bool broken_ = false;  // a step failed
  std::vector<uint8_t> syncs_grads_;  // local index -> stage wants begin/end_gradient_sync
  std::vector<ShapeSet> shape_sets_;  // in negotiation order (equal on every rank)
  int current_set_ = -1;
  int handshakes_ = 0;
  int64_t steps_ = 0;                 // run() calls, for failure reports
  int64_t id_ = -1;                   // executor id on the group (failure_watch.h)
  bool agreed_ = false;               // program fingerprints compared
  std::unique_ptr<FailureWatch> watch_;
};

// Tag of a data message: the boundary (lower stage of the edge), direction and microbatch,
// times the per-message tensor capacity; tensor i of the message adds i.
int data_tag(int boundary_stage, bool grad, int mb, int microbatches);
constexpr int kMaxTensorsPerMessage = 64;

}  // namespace zbpipe::runtime
