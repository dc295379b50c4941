// The vocabulary-parallel input embedding during a step (vocab.h's E, REDUCE_E, BCAST_E and EW
// on this rank): the lookups of this rank's rows, their reduction onto stage 0's rank (the
// embedding root), the broadcast of stage 0's input gradient back, and the rows' weight
// gradient. Collectives are posted without blocking (P2P::post_collective) and waited right
// before what needs them, each wait bounded by the step's timeout and ended by an abort.
//
// The math (one microbatch of N tokens, this rank's shard r of rows [a, b)):
//   E:        x_r = W_r[id - a] where a <= id < b, 0 elsewhere           [N, d]
//   REDUCE_E: the root gets sum_r x_r = W[id], the embedding's output (one nonzero term per
//             token: the sum is exact)
//   BCAST_E:  g = d loss / d x from stage 0's backward, to every rank
//   EW:       W_r.grad[id - a] += g for the tokens on the shard (padding_idx excluded)
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/embed_handle.h"
#include "runtime/p2p.h"
#include "runtime/stage_handle.h"
#include "zbpipe/program.h"

namespace zbpipe::runtime {

// Not thread-safe: the executor's thread (set_grad also from the worker, before BCAST_E).
class EmbedRun {
 public:
  // `p2p` outlives this object; `program` is the executor's (with embedding actions).
  EmbedRun(P2P& p2p, std::shared_ptr<EmbedHandle> handle, const Program& program);

  // The step's start: its token ids and the shard's weight from the handle, the bound of every
  // wait. Throws for ids whose shape differs between microbatches.
  void begin(const StepData& step, std::chrono::milliseconds timeout);

  // The actions (vocab.h). Each wait adds its time to `wait_ns`.
  void e_pass(int mb);
  void post_reduce(int mb);
  void post_broadcast(int mb);
  void ew_pass(int mb, int64_t& wait_ns);

  // The root, before stage 0's F of `mb`: waits for the reduction; the embedding output, shaped
  // like the ids plus the width, in the weight's dtype.
  at::Tensor output(int mb, int64_t& wait_ns);
  // The root, after stage 0's backward of `mb` (any thread): the gradient of that output.
  void set_grad(int mb, at::Tensor grad);

  // The step's end (its collectives completed) or failure: drops the step's tensors.
  void end();

 private:
  struct Slot {
    at::Tensor ids;      // [N] int64
    std::vector<int64_t> shape;  // the ids' shape
    at::Tensor out;      // [N, d]: this rank's lookups, then (root) their sum
    at::Tensor grad;     // [N, d]: stage 0's input gradient (root: set_grad; others: received)
    std::shared_ptr<Batch> reduce, bcast;
  };
  Slot& slot(int mb);
  std::string name(Kind k, int mb) const;
  void wait(const std::shared_ptr<Batch>& batch, Kind k, int mb, int64_t& wait_ns);

  P2P& p2p_;
  std::shared_ptr<EmbedHandle> handle_;
  const int pp_, rank_, root_, microbatches_;
  EmbedShard shard_;
  std::vector<Slot> slots_;
  at::Tensor weight_;
  std::chrono::milliseconds timeout_{300000};
};

}  // namespace zbpipe::runtime
