// A stage's backward through the autograd engine, with no Python in the loop: the full
// backward (B), and the split into backward-input (I) and backward-weight (W) that together
// give exactly the gradients of B, with the weight-gradient work in W.
//
// The graph of a stage microbatch splits into the *input closure* C (nodes below the roots
// from which a stage input is reachable) and the *weight region* (every other node below the
// roots: it reaches parameters only, and no weight-region node reaches C). A *boundary node*
// is a node of C with a next edge into the weight region; an AddmmBackward of a Linear is one
// (its input-side output leads to C, its weight-side outputs to TBackward/AccumulateGrad).
//
// I runs the engine from the roots with outputs = the stage inputs only: the engine executes
// only C, and a generated node computes only the outputs whose next node is needed, so a
// boundary node computes its input side alone (AddmmBackward does dX, not dW). A pre-hook
// appended last on each boundary node captures the gradient it received, after its tensor
// pre-hooks, retains_grad hooks and function pre-hooks; two more bracket its run with the
// keep flag of checkpoint_once.h (checkpointed tensors it unpacks are kept for W's re-run).
// After I, the boundary nodes' C-side next edges are cut and every other node of C releases
// its saved tensors (I's part of the graph is freed at I, and no saved-tensor-hook reference
// cycle survives).
// W is one engine run whose roots are (boundary node, input) with the captured gradients,
// plus the stage outputs computed without touching an input: the boundary nodes re-run with
// their hooks stripped (so every hook of theirs runs exactly once, in I, and sees what B's
// would) and compute only the weight side (their C-side edges are cut), and the engine sums
// weight-region diamonds by its dependency counting, all entry points being roots of the
// one run. W accumulates into .grad with keep_graph=false, releasing the rest of the graph.
//
// W's roots from a re-run node are the inputs it received a gradient on in I (an output of
// the forward op no gradient reached, as GroupNorm's mean, gets none, as in B: the engine
// cannot take an undefined root gradient). A generated boundary node whose weight side needs
// its input side (joint_backward.h: an LSTM's mkldnn_rnn_layer_backward) is not re-run: in I
// its weight-region edges lead to stand-in nodes the engine is asked for, so it computes
// everything once, and what it sent those edges feeds W.
//
// A graph the split cannot take (a reentrant checkpoint on the input path, whose node runs a
// backward of its own) runs whole in I, as B, and says why (WeightWork::fused); the executor
// tells the stage once.
//
// Nodes other than torch's generated ones (a Python autograd.Function's PyNode, a C++
// custom function, CopySlices, ...) may compute all their outputs whatever is asked and may
// have side effects (e.g. `weight.grad += ...` inside a backward), so they are never re-run:
// such a boundary node does its weight-side work in I, a post-hook captures what it sends
// into the weight region (per edge), and those values are W roots, so no weight-region node
// runs during I and W still sums everything once. A torch.compile'd region is one such node:
// its weight gradients are computed in I, accumulated in W.
//
// Stage inputs are expected to be leaves (the executor's are): the split stops at an input
// and runs nothing below one. The classification above is cached per graph shape in a
// SplitPlanCache (one per stage): each microbatch pays one DFS that also yields the shape's
// signature (node types and edge layout), and the analysis runs only for a shape not seen.
//
// Every call here runs the engine: the caller must not hold the Python GIL (the engine of a
// Python process re-acquires it for Python-defined nodes and refuses to start while held).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>  // Node: WeightWork holds graph edges

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/node_ref.h"

namespace zbpipe::runtime {

// What W needs for one stage microbatch, filled by backward_input.
struct WeightWork {
  torch::autograd::edge_list roots;  // W's roots (they keep the graph W runs alive)
  std::vector<at::Tensor> grads;     // the gradient for each root
  // Boundary nodes W re-runs: their hooks are stripped during W (they ran in I).
  std::vector<NodeRef> rerun;
  // Non-empty where the split could not take the graph and I ran the whole backward (B): why,
  // for the stage's one warning. W then has nothing to do.
  std::string fused;

  bool empty() const { return roots.empty(); }
  void clear();
  // Bytes of the captured gradients (distinct storages), what W adds to the saved tensors
  // the graph keeps for it.
  int64_t captured_bytes() const;
};

// The split's analysis of a stage's graph, per graph shape. Not thread-safe: one per stage,
// used from one thread.
class SplitPlanCache {
 public:
  SplitPlanCache();
  ~SplitPlanCache();
  SplitPlanCache(const SplitPlanCache&) = delete;
  SplitPlanCache& operator=(const SplitPlanCache&) = delete;
  SplitPlanCache(SplitPlanCache&&) noexcept;
  SplitPlanCache& operator=(SplitPlanCache&&) noexcept;

  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }

  struct Impl;  // the walk's scratch space and the cached plans (stage_backward.cpp)

 private:
  friend std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>&,
                                                const std::vector<at::Tensor>&,
                                                const std::vector<at::Tensor>&, WeightWork&,
                                                SplitPlanCache*);
  std::unique_ptr<Impl> impl_;
  int64_t hits_ = 0, misses_ = 0;
};

// B: backpropagates `root_grads` from `roots` through the whole graph, accumulating into every
// leaf's .grad (parameters and the stage inputs). Roots that do not require grad are skipped
// with their gradient. Returns the gradient of each of `inputs` (undefined where none flowed).
std::vector<at::Tensor> backward_full(const std::vector<at::Tensor>& roots,
                                      const std::vector<at::Tensor>& root_grads,
                                      const std::vector<at::Tensor>& inputs);

// I: the gradient of each of `inputs` (undefined where an input needs no gradient or none
// flowed), without touching any parameter's .grad (unless a custom Function does so in its
// own backward); fills `work` for W. `cache` (may be null: analyse every call) keeps the
// graph analysis of the shapes seen. A graph the split cannot take (a reentrant checkpoint on
// the input path) runs its whole backward here, as B, and says why in work.fused.
std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& roots,
                                       const std::vector<at::Tensor>& root_grads,
                                       const std::vector<at::Tensor>& inputs, WeightWork& work,
                                       SplitPlanCache* cache = nullptr);

// Whether the graph below `roots` (down to `inputs`) holds a node that runs a backward of its
// own: a reentrant checkpoint (torch.utils.checkpoint with use_reentrant=True), which
// recomputes its region inside its backward under torch's fork of the global RNG.
bool runs_own_backward(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& inputs);

// W: accumulates the parameter gradients (into .grad) from what backward_input captured, then
// clears `work` (the rest of the microbatch's graph is released).
void backward_weight(WeightWork& work);

}  // namespace zbpipe::runtime
