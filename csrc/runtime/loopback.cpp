// The in-process loopback backend: tag-matched delivery through memory, coalescing that only
// groups what is recorded, and a per-rank log of every post, wait and poll.
#include "runtime/loopback.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/Event.h>

#include "runtime/control_group.h"
#include "runtime/device.h"
#include "runtime/errors.h"
#include "runtime/p2p.h"

namespace zbpipe::runtime {

namespace {
class LoopbackWork;

// Raw copy: a receive buffer may already be an autograd leaf when the data lands late (with
// stream-like waits the receiver runs ahead), and the copy is transport, not computation. On
// a device (CUDA) the copy is a kernel on the copying thread's current stream, and the event
// after it is what the receiver's stream waits on (LoopbackWork::wait) and isCompleted asks.
std::optional<c10::Event> deliver(const at::Tensor& dst, const at::Tensor& src) {
  ZB_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes() &&
               dst.device().type() == src.device().type(),
           "loopback: a message of ", src.nbytes(), " bytes on ", src.device(), " for a receive of ", dst.nbytes(),
           " on ", dst.device());
  if (dst.is_cpu()) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes());
    return std::nullopt;
  }
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // no version bump, no graph
    dst.copy_(src, /*non_blocking=*/true);
  }
  c10::Event done(dst.device().type());
  done.record(current_stream(dst.device()));
  return done;
}

// A message sent before its receive was posted: a copy, ready once its event has passed.
struct Message {
  at::Tensor data;
  std::optional<c10::Event> ready;
};
}  // namespace

struct LoopbackWorld::State {
  struct Pending {  // a receive waiting for its message
    at::Tensor buffer;
    c10::intrusive_ptr<LoopbackWork> work;
    // On a device: the receiver's stream when it posted, which the copy into `buffer` waits
    // for (NCCL's recv runs on its stream after the poster's current stream: syncStream).
    std::optional<c10::Event> posted;
  };
  using Key = std::tuple<int, int, int>;  // sender, receiver, tag
  std::mutex mu;
  int size = 0;
  bool stream_waits = false;
  std::map<Key, std::deque<Message>> messages;     // sent, not yet received
  std::map<Key, std::deque<Pending>> receives;     // posted, not yet matched
  std::vector<std::vector<LoopbackEvent>> logs;    // per rank
  std::vector<int> next_work;                      // per rank
  std::atomic<bool> no_work{false};                // return_no_work
  std::vector<int> aborts;                         // per rank: Backend::abort calls
  std::vector<int> work_aborts;                    // per rank: Work::abort calls
  std::vector<int> aborts_in_coalescing;           // per rank: Backend::abort inside a coalesced post
  std::vector<char> coalescing;                    // per rank: inside a coalesced post now
  std::vector<double> hold_posts_s;                // per rank: hold_coalesced_posts
  std::vector<double> abort_delay_s;               // per rank: slow_aborts
  // A collective (all-reduce, broadcast, reduce), matched by call order across the world.
  enum class CollectiveKind { AllReduce, Broadcast, Reduce };
  struct Collective {
    CollectiveKind kind = CollectiveKind::AllReduce;
    int root = -1;
    std::vector<at::Tensor> tensors;
    std::vector<c10::intrusive_ptr<LoopbackWork>> works;
    int arrived = 0;
  };
  std::map<int64_t, Collective> collectives;
  std::vector<int64_t> next_collective;            // per rank
  std::map<std::string, std::shared_ptr<LoopbackWorld>> controls;  // control worlds by name
  // The store's request counts (CountingStore), under a mutex of their own.
  std::shared_ptr<std::map<std::string, int64_t>> store_requests = std::make_shared<std::map<std::string, int64_t>>();
  std::shared_ptr<std::mutex> store_mu = std::make_shared<std::mutex>();
  std::vector<std::vector<size_t>> settles;        // per rank: log positions where P2P settled
  int lagging_polls = 0;                           // see LoopbackWorld's constructor

  void log(int rank, LoopbackEvent e) {
    std::lock_guard<std::mutex> lock(mu);
    logs[rank].push_back(std::move(e));
  }
};

namespace {

// Completes once all of its ops have: one op for a lone send/recv, a whole coalesced group.
class LoopbackWork : public c10d::Work {
 public:
  LoopbackWork(std::shared_ptr<LoopbackWorld::State> state, int rank, int id)
      : c10d::Work(rank, c10d::OpType::UNKNOWN),
        state_(std::move(state)),
        rank_of_(rank),
        id_(id),
        lag_left_(state_->lagging_polls) {}

  void add_op() {
    std::lock_guard<std::mutex> lock(ops_mu_);
    ++open_;
  }
  void op_done() {
    bool all = false;
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      all = --open_ == 0 && sealed_ && !failed_;
    }
    if (all) finish();
  }
  // No more ops join (a lone op, or endCoalescing).
  void seal() {
    bool all = false;
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      sealed_ = true;
      all = open_ == 0 && !failed_;
    }
    if (all) finish();
  }
  // Ends the work with an error (an abort), unless it is complete already.
  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      if (failed_ || c10d::Work::isCompleted()) return;
      failed_ = true;
    }
    finish(std::make_exception_ptr(std::runtime_error(why)));
  }
  // Work::abort: counted (on NCCL a synchronous ncclCommAbort), and the work ends.
  void abort() override;
  // A device copy into one of its receive buffers (before that op is done).
  void add_event(c10::Event e) {
    std::lock_guard<std::mutex> lock(ops_mu_);
    events_.push_back(std::move(e));
  }
  bool isCompleted() override {
    if (!c10d::Work::isCompleted()) return false;
    std::lock_guard<std::mutex> lock(ops_mu_);
    if (lag_left_ > 0) {  // a device behind the host (lagging_polls): not seen complete yet
      --lag_left_;
      return false;
    }
    for (auto& e : events_)
      if (!e.query()) return false;
    return true;
  }
  // The caller's stream waits for the copies; the host waits until every op is matched
  // (unless stream_waits: a device stream cannot wait for an event not yet recorded).
  bool wait(std::chrono::milliseconds timeout) override {
    state_->log(rank_of_, LoopbackEvent{LoopbackEvent::Type::Wait, id_, false, {}});
    bool ok = true;
    if (!state_->stream_waits) ok = c10d::Work::wait(timeout);
    std::lock_guard<std::mutex> lock(ops_mu_);
    for (auto& e : events_) e.block(current_stream(c10::Device(e.device_type(), e.device_index())));
    return ok;
  }
  int id() const { return id_; }

 private:
  std::shared_ptr<LoopbackWorld::State> state_;
  int rank_of_, id_;
  std::mutex ops_mu_;
  int open_ = 0;
  bool sealed_ = false;
  bool failed_ = false;  // ended by an abort
  std::vector<c10::Event> events_;  // device copies into its receive buffers
  int lag_left_ = 0;                 // isCompleted answers still to refuse (lagging_polls)
};

// Unmatched receives of `rank` (all, or only `work`'s), taken out of the world: a late message
// then waits in `messages` instead. Call under state.mu.
std::vector<c10::intrusive_ptr<LoopbackWork>> take_receives(LoopbackWorld::State& state, int rank,
                                                            const LoopbackWork* work = nullptr) {
  std::vector<c10::intrusive_ptr<LoopbackWork>> out;
  for (auto& [key, pending] : state.receives) {
    if (std::get<1>(key) != rank) continue;
    for (auto it = pending.begin(); it != pending.end();) {
      if (work && it->work.get() != work) {
        ++it;
        continue;
      }
      out.push_back(it->work);
      it = pending.erase(it);
    }
  }
  return out;
}

void LoopbackWork::abort() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->work_aborts[rank_of_];
    (void)take_receives(*state_, rank_of_, this);
  }
  fail("loopback: the work was aborted");
}

// Declares ModelsStreamWaits: P2P drives it as it drives NCCL, so the log is a GPU's.
class LoopbackBackend : public c10d::Backend, public ModelsStreamWaits, public ProvidesControlGroups {
 public:
  LoopbackBackend(std::shared_ptr<LoopbackWorld::State> state, int rank, int size)
      : c10d::Backend(rank, size), state_(std::move(state)) {}

  const std::string getBackendName() const override { return "loopback"; }
  bool supportsCoalescing() const override { return true; }
  // As NCCL's communicator abort (ProcessGroup::abort): counted, and every unfinished work of
  // this rank (its unmatched receives, its all-reduce) ends with an error.
  void abort() override {
    std::vector<c10::intrusive_ptr<LoopbackWork>> ended;
    double delay = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      ++state_->aborts[rank_];
      if (state_->coalescing[rank_]) ++state_->aborts_in_coalescing[rank_];
      ended = take_receives(*state_, rank_);
      for (auto& [id, c] : state_->collectives)
        if (c.works[rank_]) ended.push_back(c.works[rank_]);
      delay = state_->abort_delay_s[rank_];
    }
    if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    for (auto& w : ended) w->fail("loopback: the communicator was aborted");
  }

  // A control world of its own per name, in memory like this one.
  c10::intrusive_ptr<c10d::ProcessGroup> control_group(const std::string& name) override {
    std::shared_ptr<LoopbackWorld> world;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      auto& w = state_->controls[name];
      if (!w) w = std::make_shared<LoopbackWorld>(size_);
      world = w;
    }
    return world->group(rank_);
  }

  // Sums `tensors[0]` (CPU) over the world's ranks: the n-th call of each rank meet.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions&) override {
    return collective(LoopbackWorld::State::CollectiveKind::AllReduce, -1, tensors);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& o) override {
    return collective(LoopbackWorld::State::CollectiveKind::Broadcast, static_cast<int>(o.rootRank), tensors);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& o) override {
    return collective(LoopbackWorld::State::CollectiveKind::Reduce, static_cast<int>(o.rootRank), tensors);
  }

  // Every rank's k-th collective meets the others' k-th: the same kind, root and size, else a
  // loud error (a real backend would hang or corrupt). Completes when the last rank arrives
  // (CPU tensors: the copy is done on the host then).
  c10::intrusive_ptr<c10d::Work> collective(LoopbackWorld::State::CollectiveKind kind, int root,
                                            std::vector<at::Tensor>& tensors) {
    ZB_CHECK(tensors.size() == 1 && tensors[0].is_cpu(), "loopback: a collective takes one CPU tensor");
    auto work = make_work();
    work->add_op();
    work->seal();
    std::vector<c10::intrusive_ptr<LoopbackWork>> done;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      const int64_t index = state_->next_collective[rank_]++;
      auto& c = state_->collectives[index];
      if (c.works.empty()) {
        c.kind = kind;
        c.root = root;
        c.tensors.resize(size_);
        c.works.resize(size_);
      }
      ZB_CHECK(c.kind == kind && c.root == root, "loopback rank ", rank_, ": collective ", index,
               " differs from another rank's (kind or root)");
      c.tensors[rank_] = tensors[0];
      c.works[rank_] = work;
      if (++c.arrived == size_) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        for (int r = 1; r < size_; ++r)
          ZB_CHECK(c.tensors[r].numel() == c.tensors[0].numel(), "loopback: collective ", index,
                   " has ", c.tensors[r].numel(), " elements on rank ", r, ", ", c.tensors[0].numel(), " on rank 0");
        using K = LoopbackWorld::State::CollectiveKind;
        if (kind == K::Broadcast) {
          for (int r = 0; r < size_; ++r)
            if (r != root) c.tensors[r].copy_(c.tensors[root]);
        } else {
          auto sum = c.tensors[0].clone();
          for (int r = 1; r < size_; ++r) sum.add_(c.tensors[r]);
          for (int r = 0; r < size_; ++r)
            if (kind == K::AllReduce || r == root) c.tensors[r].copy_(sum);
        }
        done = c.works;
        state_->collectives.erase(index);
      }
    }
    for (auto& w : done) w->op_done();
    return work;
  }

  void host_waits(const c10d::Work& work) override {
    const auto* w = dynamic_cast<const LoopbackWork*>(&work);
    state_->log(rank_, LoopbackEvent{LoopbackEvent::Type::Sync, w ? w->id() : -1, false, {}});
  }
  void settling() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->settles[rank_].push_back(state_->logs[rank_].size());
  }

  void startCoalescing() override {
    ZB_CHECK(!group_, "loopback rank ", rank_, ": startCoalescing twice");
    group_ = make_work();
    group_ops_.clear();
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->coalescing[rank_] = 1;
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    ZB_CHECK(group_, "loopback rank ", rank_, ": endCoalescing without startCoalescing");
    double hold = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      hold = state_->hold_posts_s[rank_];
    }
    if (hold > 0) std::this_thread::sleep_for(std::chrono::duration<double>(hold));
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->coalescing[rank_] = 0;
    }
    auto work = std::move(group_);
    group_.reset();
    state_->log(rank_, LoopbackEvent{LoopbackEvent::Type::Post, work->id(), true, std::move(group_ops_)});
    group_ops_.clear();
    work->seal();
    if (state_->no_work) return {};
    return work;
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return issue(true, tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return issue(false, tensors, src, tag);
  }

 private:
  c10::intrusive_ptr<LoopbackWork> make_work() {
    int id;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      id = state_->next_work[rank_]++;
    }
    return c10::make_intrusive<LoopbackWork>(state_, rank_, id);
  }

  c10::intrusive_ptr<c10d::Work> issue(bool is_send, std::vector<at::Tensor>& tensors, int peer, int tag) {
    ZB_CHECK(tensors.size() == 1, "loopback: one tensor per op, got ", tensors.size());
    ZB_CHECK(peer >= 0 && peer < size_ && peer != rank_, "loopback rank ", rank_, ": bad peer ", peer);
    const bool lone = !group_;
    auto work = lone ? make_work() : group_;
    work->add_op();
    const at::Tensor& t = tensors[0];
    LoopbackOp op{is_send, peer, tag, static_cast<int64_t>(t.numel() * t.element_size())};
    if (lone) {
      state_->log(rank_, LoopbackEvent{LoopbackEvent::Type::Post, work->id(), false, {op}});
    } else {
      group_ops_.push_back(op);
    }
    c10::intrusive_ptr<LoopbackWork> matched;  // a receive this send completes
    std::optional<c10::Event> copied;          // its device copy
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (is_send) {
        auto& waiting = state_->receives[{rank_, peer, tag}];
        if (!waiting.empty()) {
          auto r = std::move(waiting.front());
          waiting.pop_front();
          if (r.posted) {
            // The copy runs on the sender's stream, after what made `t` and after the
            // receiver's stream reached the post (until then its kernels may still read the
            // memory the buffer reuses); the buffer is in use on this stream till it is done.
            const c10::Stream here = current_stream(t.device());
            r.posted->block(here);
            record_on_stream(r.buffer, here);
          }
          copied = deliver(r.buffer, t);
          matched = std::move(r.work);
        } else {
          Message m;
          {
            at::AutoDispatchBelowADInplaceOrView below_autograd;
            m.data = t.detach().clone().contiguous();
          }
          if (!m.data.is_cpu()) {
            m.ready.emplace(m.data.device().type());
            m.ready->record(current_stream(m.data.device()));
          }
          state_->messages[{rank_, peer, tag}].push_back(std::move(m));
        }
      } else {
        auto& sent = state_->messages[{peer, rank_, tag}];
        if (!sent.empty()) {
          Message m = std::move(sent.front());
          sent.pop_front();
          if (m.ready) {  // this stream copies it once it is made, and holds it until copied
            const c10::Stream here = current_stream(tensors[0].device());
            m.ready->block(here);
            record_on_stream(m.data, here);
          }
          copied = deliver(tensors[0], m.data);
          matched = work;
        } else {
          LoopbackWorld::State::Pending p{tensors[0], work, std::nullopt};
          if (!tensors[0].is_cpu()) {
            p.posted.emplace(tensors[0].device().type());
            p.posted->record(current_stream(tensors[0].device()));
          }
          state_->receives[{peer, rank_, tag}].push_back(std::move(p));
        }
      }
    }
    if (copied) matched->add_event(std::move(*copied));
    if (is_send) work->op_done();  // buffered: a send completes at once
    if (matched) matched->op_done();
    if (lone) work->seal();
    if (state_->no_work && lone) return {};
    return work;
  }

  std::shared_ptr<LoopbackWorld::State> state_;
  c10::intrusive_ptr<LoopbackWork> group_;  // open coalesced group, if any
  std::vector<LoopbackOp> group_ops_;
};

}  // namespace

namespace {

// The world's store: a HashStore that counts the requests made to it (what a TCPStore server
// would serve), shared by its clones.
class CountingStore : public c10d::Store {
 public:
  using Counts = std::map<std::string, int64_t>;
  CountingStore(c10::intrusive_ptr<c10d::Store> inner, std::shared_ptr<Counts> counts, std::shared_ptr<std::mutex> mu)
      : inner_(std::move(inner)), counts_(std::move(counts)), mu_(std::move(mu)) {}

  c10::intrusive_ptr<c10d::Store> clone() override { return c10::make_intrusive<CountingStore>(inner_, counts_, mu_); }
  void set(const std::string& k, const std::vector<uint8_t>& v) override { count("set"); inner_->set(k, v); }
  std::vector<uint8_t> compareSet(const std::string& k, const std::vector<uint8_t>& a,
                                  const std::vector<uint8_t>& b) override {
    count("compare_set");
    return inner_->compareSet(k, a, b);
  }
  std::vector<uint8_t> get(const std::string& k) override { count("get"); return inner_->get(k); }
  int64_t add(const std::string& k, int64_t v) override { count("add"); return inner_->add(k, v); }
  bool deleteKey(const std::string& k) override { count("delete_key"); return inner_->deleteKey(k); }
  bool check(const std::vector<std::string>& k) override { count("check"); return inner_->check(k); }
  int64_t getNumKeys() override { count("num_keys"); return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& k) override { count("wait"); inner_->wait(k); }
  void wait(const std::vector<std::string>& k, const std::chrono::milliseconds& t) override {
    count("wait");
    inner_->wait(k, t);
  }
  const std::chrono::milliseconds& getTimeout() const noexcept override { return inner_->getTimeout(); }
  void setTimeout(const std::chrono::milliseconds& t) override { inner_->setTimeout(t); }
  void queuePush(const std::string& k, const std::vector<uint8_t>& v) override {
    count("queue_push");
    inner_->queuePush(k, v);
    // HashStore wakes one waiter per push, maybe a pop on another queue (every rank's inbox
    // waits on the same condition); a set wakes them all to look again.
    inner_->set("zbpipe/loopback/queue-pushed", std::vector<uint8_t>{});
  }
  std::vector<uint8_t> queuePop(const std::string& k, bool block) override {
    count("queue_pop");
    return inner_->queuePop(k, block);
  }
  int64_t queueLen(const std::string& k) override { count("queue_len"); return inner_->queueLen(k); }

 private:
  void count(const char* op) {
    std::lock_guard<std::mutex> lock(*mu_);
    ++(*counts_)[op];
  }
  c10::intrusive_ptr<c10d::Store> inner_;
  std::shared_ptr<Counts> counts_;
  std::shared_ptr<std::mutex> mu_;
};

}  // namespace

LoopbackWorld::LoopbackWorld(int size, bool stream_waits, bool store, int lagging_polls)
    : state_(std::make_shared<State>()) {
  ZB_CHECK(size >= 1, "a loopback world needs at least one rank, got ", size);
  ZB_CHECK(lagging_polls >= 0, "lagging_polls must be >= 0, got ", lagging_polls);
  state_->size = size;
  state_->stream_waits = stream_waits;
  state_->lagging_polls = lagging_polls;
  state_->logs.resize(size);
  state_->settles.resize(size);
  state_->next_work.assign(size, 0);
  c10::intrusive_ptr<c10d::Store> shared;
  if (store)
    shared = c10::make_intrusive<CountingStore>(c10::make_intrusive<c10d::HashStore>(), state_->store_requests,
                                                state_->store_mu);
  state_->aborts.assign(size, 0);
  state_->work_aborts.assign(size, 0);
  state_->aborts_in_coalescing.assign(size, 0);
  state_->coalescing.assign(size, 0);
  state_->hold_posts_s.assign(size, 0.0);
  state_->abort_delay_s.assign(size, 0.0);
  state_->next_collective.assign(size, 0);
  for (int r = 0; r < size; ++r) {
    auto pg = shared ? c10::make_intrusive<c10d::ProcessGroup>(shared, r, size)
                     : c10::make_intrusive<c10d::ProcessGroup>(r, size);
    auto backend = c10::make_intrusive<LoopbackBackend>(state_, r, size);
    pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, backend);  // CUDA tensors
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
    groups_.push_back(std::move(pg));
  }
}

LoopbackWorld::~LoopbackWorld() = default;

int LoopbackWorld::size() const { return state_->size; }

c10::intrusive_ptr<c10d::ProcessGroup> LoopbackWorld::group(int rank) {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  return groups_[rank];
}

std::vector<LoopbackEvent> LoopbackWorld::events(int rank) const {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->logs[rank];
}

void LoopbackWorld::return_no_work(bool on) { state_->no_work = on; }

int64_t LoopbackWorld::host_waits(int rank) const {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  int64_t n = 0;
  for (const auto& e : state_->logs[rank]) n += e.type == LoopbackEvent::Type::Sync;
  return n;
}

int LoopbackWorld::aborts(int rank) const {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->aborts[rank];
}

int LoopbackWorld::work_aborts(int rank) const {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->work_aborts[rank];
}

int LoopbackWorld::aborts_in_coalescing(int rank) const {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->aborts_in_coalescing[rank];
}

bool LoopbackWorld::in_coalescing(int rank) const {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->coalescing[rank] != 0;
}

void LoopbackWorld::hold_coalesced_posts(int rank, double seconds) {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->hold_posts_s[rank] = seconds;
}

void LoopbackWorld::slow_aborts(int rank, double seconds) {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->abort_delay_s[rank] = seconds;
}

std::map<std::string, int64_t> LoopbackWorld::store_requests() const {
  std::lock_guard<std::mutex> lock(*state_->store_mu);
  return *state_->store_requests;
}

std::vector<size_t> LoopbackWorld::settles(int rank) const {
  ZB_CHECK(rank >= 0 && rank < state_->size, "rank ", rank, " outside the loopback world of ", state_->size);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->settles[rank];
}

void LoopbackWorld::clear_events() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& l : state_->logs) l.clear();
  for (auto& s : state_->settles) s.clear();
}

}  // namespace zbpipe::runtime
