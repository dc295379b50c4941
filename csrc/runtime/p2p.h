// Point-to-point messages over a c10d::ProcessGroup: an adjacent group of sends/receives is
// posted as one batch, coalesced (startCoalescing/endCoalescing) where the backend supports it,
// one isend/irecv per tensor otherwise -- what torch.distributed.batch_isend_irecv does.
// c10d stays behind this header (only p2p.cpp includes it) so other runtime files compile fast.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
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

// A posted batch (opaque: holds the c10d works and keeps its tensors alive until waited).
struct Batch;

class P2P {
 public:
  // `device` is where messages live: CPU for Gloo, the rank's GPU for NCCL.
  P2P(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device);
  ~P2P();
  P2P(const P2P&) = delete;
  P2P& operator=(const P2P&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const c10::Device& device() const { return device_; }
  const std::string& backend_name() const { return backend_name_; }
  // One work per batch (NCCL) rather than one per tensor.
  bool coalesces() const { return coalesce_; }
  // Messages match on (peer, tag) and complete on the host (Gloo): receives may be posted in
  // any order and ahead of time. Stream-ordered backends (NCCL) match on issue order instead.
  bool tag_matched() const { return host_blocking_; }

  // Posts `ops` (non-empty) as one batch and returns it; the batch keeps the tensors alive.
  std::shared_ptr<Batch> post(std::vector<P2POp> ops);

  // Completes `batch` (idempotent). Host backends (Gloo) block the host for at most `timeout`
  // and throw on timeout or peer failure; device backends (NCCL) only make the current stream
  // wait on the communication (the process group's own timeout watches the device side).
  // `what` (e.g. "1RECV_F0 from rank 0") goes into the error message.
  void wait(Batch& batch, std::chrono::milliseconds timeout, const std::string& what);
  // The process group's c10d store (every group has one; null only for a group built without).
  c10::intrusive_ptr<c10d::Store> store() const;

  // Thread-safe (called from the failure watcher): aborts every posted, unfinished batch
  // (Work::abort, and the backend's abort where waits do not block the host) so a wait blocked
  // on one returns at once; from then on post and wait throw CommAborted. Irreversible: the
  // group's pending traffic is lost.
  void abort_all();
  bool aborted() const { return aborted_.load(); }

  // Keeps an unfinished batch (its works and buffers) alive for the rest of the process: after
  // a failure a late message may still land in a posted receive buffer, which must not have
  // been freed. Costs the batch's memory, only on failure.
  static void abandon(std::shared_ptr<Batch> batch);

 private:
  void track_live(const std::shared_ptr<Batch>& batch);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::Device device_;
  int rank_ = 0;
  int size_ = 1;
  bool coalesce_ = false;
  bool host_blocking_ = true;
  std::string backend_name_;
  // Posted batches that abort_all may have to abort (pruned of finished ones as posts go).
  std::mutex live_mu_;
  std::vector<std::weak_ptr<Batch>> live_;
  std::atomic<bool> aborted_{false};
};

}  // namespace zbpipe::runtime
