// The vocabulary-parallel head during a step (vocab.h's actions on this rank): its S and T
// passes on this rank's shard, its three collectives posted without blocking (P2P::
// post_collective) and waited right before what needs them, each wait bounded by the step's
// timeout and ended by an abort, and the per-microbatch tensors between them.
//
// The math (one microbatch of N tokens, this rank's shard r of rows [a, b), z = h W_r^T + b_r):
//   S:           m_r = max z, e = exp(z - m_r), s_r = sum e, t_r = z[target] (0 off the shard);
//                the shard's softmax p_r = e / s_r (kept for T), u_r = p_r W_r and the target's
//                rows w_r = W_r[target] (0 off the shard)
//   ALLREDUCE_S: (m, s, t) of every shard on every rank; then M = max m_q,
//                S = sum s_q exp(m_q - M), loss = mean over counted tokens of M + log S - sum t_q,
//                and this shard's share of the softmax alpha_r = s_r exp(m_r - M) / S
//   REDUCE_B:    g (d loss / d token, 0 on ignored tokens, scaled by the step's loss scale);
//                the root gets sum_r g (alpha_r u_r - w_r), the gradient of h
//   T:           G = g (alpha_r p_r - onehot); W_r.grad += G^T h, b_r.grad += sum G
// which is softmax cross-entropy's gradient, split by rows: every rank computes a third of the
// head's matmuls for its rows, and the statistics are all that crosses before the backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/head_lane.h"
#include "runtime/p2p.h"
#include "runtime/stage_handle.h"
#include "runtime/vocab_handle.h"
#include "zbpipe/program.h"

namespace zbpipe::runtime {

// On a backend whose messages complete on the host (Gloo) the collectives go over the
// pipeline's group and the actions run in line. On a stream-ordered backend (NCCL, or any
// group posted as one) they need what the core's rendezvous model shows
// (validate_rendezvous.cpp): the collectives on a communicator of their own (set_collectives:
// a P2P over a group of their own; on the messages' one a rank's early broadcast post would
// hold back the sends its root waits for), and every vocabulary action on a lane of its own (a
// T waiting for its statistics must not hold back the stages' posts): a stream of its own on a
// device (the root's broadcast first waits for the stages' stream; the root's backward waits
// for the reduction), a thread of its own on a host without streams (HeadLane: the root's lane
// completes the reduction and marks it for the backward). finish() drains the lane, completes
// the collectives and joins the head's stream into the caller's.
//
// Not thread-safe: the executor's thread (input_grad also from the worker, once awaited).
class VocabRun {
 public:
  // `p2p` outlives this object; `program` is the executor's (with vocabulary actions).
  VocabRun(P2P& p2p, std::shared_ptr<VocabHandle> handle, const Program& program);
  // Stream-ordered backends: the collectives' P2P (outlives this object, or is replaced).
  void set_collectives(P2P& collectives);

  // The step's start: its targets and the shard's parameters from the handle, the loss scale and
  // the bound of every wait. On the root, `hidden` is the last stage's agreed output signature:
  // throws zbpipe::Error unless it is one tensor of the targets' shape plus the head's input
  // width, in the head's dtype. Throws for targets whose count differs between microbatches.
  void begin(const StepData& step, double loss_scale, std::chrono::milliseconds timeout,
             const std::vector<TensorSpec>* hidden);
  // The root: the last stage's output of microbatch `mb` (the head's input).
  void set_input(int mb, const at::Tensor& hidden);

  // The actions (vocab.h). Each wait adds its time to `wait_ns`.
  void post_broadcast(int mb);
  void s_pass(int mb, int64_t& wait_ns);
  void post_allreduce(int mb);
  void post_reduce(int mb, int64_t& wait_ns);
  void t_pass(int mb, int64_t& wait_ns);

  // The root, before the last stage's backward of `mb`: waits for the reduced gradient.
  void await_input_grad(int mb, int64_t& wait_ns);
  // Then (any thread): that gradient, shaped like the last stage's output.
  at::Tensor input_grad(int mb) const;
  // The loss of `mb` (mean over its counted tokens), waiting for its statistics if needed.
  at::Tensor loss(int mb);

  // The step's end, before end(): completes the collectives of a P2P of their own (a
  // non-root's reduction is never waited for) and joins the head's stream into the caller's,
  // so the shard's gradients and the losses are ordered before what follows on it.
  void finish();
  // The step's end (its collectives completed) or failure: drops the step's tensors.
  // With one rank (pp = 1) nothing is posted and nothing waits: the one shard is the head.
  void end();

 private:
  struct Slot {
    at::Tensor target;   // [N] int64
    at::Tensor hidden;   // [N, d]: the head's input
    std::vector<int64_t> hidden_shape;  // the last stage's output shape (root)
    std::shared_ptr<Batch> bcast, stats_batch, grad_batch;
    at::Tensor soft;     // [N, V_r] float: exp(z - m_r), the shard's softmax times s_r
    at::Tensor part;     // [N, d]: p_r W_r, then (REDUCE_B) this rank's input-gradient part
    at::Tensor picked;   // [N, d]: W_r's rows of the targets on this shard, 0 elsewhere
    at::Tensor stats;    // [pp, 3, N] float: every shard's (max, sum of exp, target logit)
    at::Tensor grad, scale, loss;  // after the statistics: g, g alpha_r, the loss
    bool stats_ready = false, grad_ready = false;
  };
  Slot& slot(int mb);
  std::string name(Kind k, int mb) const;
  void wait(const std::shared_ptr<Batch>& batch, Kind k, int mb, int64_t& wait_ns);
  // Waits for the statistics of `mb` and derives the loss, g and g alpha_r (once).
  void statistics(int mb, int64_t& wait_ns);

  // The actions' bodies, run by on_lane.
  void do_post_broadcast(int mb, const std::shared_ptr<c10::Event>& stages_done);
  void do_s_pass(int mb, int64_t& wait_ns);
  void do_post_allreduce(int mb);
  void do_post_reduce(int mb, int64_t& wait_ns);
  void do_t_pass(int mb, int64_t& wait_ns);
  // Runs f(wait_ns) on the head's lane: queued on its thread (lane_), else here under its
  // stream (stream_), else here.
  template <typename F>
  void on_lane(F&& f, int64_t& wait_ns);

  // The head's stream for the scope of a pass (stream-ordered backends on a device with
  // streams), else nothing; `on` false: nothing either.
  class OnHead {
   public:
    explicit OnHead(const std::optional<c10::Stream>& stream, bool on = true) {
      if (stream && on) guard_.emplace(*stream);
    }

   private:
    std::optional<c10::StreamGuard> guard_;
  };

  P2P& p2p_;
  P2P* coll_;  // the collectives': p2p_, or set_collectives'
  std::optional<c10::Stream> stream_;  // the head's, see on_head
  std::unique_ptr<HeadLane> lane_;     // stream-ordered posting on a host without streams
  std::shared_ptr<VocabHandle> handle_;
  const int pp_, rank_, root_, microbatches_;
  VocabShard shard_;
  std::vector<Slot> slots_;
  at::Tensor weight_, bias_;
  double loss_scale_ = 1.0;
  std::chrono::milliseconds timeout_{300000};
};

}  // namespace zbpipe::runtime
