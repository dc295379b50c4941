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
// node's unpack hooks inside it.
#pragma once

#include <torch/csrc/autograd/function.h>

namespace zbpipe::runtime::checkpoint_once {

// True while a boundary node runs its input side in I on this thread: a checkpoint unpack
// must keep the recomputed tensor for the node's second run, in W.
bool keeps_unpacked();

// Brackets `node`'s run in I with the keep flag (a pre-hook sets it, a post-hook clears it).
// Returns the two hooks, owned by the node, so the caller can remove them after I.
struct KeepHooks {
  const torch::autograd::FunctionPreHook* pre;
  const torch::autograd::FunctionPostHook* post;
};
KeepHooks add_keep_hooks(torch::autograd::Node& node);

// Clears this thread's flag when destroyed: a node that threw in I skipped its post-hook.
class ClearKeepOnExit {
 public:
  ClearKeepOnExit() = default;
  ~ClearKeepOnExit();
  ClearKeepOnExit(const ClearKeepOnExit&) = delete;
  ClearKeepOnExit& operator=(const ClearKeepOnExit&) = delete;
};

}  // namespace zbpipe::runtime::checkpoint_once
