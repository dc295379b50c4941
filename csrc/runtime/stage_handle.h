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

// Contract: every call is made from the executor thread, in program order; tensors passed in
// are owned by the stage afterwards. Microbatch indices are in [0, microbatches).
class StageHandle {
 public:
  virtual ~StageHandle() = default;

  // Forward of microbatch `mb`. `inputs` are the tensors of the boundary with the previous
  // stage (empty on stage 0, which reads its own microbatch arguments). Returns the flat
  // output tensors (ignored on the last stage, which keeps its loss).
  virtual std::vector<at::Tensor> forward(int mb, std::vector<at::Tensor> inputs) = 0;
  // Backward-input (I): `grads` has one tensor per differentiable output (empty on the last
  // stage); returns one gradient per differentiable input.
  virtual std::vector<at::Tensor> backward_input(int mb, std::vector<at::Tensor> grads) = 0;
  // Backward-weight (W) for a microbatch whose backward_input ran.
  virtual void backward_weight(int mb) = 0;
  // Full backward (B): input and weight gradients together; returns as backward_input.
  virtual std::vector<at::Tensor> backward_full(int mb, std::vector<at::Tensor> grads) = 0;

  // Shape inference for the one-time pipeline handshake: given the signature arriving from
  // the previous stage (empty structure on stage 0), returns this stage's output signature.
  // The stage keeps the input structure to rebuild its arguments. A declared input signature
  // that disagrees is reported by throwing (the runtime tells every rank).
  virtual Signature infer_outputs(const Signature& inputs) = 0;
};

}  // namespace zbpipe::runtime
