// The executor's view of one pipeline stage and of a step's data: abstract interfaces, so
// csrc/runtime needs no pybind11 (the Python PipelineStage implements them through the
// trampolines in csrc/python/py_stage.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace zbpipe::runtime {

// Shape and dtype of one tensor crossing a stage boundary (per microbatch).
struct TensorSpec {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::ScalarType::Float;

  bool operator==(const TensorSpec& o) const { return shape == o.shape && dtype == o.dtype; }
  bool operator!=(const TensorSpec& o) const { return !(*this == o); }
  // Carries a gradient back across the boundary (floating point, complex).
  bool differentiable() const { return at::isFloatingType(dtype) || at::isComplexType(dtype); }
};

std::string to_string(const TensorSpec& s);
std::string to_string(const std::vector<TensorSpec>& specs);

// What crosses one stage boundary: the flat tensor specs plus the front end's text of where
// they sit in its values (zbpipe/_tree.py: a stage output's tree spec, the first stage's input
// layout), which the runtime only compares and transports (a handshake failure carries its
// message apart, handshake.cpp).
struct Signature {
  std::vector<TensorSpec> specs;
  std::string structure;
};

// One step's data, opaque to the runtime: what the front end hands Executor::run (the
// microbatch arguments, targets, loss function and mode of the step) and the executor hands,
// unread, to every stage call of that step. It lives for the call to run; stages read it and
// keep nothing of it past the step.
class StepData {
 public:
  virtual ~StepData() = default;
};

// A value of the front end the runtime carries back unread: the last stage's output of one
// microbatch, kept for the caller (Python: the detached output, any structure).
class StageOutput {
 public:
  virtual ~StageOutput() = default;
};

// What a forward returns to the executor.
struct ForwardResult {
  // The flat outputs (every stage but the last) or, on the last stage, the loss when the step
  // trains (empty otherwise). When the step trains they are the roots of this microbatch's
  // backward.
  std::vector<at::Tensor> tensors;
  at::Tensor loss;                      // last stage: the detached loss (undefined without one)
  std::shared_ptr<StageOutput> output;  // last stage: the kept output (null when not kept)
};

// What Executor::run returns. On the rank of the last stage both hold one entry per
// microbatch (in microbatch order); elsewhere both are empty.
struct StepResult {
  std::vector<at::Tensor> losses;                    // undefined where the step had no loss
  std::vector<std::shared_ptr<StageOutput>> outputs;  // null where no output was kept
};

// Contract: every call is made from the executor thread, in program order, without the Python
// GIL held. Microbatch indices are in [0, microbatches). `step` is the data of the running step
// (the one given to Executor::run; a handshake runs inside a step too). The backward (B, I, W)
// is the executor's: it runs the autograd engine from the tensors forward returned (see
// stage_backward.h), so a stage only computes forwards.
class StageHandle {
 public:
  virtual ~StageHandle() = default;

  // Forward of microbatch `mb` on `inputs`, the tensors of the boundary with the previous
  // stage (empty on stage 0, which reads its microbatch arguments from `step`);
  // differentiable inputs already require grad when the step trains. Returns what
  // ForwardResult describes; throws on a failure of the stage's code.
  virtual ForwardResult forward(const StepData& step, int mb, const std::vector<at::Tensor>& inputs) = 0;

  // Whether the stage queues weight-gradient work of its own during the backward (deferred
  // nn.Linear): the executor then runs a full backward for I and run_weight_work for W.
  virtual bool queues_weight_work() const { return false; }
  // Runs the weight-gradient work queued by microbatch `mb`'s backward.
  virtual void run_weight_work(const StepData& /*step*/, int /*mb*/) {}
  // Called right after microbatch `mb`'s backward (B or I) on a stage that queues weight work,
  // before its run_weight_work: the moment torch's dw_builder builds the runner W will call.
  virtual void weight_work_queued(const StepData& /*step*/, int /*mb*/) {}
  // Called on the executor's thread right before microbatch `mb`'s backward (B or I) starts
  // on the OVERLAP_F_B worker, which then runs it while this thread runs a forward: the stage
  // does here what must not run concurrently with a forward (the Python stage recomputes the
  // microbatch's checkpointed regions, whose recomputation sets and restores the global RNG).
  virtual void before_backward_on_worker(const StepData& /*step*/, int /*mb*/) {}
  // Once per stage, on the executor's thread at the end of the step where it happened: the
  // split backward could not take the stage's graph and ran it fused (I did B's work, W
  // nothing); `reason` says why (WeightWork::fused).
  virtual void split_fell_back(const std::string& /*reason*/) {}
  // An exception the autograd engine threw out of this stage's backward (B, I or W), as the
  // step's failure should name it: the Python stage turns a Python exception into a
  // StageError ("ValueError: ..." with its traceback). Returns `error` when it has nothing
  // better. Called without the GIL, on whichever thread ran the backward.
  virtual std::exception_ptr describe_backward_error(std::exception_ptr error) { return error; }
  // Called right after microbatch `mb`'s I, only while the executor probes memory
  // (Executor::set_memory_probe): the moment what waits for W is all the graph still holds.
  virtual void backward_input_done(const StepData& /*step*/, int /*mb*/) {}

  // Data parallelism around the stage (DDP, FSDP2): read once. When true the executor calls
  // begin_gradient_sync right before the stage's last backward action of each step (its last
  // B, or its last W) and end_gradient_sync right after it, so gradients are reduced once per
  // step, after every microbatch's have accumulated. `roots`: that action's graph roots (the
  // stage outputs or the loss for a B; empty for a W).
  virtual bool syncs_gradients() const { return false; }
  virtual void begin_gradient_sync(const std::vector<at::Tensor>& /*roots*/) {}
  virtual void end_gradient_sync() {}

  // The executor switches back to signatures negotiated earlier: the input structure the
  // stage should rebuild its arguments with (what infer_outputs received then).
  virtual void use_inputs(const Signature& /*inputs*/) {}

  // Shape inference for the pipeline handshake (at the first step and for every new input
  // signature): given the signature arriving from the previous stage (empty structure on
  // stage 0, which reads the arguments in `step`), returns this stage's output signature. The
  // stage keeps the input structure to rebuild its arguments. A declared input signature
  // that disagrees is reported by throwing (the runtime tells every rank).
  virtual Signature infer_outputs(const StepData& step, const Signature& inputs) = 0;
};

}  // namespace zbpipe::runtime
