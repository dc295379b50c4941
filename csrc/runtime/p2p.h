// Point-to-point messages over a c10d::ProcessGroup: an adjacent group of sends/receives is
// posted as one batch, coalesced (startCoalescing/endCoalescing) where the backend supports it,
// one isend/irecv per tensor otherwise -- what torch.distributed.batch_isend_irecv does.
// c10d stays behind this header (only p2p.cpp includes it) so other runtime files compile fast.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "runtime/errors.h"

namespace c10d {
class ProcessGroup;
class Store;
class Work;
}

namespace zbpipe::runtime {

struct P2POp {
  bool is_send = false;
  int peer = -1;  // rank in the process group
  int tag = 0;    // Gloo matches on (peer, tag); NCCL on issue order
  at::Tensor tensor;
};

// The tag a message travels with: `tag` (the executor's, unique per message of a step) with
// the direction of the rank pair in its lowest bit. ProcessGroupGloo sends a message through
// context `tag % contexts` (one context per device, each with its own sockets and transport
// thread). With one context, a rank posting a send holds the connection's lock while its own
// transport thread wants it to read what the peer is sending at the same moment; that thread
// then spins on the lock and, on a busy machine, can take the sender's CPU for a scheduler
// slice (milliseconds, seen in traces as both ranks stuck in a send). With two or more
// devices (GLOO_SOCKET_IFNAME=lo,lo) the direction bit puts the two directions of every pair
// on different connections and transport threads. With one device it changes nothing.
int wire_tag(int tag, int sender, int receiver);

// A collective of the whole group (vocabulary parallelism, vocab.h): `tensor` is the input and,
// on the ranks that get the result, the output.
struct CollectiveOp {
  enum class Type : uint8_t { Broadcast, AllReduceSum, ReduceSum };
  Type type = Type::Broadcast;
  int root = -1;  // Broadcast: the source; ReduceSum: the destination
  at::Tensor tensor;
};

// A posted batch (opaque: holds the c10d works and its receive buffers until seen complete).
struct Batch;

// A waited batch that failed or missed its deadline, seen by wait, progress or settle: the
// PipelineError names the wait; `owner` is what its waiter passed (-1: none, e.g. a send).
class LateBatch : public PipelineError {
 public:
  LateBatch(const std::string& what, int owner) : PipelineError(what), owner(owner) {}
  int owner;
};

struct P2POptions {
  // Post as on a stream-ordered backend (NCCL): Matching::IssueOrder, whatever the backend.
  // Unset: true off the CPU. True on a CPU group posts as on NCCL over Gloo or the loopback
  // world (tests, the NCCL model).
  std::optional<bool> stream_ordered;
};

// How the two ends of a message find each other, which decides how batches are posted.
enum class Matching : uint8_t {
  // Gloo: on (peer, tag). Receives may be posted in any order and ahead of time; a batch is
  // coalesced only when it has several ops (and the backend can coalesce).
  Tag,
  // NCCL: in issue order per communicator. Receives are posted at their RECV action, and
  // every batch goes out coalesced where the backend can coalesce, so both ends of every
  // message use the group communicator (ProcessGroupNCCL sends a lone, uncoalesced op over a
  // two-rank communicator of its own unless the group was created with a device_id).
  IssueOrder,
};

// What Work::wait does, which decides how a wait completes.
enum class Completion : uint8_t {
  // The host completes each batch in Work::wait, bounded by its deadline: Matching::Tag
  // always (its receives are posted ahead and read on the host), and Matching::IssueOrder
  // over a CPU group (Gloo, where nothing but the host orders compute after a receive).
  Host,
  // Work::wait orders the caller's stream after the work and returns (accelerators, with
  // Matching::IssueOrder); completion is polled against a deadline (see P2P::wait).
  Stream,
};

// A capability a CPU backend declares (deriving from it besides c10d::Backend) when it models
// an accelerator backend: P2P drives its works as stream waits (Completion::Stream) under
// Matching::IssueOrder, so the calls it records are the ones made on a GPU. The loopback
// world's backend declares it (loopback.h).
class ModelsStreamWaits {
 public:
  virtual ~ModelsStreamWaits() = default;
  // P2P is about to block the host until `work` completes (a poll loop, invisible to an
  // accelerator backend): what the model counts as a host-blocking wait.
  virtual void host_waits(const c10d::Work& work) = 0;
  // P2P::settle begins (the step's end): the host waits that follow are the end's.
  virtual void settling() {}
};

// Not thread-safe, except abort_all and aborted (the failure watcher calls them).
class P2P {
 public:
  // `device` is where messages live: CPU for Gloo, the rank's GPU for NCCL. Does not
  // communicate; throws zbpipe::Error without a group.
  P2P(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device, P2POptions options = {});
  ~P2P();
  P2P(const P2P&) = delete;
  P2P& operator=(const P2P&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const c10::Device& device() const { return device_; }
  const std::string& backend_name() const { return backend_name_; }
  Matching matching() const { return matching_; }
  Completion completion() const { return completion_; }
  bool stream_ordered() const { return matching_ == Matching::IssueOrder; }
  // Whether abort_all ends the group's communicators (accelerators, and a backend modelling
  // one), rather than the posted works one by one (Gloo).
  bool aborts_group() const { return completion_ == Completion::Stream || !device_.is_cpu(); }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return pg_; }

  // Posts `ops` (non-empty) as one batch and returns it. Coalesced as `matching()` says. A
  // batch holding sends is watched until seen complete (see progress, settle). Completion::
  // Stream drops the sent tensors at once: the backend records them on its stream
  // (ProcessGroupNCCL records every P2P tensor on its NCCL stream), so they are freed as soon
  // as nothing else holds them; Completion::Host keeps them until the batch completes (Gloo's
  // send work holds them anyway). Receive buffers stay in the batch until it completes. Does
  // not block; throws CommAborted once aborted, zbpipe::Error when the backend returns no work,
  // what the backend throws otherwise.
  std::shared_ptr<Batch> post(std::vector<P2POp> ops);
  // Posts one collective on the group (every rank of the group posts the same collectives in
  // the same order) as a batch of its own, never coalesced with messages; the backend bounds
  // it by `timeout` too. Watched until seen complete, as a send batch (settle completes it);
  // `wait` completes it in slices of a blocking Work::wait, checking its deadline and the
  // abort in between, since Gloo cannot abort a collective. Does not block; throws as post does.
  // `what` names it in the errors of settle.
  std::shared_ptr<Batch> post_collective(CollectiveOp op, std::chrono::milliseconds timeout,
                                         const std::string& what);

  // Completes `batch` for the current stream (idempotent per stream). `what` (e.g. "1RECV_F0
  // from rank 0") goes into the error message. Throws PipelineError when the batch fails or
  // misses its deadline (now + `timeout`), CommAborted once aborted.
  //  - Completion::Host: blocks the host until the batch completes or its deadline;
  //  - Completion::Stream: makes the current stream wait on the batch and returns: the host
  //    never blocks here, however far it runs ahead of the device. The batch is watched
  //    against its deadline by progress (between actions) and settle (the step's end).
  //    `host_complete` blocks until this batch completes (a host read of its data). A host
  //    that blocks elsewhere (a sync inside a stage, a full launch queue) is bounded only by
  //    the process group's own timeout.
  void wait(const std::shared_ptr<Batch>& batch, std::chrono::milliseconds timeout,
            const std::string& what, bool host_complete = false, int owner = -1);
  // Never blocks: releases every watched batch seen complete (its works and buffers), and
  // throws as wait does for a waited one past its deadline. Completion::Host: nothing to see
  // (Gloo completes a work only in its wait).
  void progress();
  // The step's end: completes every watched batch, each by its deadline (a batch never waited,
  // i.e. sends, by now + `timeout`). Blocks only on batches not yet seen complete; throws as
  // wait does.
  void settle(std::chrono::milliseconds timeout = std::chrono::minutes(5));
  // The process group's c10d store (every group has one; null only for a group built without).
  c10::intrusive_ptr<c10d::Store> store() const;

  // Thread-safe (called from the failure watcher): aborts every posted, unfinished batch so a
  // wait blocked on one returns at once; from then on post and wait throw CommAborted.
  // Idempotent. Irreversible: the group's pending traffic is lost (on NCCL, its
  // communicators). Where aborts_group() (waits do not block the host, the stream may wait on
  // a late receive) it is the group's abort, which ProcessGroupNCCL bounds, and never a Work's
  // (on NCCL a synchronous ncclCommAbort on the calling thread, unbounded); elsewhere (Gloo)
  // each posted work's abort. Never inside a coalesced post of another thread (between its
  // startCoalescing and endCoalescing, where PG-NCCL keeps thread-local state): an abort that
  // comes then is done by that post when it ends.
  void abort_all();
  bool aborted() const { return aborted_.load(); }
  // Keeps an unfinished batch (its works and buffers) alive until its process group is
  // destroyed: after a failure a late message may still land in a posted receive buffer, which
  // must not have been freed before the group (and its connections) is gone. Costs the batch's
  // memory and, on Gloo, the group's transport (sockets, a thread per device) until the
  // recovery recipe drops the group; released by the next abandon or P2P construction.
  static void abandon(std::shared_ptr<Batch> batch);
  // Releases abandoned batches whose group is gone; returns how many are still kept.
  static size_t abandoned();
  // After a failure: abandons every watched batch (see abandon) and empties the list.
  void abandon_watched();
  // Forgets the watched batches already complete (a wait completed them), without blocking:
  // for a P2P whose sends are completed by waits rather than settle (control messages).
  void drop_done();

 private:
  // A batch being completed, with its deadline.
  struct Watched {
    std::shared_ptr<Batch> batch;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::milliseconds timeout;
    std::string what;
    int owner = -1;  // the waiter's (LateBatch::owner)
  };
  void complete_on_host(Watched& w);  // Completion::Host: Work::wait until the deadline
  void poll(Watched& w);              // Completion::Stream: isCompleted until the deadline
  void complete_collective(Watched& w);  // Completion::Host, a collective: Work::wait in slices
  bool probe(Watched& w);             // Completion::Stream: complete now? (never blocks)
  // The watched entry of `batch`, added (never waited: no deadline yet) when it has none.
  Watched& watch(const std::shared_ptr<Batch>& batch);
  // Runs `f` (a backend call on `w`'s batch), turning what it throws into the wait's error.
  template <typename F>
  void translated(const Watched& w, F&& f);
  void track_live(const std::shared_ptr<Batch>& batch);
  void finish(Batch& batch);  // clears a completed batch, under live_mu_

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::Device device_;
  int rank_ = 0;
  int size_ = 1;
  bool can_coalesce_ = false;  // the backend's capability (supportsCoalescing)
  Matching matching_ = Matching::Tag;
  Completion completion_ = Completion::Host;
  std::string backend_name_;
  // Posted sends and (Completion::Stream) waited batches, not yet seen complete, in post or
  // wait order; a batch never waited has deadline time_point::max() until settle.
  std::deque<Watched> watched_;
  ModelsStreamWaits* model_ = nullptr;  // the backend, when it models stream waits (owned by pg_)
  void abort_group();  // the group's abort (aborts_group()); never throws
  // Posted batches that abort_all may have to abort (pruned of finished ones as posts go).
  std::mutex live_mu_;
  std::vector<std::weak_ptr<Batch>> live_;
  std::atomic<bool> aborted_{false};
  // A post in progress (its coalesced group open) and an abort_all that came meanwhile.
  std::mutex post_mu_;
  bool posting_ = false, abort_deferred_ = false;
};

}  // namespace zbpipe::runtime
