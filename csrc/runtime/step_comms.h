// The communication of one step: posts the dispatch table's comm batches, keeps each posted
// receive in its slot's inbox until the compute that needs it waits, leaves the sends to P2P
// (which releases each as soon as it may: see P2P::post), and after a failure abandons
// everything still in flight.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "runtime/dispatch.h"
#include "runtime/local_stage.h"
#include "runtime/p2p.h"

namespace zbpipe::runtime {

// Not thread-safe (nor is P2P): the executor's thread only. Receive buffers are allocated
// with the shapes in each stage's LocalStage::shapes at the time of the post.
class StepComms {
 public:
  // `p2p`, `comms` and `stages` outlive this object (the executor owns all four).
  StepComms(P2P& p2p, const std::vector<Comm>& comms, std::vector<LocalStage>& stages)
      : p2p_(p2p), comms_(comms), stages_(stages) {}

  // Starts a step whose waits are bounded by `timeout`. With `prepost` every receive of the
  // step is posted now, one batch per action (waiting on one waits on no other), and post()
  // skips them. Does not block; throws what P2P::post throws.
  void begin(bool prepost, std::chrono::milliseconds timeout);
  // Posts the comm batch `e` as one P2P batch: its sends (the slot's outgoing tensors, moved
  // out) and, unless preposted, its receives (buffers allocated into the slots' inboxes).
  // Does not block; throws what P2P::post throws.
  void post(const Entry& e);
  // Completes the receive pending in `in` (none: returns at once) and adds the time spent to
  // `wait_ns`. Blocks as P2P::wait does (at most the step's timeout; never on a stream-ordered
  // backend); throws LateBatch (owner: the receive's index in comms) on timeout or a peer's
  // failure, CommAborted once aborted.
  void wait(Inbox& in, int64_t& wait_ns);
  // Between actions: releases what completed, checks the deadlines (P2P::progress). Never
  // blocks; throws as wait does.
  void progress() { p2p_.progress(); }
  // The step's end: blocks until every send completed and every stream wait settled (each
  // by its deadline). Throws LateBatch as wait does.
  void finish();
  // After a failure: every unfinished batch is kept alive for the rest of the process (see
  // P2P::abandon) and the inboxes are emptied. Never throws. The caller clears the slots.
  void abandon();

 private:
  // Allocates the inbox buffers of receive `c` and appends its ops (none when nothing
  // differentiable crosses: then no message).
  void add_recv_ops(int c, std::vector<P2POp>& ops);
  Inbox& inbox(const Comm& k);

  P2P& p2p_;
  const std::vector<Comm>& comms_;
  std::vector<LocalStage>& stages_;
  bool preposted_ = false;
  std::chrono::milliseconds timeout_{0};
};

}  // namespace zbpipe::runtime
