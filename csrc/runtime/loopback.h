// An in-process process group for tests and the NCCL model: the ranks of one world live in one
// process (a thread each) and exchange messages through memory. Messages match on (sender,
// receiver, tag) as on Gloo and a send completes at once (buffered); the backend supports
// coalescing, as NCCL does, and declares ModelsStreamWaits (p2p.h), so a P2P over it posts
// and waits as it would on NCCL; and every call the ranks make on it is recorded per rank, in
// issue order, for the model to replay under NCCL's rules (tests/nccl_model.py), with a count
// per rank of the waits that block the host (what a GPU's host must not do before a step's
// end). Messages may be CUDA tensors (the groups serve CPU and CUDA): a copy is then a kernel
// on the copying rank's current stream, ordered as NCCL orders its own stream: a copy into a
// posted receive waits for the event the receiver recorded on its stream at the post, and
// the buffer is recorded on the copying stream (for the caching allocator); a receive's
// Work::wait makes the caller's stream wait for its copies' events, as a wait on NCCL makes
// it wait for the NCCL stream. So ranks on their own streams of one GPU exercise stream
// waits and send lifetimes (test_device_cuda.py). Not a transport for training: no timeouts
// of its own.
//
// It models NCCL's abort: a group's abort (ProcessGroup::abort) ends every unfinished work of
// that rank -- its posted receives and an all-reduce (the one collective it runs, by call order
// across the world) -- with an error, and is counted, as are Work::abort calls (NCCL's
// synchronous per-communicator abort, which zbpipe must not use) and aborts that came while the
// rank was inside a coalesced post. Its control groups (control_group.h) are loopback worlds of
// their own, one per name. Its store counts the requests made to it.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace zbpipe::runtime {

struct LoopbackOp {
  bool is_send = false;
  int peer = -1;
  int tag = 0;  // the wire tag (see wire_tag)
  int64_t bytes = 0;
};

// One recorded call. `work` numbers the works of a rank: one per lone op, one per coalesced
// group (what the caller can wait on).
struct LoopbackEvent {
  enum class Type : uint8_t {
    Post,  // ops issued: one lone op, or a whole coalesced group at endCoalescing
    Wait,  // Work::wait: the caller's stream (here: the caller) is ordered after the work
    Sync,  // the host blocks until the work completes (ModelsStreamWaits::host_waits)
  };
  Type type = Type::Post;
  int work = -1;
  bool coalesced = false;
  std::vector<LoopbackOp> ops;
};

class LoopbackWorld {
 public:
  // `stream_waits`: Work::wait returns at once, as a wait on a device stream does, so the
  // caller's host runs ahead as on an accelerator -- its data may not have arrived yet, so
  // only for failure tests. Default: Work::wait blocks until the work is complete (the CPU
  // "stream" is the caller). `store`: the groups share an in-process store, as real groups
  // do (failure propagation, program agreement and the step's signature go through it);
  // without one those are off, and the signature travels as a message.
  // `lagging_polls`: a device behind the host. Each work answers isCompleted with false to
  // its first `lagging_polls` queries, even once complete, as a GPU still running the step's
  // kernels does: the step's end then blocks the host (P2P::settle), which the tests must
  // tell apart from a host wait inside the step (see settles).
  explicit LoopbackWorld(int size, bool stream_waits = false, bool store = false, int lagging_polls = 0);
  ~LoopbackWorld();
  int size() const;
  // The process group of `rank` (one per rank; the same object on every call).
  c10::intrusive_ptr<c10d::ProcessGroup> group(int rank);
  // What `rank` has called so far, in order.
  std::vector<LoopbackEvent> events(int rank) const;
  // From now on the backend returns no work for a post (a broken backend, for tests: P2P must
  // refuse it rather than skip the wait).
  void return_no_work(bool on);
  // How many times `rank`'s host blocked on a work (its Sync events) since the last clear.
  int64_t host_waits(int rank) const;
  // How often `rank`'s group was aborted (ProcessGroup::abort: a communicator abort on NCCL).
  int aborts(int rank) const;
  // How often a Work of `rank` was aborted (Work::abort: a synchronous ncclCommAbort on NCCL).
  int work_aborts(int rank) const;
  // How often `rank`'s group was aborted while the rank was inside a coalesced post (between
  // startCoalescing and endCoalescing: NCCL's thread-local group state would go stale).
  int aborts_in_coalescing(int rank) const;
  // Whether `rank` is inside a coalesced post now.
  bool in_coalescing(int rank) const;
  // From now on `rank`'s coalesced posts stay open for `seconds` before they end (a slow post).
  void hold_coalesced_posts(int rank, double seconds);
  // From now on an abort of `rank`'s group takes `seconds` (a slow communicator abort) before
  // it returns.
  void slow_aborts(int rank, double seconds);
  // Requests made to the world's store so far (store=true), by operation; the counts go on
  // across clear_events.
  std::map<std::string, int64_t> store_requests() const;
  // Where in `rank`'s events P2P began to settle (a step's end, or a shape handshake's): the
  // number of events recorded before each settle since the last clear. A host wait (Sync)
  // recorded before the step's settle blocked the host inside the step.
  std::vector<size_t> settles(int rank) const;
  void clear_events();

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
};

}  // namespace zbpipe::runtime
