// The executor's view of one pipeline stage: an abstract interface, so csrc/runtime needs no
// pybind11 (the Python PipelineStage implements it through a trampoline in module.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
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

// What crosses one stage boundary: the flat tensor specs plus an opaque structure string
// (written and read by the Python stage: tensor / tuple / dict layout) that the runtime only
// transports.
struct Signature {
  std::vector<TensorSpec> specs;
  std::string structure;
};

// Contract: every call is made from the executor thread, in program order, without the Python
// GIL held. Microbatch indices are in [0, microbatches). The backward (B, I, W) is the
// executor's: it runs the autograd engine from the tensors forward returned (see
// stage_backward.h), so a stage only computes forwards.
class StageHandle {
 public:
  virtual ~StageHandle() = default;

  // Forward of microbatch `mb` on `inputs`, the tensors of the boundary with the previous
  // stage (empty on stage 0, which reads its own microbatch arguments); differentiable inputs
  // already require grad when the step trains. Returns the flat outputs or, on the last
  // stage, the loss (empty without a loss function). When the step trains, the returned
  // tensors are the roots of this microbatch's backward.
  virtual std::vector<at::Tensor> forward(int mb, const std::vector<at::Tensor>& inputs) = 0;

  // Whether the stage queues weight-gradient work of its own during the backward (deferred
  // nn.Linear): the executor then runs a full backward for I and run_weight_work for W.
  virtual bool queues_weight_work() const { return false; }
  // Runs the weight-gradient work queued by microbatch `mb`'s backward.
  virtual void run_weight_work(int /*mb*/) {}
  // Called right after microbatch `mb`'s backward (B or I) on a stage that queues weight work,
  // before its run_weight_work: the moment torch's dw_builder builds the runner W will call.
  virtual void weight_work_queued(int /*mb*/) {}

  // Data parallelism around the stage (DDP, FSDP2): read once. When true the executor calls
  // begin_gradient_sync right before the stage's last backward action of each step (its last
  // B, or its last W) and end_gradient_sync right after it, so gradients are reduced once per
  // step, after every microbatch's have accumulated. `roots`: that action's graph roots (the
  // stage outputs or the loss for a B; empty for a W).
  virtual bool syncs_gradients() const { return false; }
  virtual void begin_gradient_sync(const std::vector<at::Tensor>& /*roots*/) {}
  virtual void end_gradient_sync() {}

  // First stage only, every step (unless static_shapes): the signature of this step's
  // microbatch inputs (every microbatch of a step has the same), the key under which the
  // pipeline's shapes are negotiated.
  virtual Signature step_inputs() { return {}; }
  // The executor switches back to signatures negotiated earlier: the input structure the
  // stage should rebuild its arguments with (what infer_outputs received then).
  virtual void use_inputs(const Signature& /*inputs*/) {}

  // Shape inference for the pipeline handshake (at the first step and for every new input
  // signature): given the signature arriving from the previous stage (empty structure on
  // stage 0, which reads this step's arguments), returns this stage's output signature. The
  // stage keeps the input structure to rebuild its arguments. A declared input signature
  // that disagrees is reported by throwing (the runtime tells every rank).
  virtual Signature infer_outputs(const Signature& inputs) = 0;
};

}  // namespace zbpipe::runtime
