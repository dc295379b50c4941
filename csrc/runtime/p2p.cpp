// P2P batches over c10d: coalesced when the backend supports it, individual ops otherwise;
// waits bounded by a deadline on host and stream-ordered backends alike.
#include "runtime/p2p.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <iterator>
#include <optional>
#include <mutex>
#include <thread>
#include <utility>

#include "runtime/device.h"
#include "runtime/errors.h"

namespace zbpipe::runtime {

struct Batch {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> tensors;  // receive buffers (and Completion::Host sends) until complete
  bool done = false;                // seen complete: works and tensors released
  bool collective = false;          // a collective (post_collective): completed by polling
  std::vector<c10::Stream> streams;  // Completion::Stream: the streams ordered after it
  // The group it was posted on, set by track_live: an abandoned batch is released once its
  // group is gone (see P2P::abandon).
  std::optional<c10::weak_intrusive_ptr<c10d::ProcessGroup>> group;
};

int wire_tag(int tag, int sender, int receiver) {
  ZB_CHECK(tag >= 0 && tag < (1 << 30), "message tag ", tag, " out of range");
  return tag * 2 + (sender < receiver ? 1 : 0);
}

P2P::P2P(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device, P2POptions options)
    : pg_(std::move(pg)), device_(device) {
  ZB_CHECK(pg_, "a process group is required");
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  backend_name_ = pg_->getBackendName();
  // A one-rank pipeline never communicates (and may have no backend for `device`).
  c10::intrusive_ptr<c10d::Backend> backend;
  if (size_ > 1) backend = pg_->getBackend(device_.type());
  can_coalesce_ = backend && backend->supportsCoalescing();
  matching_ = options.stream_ordered.value_or(!device_.is_cpu()) ? Matching::IssueOrder : Matching::Tag;
  // Work::wait orders the caller's stream after the work on accelerators, and is driven so on
  // a backend modelling one. On a CPU group (Gloo) Work::wait has no deadline, and nothing but
  // the host orders compute after a receive: complete each one before use.
  const bool stream_waits =
      !device_.is_cpu() || (backend && dynamic_cast<const ModelsStreamWaits*>(backend.get()) != nullptr);
  completion_ = matching_ == Matching::IssueOrder && stream_waits ? Completion::Stream : Completion::Host;
  model_ = dynamic_cast<ModelsStreamWaits*>(backend.get());
  (void)abandoned();  // a recovery builds a new P2P: what a destroyed group's steps abandoned goes now
}

P2P::~P2P() = default;

std::shared_ptr<Batch> P2P::post(std::vector<P2POp> ops) {
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    if (aborted_) throw CommAborted("communication of this rank was aborted (a peer failed)");
    posting_ = true;  // an abort_all from now on waits for the post's end (see abort_all)
  }
  struct Posting {  // ends the post, doing the abort that came during it
    P2P& p;
    ~Posting() {
      bool abort = false;
      {
        std::lock_guard<std::mutex> lock(p.post_mu_);
        p.posting_ = false;
        abort = std::exchange(p.abort_deferred_, false);
      }
      if (abort) p.abort_group();
    }
  } posting{*this};
  auto batch = std::make_shared<Batch>();
  batch->tensors.reserve(ops.size());
  auto issue = [&](P2POp& op) {
    std::vector<at::Tensor> one{op.tensor};
    ZB_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, "bad peer rank ", op.peer,
             " for rank ", rank_, " in a group of ", size_);
    const int tag = wire_tag(op.tag, op.is_send ? rank_ : op.peer, op.is_send ? op.peer : rank_);
    auto work = op.is_send ? pg_->send(one, op.peer, tag) : pg_->recv(one, op.peer, tag);
    ZB_CHECK(work || (can_coalesce_ && (ops.size() > 1 || matching_ == Matching::IssueOrder)), "backend ",
             backend_name_, " returned no work for a ", op.is_send ? "send to" : "receive from", " rank ", op.peer);
    return work;
  };
  // Issue order: a lone op would travel over another communicator than a coalesced one (and
  // its peer may well batch the same message with others), so every batch is coalesced.
  if (can_coalesce_ && (ops.size() > 1 || matching_ == Matching::IssueOrder)) {
    pg_->startCoalescing(device_.type());
    try {
      for (auto& op : ops) issue(op);
    } catch (...) {
      pg_->endCoalescing(device_.type());
      throw;
    }
    auto work = pg_->endCoalescing(device_.type());
    ZB_CHECK(work, "backend ", backend_name_, " returned no work for a coalesced batch of ", ops.size(), " ops");
    batch->works.push_back(std::move(work));
  } else {
    for (auto& op : ops) batch->works.push_back(issue(op));
  }
  bool sends = false;
  for (auto& op : ops) {
    sends = sends || op.is_send;
    // A stream-ordered backend recorded the sent tensor on its stream: ours is not needed.
    if (!op.is_send || completion_ == Completion::Host) batch->tensors.push_back(std::move(op.tensor));
  }
  track_live(batch);
  if (sends) watch(batch);  // completed by progress or settle, whether waited or not
  return batch;
}

std::shared_ptr<Batch> P2P::post_collective(CollectiveOp op, std::chrono::milliseconds timeout,
                                            const std::string& what) {
  if (aborted_) throw CommAborted("communication of this rank was aborted (a peer failed)");
  auto batch = std::make_shared<Batch>();
  batch->collective = true;
  std::vector<at::Tensor> one{op.tensor};
  c10::intrusive_ptr<c10d::Work> work;
  switch (op.type) {
    case CollectiveOp::Type::Broadcast: {
      c10d::BroadcastOptions o;
      o.rootRank = op.root;
      o.timeout = timeout;
      work = pg_->broadcast(one, o);
      break;
    }
    case CollectiveOp::Type::AllReduceSum: {
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      o.timeout = timeout;
      work = pg_->allreduce(one, o);
      break;
    }
    case CollectiveOp::Type::ReduceSum: {
      c10d::ReduceOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      o.rootRank = op.root;
      o.timeout = timeout;
      work = pg_->reduce(one, o);
      break;
    }
  }
  ZB_CHECK(work, "backend ", backend_name_, " returned no work for a collective");
  batch->works.push_back(std::move(work));
  batch->tensors.push_back(std::move(op.tensor));
  track_live(batch);
  watch(batch).what = what;  // completed by wait, or by settle at the step's end
  return batch;
}

namespace {
// Abandoned batches (see P2P::abandon), each kept until its group is destroyed.
struct Graveyard {
  std::mutex mu;
  std::vector<std::shared_ptr<Batch>> batches;

  // Drops the batches whose group is gone: no message can land in them any more (the
  // group's backend, and with it every connection a late message could come through, went
  // with it; a batch's works hold its transport's buffers, sockets and threads, which go now).
  // The batches are destroyed outside the lock.
  void sweep() {
    std::vector<std::shared_ptr<Batch>> freed;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto gone = [](const std::shared_ptr<Batch>& b) { return b->group && b->group->expired(); };
      auto keep = std::stable_partition(batches.begin(), batches.end(), [&](const auto& b) { return !gone(b); });
      freed.assign(std::make_move_iterator(keep), std::make_move_iterator(batches.end()));
      batches.erase(keep, batches.end());
    }
  }
};
Graveyard& graveyard() {
  static auto* g = new Graveyard();  // never destroyed: batches may outlive static destructors
  return *g;
}
}  // namespace

void P2P::abandon(std::shared_ptr<Batch> batch) {
  if (!batch || (batch->done && batch->works.empty())) return;
  Graveyard& g = graveyard();
  g.sweep();
  std::lock_guard<std::mutex> lock(g.mu);
  g.batches.push_back(std::move(batch));
}

size_t P2P::abandoned() {
  Graveyard& g = graveyard();
  g.sweep();
  std::lock_guard<std::mutex> lock(g.mu);
  return g.batches.size();
}

void P2P::drop_done() {
  watched_.erase(std::remove_if(watched_.begin(), watched_.end(), [](const Watched& w) { return w.batch->done; }),
                 watched_.end());
}

void P2P::abandon_watched() {
  for (auto& w : watched_) abandon(std::move(w.batch));
  watched_.clear();
}

namespace {
[[noreturn]] void wait_failed(const std::string& what, const std::string& backend,
                              std::chrono::milliseconds timeout, const std::string& why, int owner) {
  throw LateBatch(::zbpipe::detail::str(
      "waiting for ", what, " failed on backend ", backend, " (timeout ", timeout.count() / 1000.0,
      " s; a peer may have died or diverged): ", why), owner);
}
[[noreturn]] void aborted_wait(const std::string& what) {
  throw CommAborted(::zbpipe::detail::str("waiting for ", what, " was aborted (a peer failed)"));
}
}  // namespace

void P2P::finish(Batch& batch) {
  std::lock_guard<std::mutex> lock(live_mu_);  // abort_all reads the works
  batch.done = true;
  batch.works.clear();
  batch.tensors.clear();
}

template <typename F>
void P2P::translated(const Watched& w, F&& f) {
  try {
    f();
  } catch (const PipelineError&) {
    throw;
  } catch (const std::exception& e) {
    if (aborted_) aborted_wait(w.what);
    wait_failed(w.what, backend_name_, w.timeout, e.what(), w.owner);
  }
}

void P2P::complete_on_host(Watched& w) {
  for (auto& work : w.batch->works) {
    bool completed = false;
    translated(w, [&] {
      // Gloo completes a work in Work::wait (its isCompleted stays false until then): wait
      // there, for what is left of the deadline.
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(w.deadline - std::chrono::steady_clock::now());
      completed = work->wait(std::max(left, std::chrono::milliseconds(1)));
    });
    if (!completed || aborted_) aborted_wait(w.what);  // Work::wait returns false once aborted
  }
  finish(*w.batch);
}

void P2P::complete_collective(Watched& w) {
  // Gloo completes a collective on its own threads and cannot abort it: wait on the work in
  // slices (a condition variable, no spinning: on a loaded host a spinning rank takes the CPU
  // its peers need to reach the collective), checking the abort and the deadline in between.
  constexpr auto kSlice = std::chrono::milliseconds(20);
  for (auto& work : w.batch->works) {
    translated(w, [&] {
      for (;;) {
        if (aborted_) aborted_wait(w.what);
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(w.deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) wait_failed(w.what, backend_name_, w.timeout, "not complete by its deadline", w.owner);
        try {
          work->wait(std::min(left, kSlice));
          return;
        } catch (const c10::Error&) {
          // The slice ran out ("Operation timed out!"), or the work failed. It may also have
          // completed right after the slice: its own exception then, or none.
          if (!work->isCompleted()) continue;
          if (auto e = work->exception()) std::rethrow_exception(e);
          return;
        }
      }
    });
  }
  finish(*w.batch);
}

void P2P::poll(Watched& w) {
  if (aborted_) aborted_wait(w.what);
  for (auto& work : w.batch->works) {
    if (model_) model_->host_waits(*work);
    translated(w, [&] {
      for (int spins = 0; !work->isCompleted(); ++spins) {
        if (aborted_) aborted_wait(w.what);
        if (std::chrono::steady_clock::now() > w.deadline)
          wait_failed(w.what, backend_name_, w.timeout, "not complete by its deadline", w.owner);
        if (spins < 64) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 20 : 500));
        }
      }
      if (auto e = work->exception()) std::rethrow_exception(e);
    });
  }
  finish(*w.batch);
}

bool P2P::probe(Watched& w) {
  if (aborted_) aborted_wait(w.what);
  bool complete = true;
  translated(w, [&] {
    for (auto& work : w.batch->works) {
      if (!work->isCompleted()) {
        complete = false;
        return;
      }
      if (auto e = work->exception()) std::rethrow_exception(e);
    }
  });
  if (complete) {
    finish(*w.batch);
    return true;
  }
  if (std::chrono::steady_clock::now() > w.deadline)
    wait_failed(w.what, backend_name_, w.timeout, "not complete by its deadline", w.owner);
  return false;
}

P2P::Watched& P2P::watch(const std::shared_ptr<Batch>& batch) {
  for (auto& w : watched_)
    if (w.batch == batch) return w;
  watched_.push_back(Watched{batch, std::chrono::steady_clock::time_point::max(), std::chrono::milliseconds(0),
                             "a send of this step", -1});
  return watched_.back();
}

void P2P::wait(const std::shared_ptr<Batch>& batch, std::chrono::milliseconds timeout,
               const std::string& what, bool host_complete, int owner) {
  ZB_CHECK(batch, "waiting on no batch (", what, ")");
  if (batch->done) return;
  if (aborted_) aborted_wait(what);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (completion_ == Completion::Host) {
    Watched w{batch, deadline, timeout, what, owner};
    // A watched send batch is then done: progress and settle drop it. A collective completes on
    // the backend's own threads: polled, so that an abort ends the wait (Gloo cannot abort it).
    if (batch->collective) complete_collective(w);
    else complete_on_host(w);
    return;
  }
  Watched& w = watch(batch);  // deque: the reference survives later push_backs
  if (w.deadline == std::chrono::steady_clock::time_point::max()) {
    w.deadline = deadline;
    w.timeout = timeout;
    w.what = what;
    w.owner = owner;
  }
  // Per stream: a batch waited on one stream is not yet ordered before another's work.
  const c10::Stream stream = current_stream(device_);
  if (std::find(batch->streams.begin(), batch->streams.end(), stream) == batch->streams.end()) {
    translated(w, [&] {
      for (auto& work : batch->works) work->wait();  // the current stream waits; the host does not
    });
    batch->streams.push_back(stream);
  }
  if (host_complete) poll(w);
}

void P2P::progress() {
  // Gloo completes a work only in Work::wait: there is nothing to see without blocking, and
  // settle() skips what a wait completed meanwhile. Returning here keeps the per-action call
  // from scanning every send of the step (they accumulate until settle on this path).
  if (completion_ == Completion::Host) return;
  for (auto it = watched_.begin(); it != watched_.end();) {
    if (it->batch->done || probe(*it)) {
      it = watched_.erase(it);
    } else {
      ++it;
    }
  }
}

void P2P::settle(std::chrono::milliseconds timeout) {
  if (model_) model_->settling();
  const auto now = std::chrono::steady_clock::now();
  for (auto& w : watched_)
    if (w.deadline == std::chrono::steady_clock::time_point::max()) {
      w.deadline = now + timeout;
      w.timeout = timeout;
    }
  while (!watched_.empty()) {
    Watched& w = watched_.front();
    if (!w.batch->done) {
      if (completion_ == Completion::Host) {
        if (w.batch->collective) complete_collective(w);
        else complete_on_host(w);
      } else if (!probe(w)) {
        poll(w);  // the host blocks only on what is not complete yet
      }
    }
    watched_.pop_front();
  }
}

// ---- abort (failure propagation, see failure_watch.h) ------------------------------------

c10::intrusive_ptr<c10d::Store> P2P::store() const { return pg_->getStore(); }

void P2P::track_live(const std::shared_ptr<Batch>& batch) {
  batch->group.emplace(pg_);
  std::lock_guard<std::mutex> lock(live_mu_);
  if (live_.size() >= 64 && live_.size() % 64 == 0) {  // amortised pruning of finished batches
    live_.erase(std::remove_if(live_.begin(), live_.end(),
                               [](const std::weak_ptr<Batch>& w) {
                                 auto b = w.lock();
                                 return !b || b->works.empty();
                               }),
                live_.end());
  }
  live_.push_back(batch);
}

void P2P::abort_all() {
  if (aborted_.exchange(true)) return;
  if (aborts_group()) {
    // Accelerators (NCCL), and a backend modelling one: the host waits on nothing, the compute
    // stream may already wait on a receive that never comes; the group's abort ends the
    // communicators, so the kernels stuck on them end and the stream runs again.
    {
      std::lock_guard<std::mutex> lock(post_mu_);
      if (posting_) {
        abort_deferred_ = true;  // the post aborts at its end
        return;
      }
    }
    abort_group();
    return;
  }
  std::lock_guard<std::mutex> lock(live_mu_);
  for (auto& weak : live_) {
    auto b = weak.lock();
    if (!b || b->works.empty()) continue;
    for (auto& w : b->works) {
      try {
        if (w) w->abort();
      } catch (const std::exception&) {
        // A backend without Work::abort: its wait ends at its own timeout.
      }
    }
  }
}

void P2P::abort_group() {
  try {
    pg_->abort();
  } catch (const std::exception&) {
  }
}

}  // namespace zbpipe::runtime
