// The split backward's side of recomputing each checkpointed region once per stage microbatch
// (issue #21; the Python side is zbpipe/checkpointing.py).
//
// zbpipe replaces the unpack rule of torch's non-reentrant checkpoint for the regions a stage
// forward creates: the region is recomputed at its first unpack (whichever backward call it is
// in: I, W or B), never again, and each recomputed tensor is dropped at its unpack, as torch
// drops it. One node breaks that last rule: a boundary node (stage_backward.h) runs its input
// side in I and is re-run in W for its weight side, unpacking the same saved tensors twice.
// While such a node runs in I, this thread's *keep* flag is set, and the Python unpack then
// keeps the recomputed tensor for W's unpack (for a Linear: its input). Nothing else of the
// recomputation outlives I.
//
// The flag is per thread because the engine runs a node's pre-hooks, the node and its
// post-hooks on one thread (the caller's on CPU, the device's worker on accelerators), and the
// node's unpack hooks inside it. It lives no longer than its I call (KeepScope).
#pragma once

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <memory>

namespace zbpipe::runtime::checkpoint_once {

// True while a boundary node runs its input side in I on this thread, under a KeepScope still
// open: a checkpoint unpack must keep the recomputed tensor for the node's second run, in W.
bool keeps_unpacked();

// The two hooks add_keep_hooks put on a node, owned by it: the caller removes them after I.
struct KeepHooks {
  const torch::autograd::FunctionPreHook* pre;
  const torch::autograd::FunctionPostHook* post;
};

// The keep flag's lifetime: one I call. The hooks added under it raise the flag on whichever
// thread runs their node (the caller's on CPU, the device's autograd thread on accelerators)
// and lower it after; the scope's end lowers it on every such thread, also where a node threw
// in I and so skipped its post-hook (on a device thread, which outlives the call, the flag
// would otherwise stay raised for every later backward there).
class KeepScope {
 public:
  KeepScope();
  ~KeepScope();
  KeepScope(const KeepScope&) = delete;
  KeepScope& operator=(const KeepScope&) = delete;

 private:
  friend KeepHooks add_keep_hooks(torch::autograd::Node& node, const KeepScope& scope);
  std::shared_ptr<std::atomic<bool>> open_;  // shared with the hooks and the threads they ran on
};

// Brackets `node`'s run in I with the keep flag of `scope`: a pre-hook raises it on the
// thread running the node, a post-hook lowers it.
KeepHooks add_keep_hooks(torch::autograd::Node& node, const KeepScope& scope);

}  // namespace zbpipe::runtime::checkpoint_once
