// The communication of one step: posts the dispatch table's comm batches, keeps each posted
// receive in its slot's inbox until the compute that needs it waits, holds the sends until
// the step's end, and after a failure abandons everything still in flight.
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
  // `wait_ns`. Blocks as P2P::wait does (at most the step's timeout); throws PipelineError on
  // timeout or a peer's failure, CommAborted once aborted.
  void wait(Inbox& in, int64_t& wait_ns);
  // A send posted outside the table (the step's signature message), waited at the step's end.
  void add_send(std::shared_ptr<Batch> batch) { sends_.push_back(std::move(batch)); }
  // The step's end: blocks until every send completed and every stream wait settled (each
  // by its deadline). Throws PipelineError as wait does.
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
  std::vector<std::shared_ptr<Batch>> sends_;  // posted batches holding sends, until finish()
};

}  // namespace zbpipe::runtime
