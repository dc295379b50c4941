// One stage this rank holds, as the executor keeps it: the handle, what was agreed about its
// tensors, what its actions need, and per microbatch the tensors in flight during a step.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "runtime/handshake.h"
#include "runtime/replica_barrier.h"
#include "runtime/stage_backward.h"
#include "runtime/stage_handle.h"

namespace zbpipe::runtime {

struct Batch;

// Tensors arriving for a compute: from a receive (pending until waited) or handed over by a
// stage of the same rank.
struct Inbox {
  std::vector<at::Tensor> tensors;
  std::shared_ptr<Batch> pending;  // the posted receive filling `tensors`, until waited
  int comm = -1;                   // that receive's index in DispatchTable::comms
};

// The tensors of one (stage, microbatch) during a step.
struct Slot {
  Inbox fwd_in, grad_in;                      // F's input, B/I's output gradient
  std::vector<at::Tensor> fwd_out, grad_out;  // results a later SEND carries
  std::vector<at::Tensor> saved_in, roots;    // from F to B/I: the backward's leaves and roots
  WeightWork weight;                          // from I to W
};

// What crosses a stage's boundaries under one negotiated input signature.
struct StageShapes {
  StageSignatures sigs;
  std::vector<TensorSpec> grad_specs;     // differentiable outputs (what comes back as gradients)
  std::vector<TensorSpec> in_grad_specs;  // differentiable inputs (what B/I send back)
};

struct LocalStage {
  int stage = -1;  // global index
  std::shared_ptr<StageHandle> handle;
  bool trains = false;         // has B or I actions: its forwards keep the graph
  bool queues_weight = false;  // the stage queues its own W work (StageHandle::queues_weight_work)
  bool syncs_grads = false;    // wants begin/end_gradient_sync (StageHandle::syncs_gradients)
  // Its data-parallel groups (ExecutorOptions::sync_groups) and, once the failure watch is
  // set up, the meeting point of its replicas on each.
  std::vector<std::shared_ptr<c10d::ProcessGroup>> sync_groups;
  std::vector<ReplicaBarrier> replicas;
  StageShapes shapes;          // for the current step's input signature
  SplitPlanCache split_plans;  // the I/W analysis per graph shape
  // Why the split fell back to a fused backward (WeightWork::fused), once seen; told to the
  // handle once, from the executor's thread at the step's end (fused_told).
  std::string fused;
  bool fused_told = false;
  std::vector<Slot> slots;     // per microbatch

  Slot& slot(int mb) { return slots[static_cast<size_t>(mb)]; }
};

}  // namespace zbpipe::runtime
