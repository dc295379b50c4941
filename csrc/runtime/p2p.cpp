// P2P batches over c10d: coalesced when the backend supports it, individual ops otherwise.
#include "runtime/p2p.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <mutex>

#include "runtime/errors.h"

namespace zbpipe::runtime {

struct Batch {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> tensors;  // alive until the batch completes
  bool done = false;
};

int wire_tag(int tag, int sender, int receiver) {
  ZB_CHECK(tag >= 0 && tag < (1 << 30), "message tag ", tag, " out of range");
  return tag * 2 + (sender < receiver ? 1 : 0);
}

P2P::P2P(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device)
    : pg_(std::move(pg)), device_(device) {
  ZB_CHECK(pg_, "a process group is required");
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  backend_name_ = pg_->getBackendName();
  // A one-rank pipeline never communicates (and may have no backend for `device`).
  if (size_ > 1) coalesce_ = pg_->getBackend(device_.type())->supportsCoalescing();
  // Only host backends complete a receive on the host; NCCL-style backends order the
  // compute stream after the communication instead.
  host_blocking_ = device_.is_cpu();
}

P2P::~P2P() = default;

std::shared_ptr<Batch> P2P::post(std::vector<P2POp> ops) {
  if (aborted_) throw CommAborted("communication of this rank was aborted (a peer failed)");
  auto batch = std::make_shared<Batch>();
  batch->tensors.reserve(ops.size());
  auto issue = [&](P2POp& op) {
    std::vector<at::Tensor> one{op.tensor};
    ZB_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, "bad peer rank ", op.peer,
             " for rank ", rank_, " in a group of ", size_);
    const int tag = wire_tag(op.tag, op.is_send ? rank_ : op.peer, op.is_send ? op.peer : rank_);
    return op.is_send ? pg_->send(one, op.peer, tag) : pg_->recv(one, op.peer, tag);
  };
  if (coalesce_ && ops.size() > 1) {
    pg_->startCoalescing(device_.type());
    try {
      for (auto& op : ops) issue(op);
    } catch (...) {
      pg_->endCoalescing(device_.type());
      throw;
    }
    batch->works.push_back(pg_->endCoalescing(device_.type()));
  } else {
    for (auto& op : ops) batch->works.push_back(issue(op));
  }
  for (auto& op : ops) batch->tensors.push_back(std::move(op.tensor));
  track_live(batch);
  return batch;
}

void P2P::abandon(std::shared_ptr<Batch> batch) {
  if (!batch || batch->done) return;
  static std::mutex mu;
  static auto* graveyard = new std::vector<std::shared_ptr<Batch>>();  // never freed, on purpose
  std::lock_guard<std::mutex> lock(mu);
  graveyard->push_back(std::move(batch));
}

void P2P::wait(Batch& batch, std::chrono::milliseconds timeout, const std::string& what) {
  if (batch.done) return;
  auto aborted = [&] { return CommAborted(::zbpipe::detail::str("waiting for ", what, " was aborted (a peer failed)")); };
  if (aborted_) throw aborted();
  for (auto& w : batch.works) {
    if (!w) continue;
    bool completed = true;
    try {
      if (host_blocking_) {
        completed = w->wait(timeout);
      } else {
        w->wait();  // stream-ordered: never blocks the host
      }
    } catch (const std::exception& e) {
      if (aborted_) throw aborted();
      throw PipelineError(::zbpipe::detail::str(
          "waiting for ", what, " failed on backend ", backend_name_, " (timeout ",
          timeout.count() / 1000.0, " s; a peer may have died or diverged): ", e.what()));
    }
    if (!completed || aborted_) throw aborted();  // Work::wait returns false once aborted
  }
  std::lock_guard<std::mutex> lock(live_mu_);  // abort_all reads the works
  batch.done = true;
  batch.works.clear();
  batch.tensors.clear();
}

// ---- abort (failure propagation, see failure_watch.h) ------------------------------------

c10::intrusive_ptr<c10d::Store> P2P::store() const { return pg_->getStore(); }

void P2P::track_live(const std::shared_ptr<Batch>& batch) {
  std::lock_guard<std::mutex> lock(live_mu_);
  if (live_.size() >= 64 && live_.size() % 64 == 0) {  // amortised pruning of finished batches
    live_.erase(std::remove_if(live_.begin(), live_.end(),
                               [](const std::weak_ptr<Batch>& w) {
                                 auto b = w.lock();
                                 return !b || b->done;
                               }),
                live_.end());
  }
  live_.push_back(batch);
}

void P2P::abort_all() {
  if (aborted_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    for (auto& weak : live_) {
      auto b = weak.lock();
      if (!b || b->done) continue;
      for (auto& w : b->works) {
        try {
          if (w) w->abort();
        } catch (const std::exception&) {
          // A backend without Work::abort: its wait ends at its own timeout.
        }
      }
    }
  }
  if (!host_blocking_) {
    // Stream-ordered backends (NCCL): the host waits on nothing; abort the communicators so
    // the kernels stuck on the failed peer end.
    try {
      pg_->abort();
    } catch (const std::exception&) {
    }
  }
}

}  // namespace zbpipe::runtime
