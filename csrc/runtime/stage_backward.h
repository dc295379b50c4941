// A stage's backward through the autograd engine, with no Python in the loop: the full
// backward (B), and the split into backward-input (I) and backward-weight (W) that together
// give exactly the gradients of B.
//
// The autograd graph of a stage microbatch splits into the *input closure* (nodes from which
// a stage input is reachable: I must run them) and the *weight region* (everything else: only
// parameters below). I runs the engine to the stage inputs and, in the same pass, captures
// the total gradient arriving at every weight-region node fed from the input closure (a
// "boundary slot": node + input number). W runs the weight region from those captured
// gradients.
//
// Why not PyTorch's stage_backward_weight: it replays the *intermediate* input-closure nodes
// from their saved incoming gradients, grouped per parameter; a parameter used twice inside
// one stage reaches two intermediates that are themselves connected, and the replay can count
// a contribution twice. Capturing at the weight-region boundary cannot: each slot's value is
// the sum of everything the input closure sends it, taken once. A boundary node that is also
// reachable from another boundary node (a weight-region diamond) is clamped to its captured
// totals during W, so the second path does not add to it again.
//
// Every call here runs the engine: the caller must not hold the Python GIL (the engine of a
// Python process re-acquires it for Python-defined nodes and refuses to start while held).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>  // Node: WeightWork holds graph edges

#include <utility>
#include <vector>

namespace zbpipe::runtime {

// What W needs for one stage microbatch, captured by backward_input.
struct WeightWork {
  std::vector<torch::autograd::Edge> edges;  // boundary slots (they keep the weight region alive)
  std::vector<at::Tensor> grads;     // captured total gradient of each slot
  // Boundary nodes reachable from another boundary node: per node, input number -> total.
  std::vector<std::pair<torch::autograd::Edge, std::vector<std::pair<uint32_t, at::Tensor>>>> clamps;

  bool empty() const { return edges.empty(); }
  void clear();
};

// B: backpropagates `root_grads` from `roots` through the whole graph, accumulating into every
// leaf's .grad (parameters and the stage inputs). Roots that do not require grad are skipped
// with their gradient. Returns the gradient of each of `inputs` (undefined where none flowed).
std::vector<at::Tensor> backward_full(const std::vector<at::Tensor>& roots,
                                      const std::vector<at::Tensor>& root_grads,
                                      const std::vector<at::Tensor>& inputs);

// I: the gradient of each of `inputs` (undefined where an input needs no gradient or none
// flowed), without touching any .grad; fills `work` for W. The graph is kept for W.
std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& roots,
                                       const std::vector<at::Tensor>& root_grads,
                                       const std::vector<at::Tensor>& inputs, WeightWork& work);

// W: accumulates the parameter gradients (into .grad) from what backward_input captured, then
// clears `work` (freeing the weight region's saved tensors).
void backward_weight(WeightWork& work);

}  // namespace zbpipe::runtime
