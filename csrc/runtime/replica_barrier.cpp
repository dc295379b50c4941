// The replicas' meetings: dissemination barriers, the first through the store, the rest over
// the data-parallel group's control group.
#include "runtime/replica_barrier.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>

#include "runtime/errors.h"
#include "runtime/failure_watch.h"
#include "runtime/store_inbox.h"
#include "zbpipe/cancel.h"

namespace zbpipe::runtime {

std::shared_ptr<c10d::ProcessGroup> share_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group) return nullptr;
  return std::shared_ptr<c10d::ProcessGroup>(group.get(), [keep = group](c10d::ProcessGroup*) {});
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMeetTagBase = 16;
// A replica's connection that closed in a meeting: the replica died or failed, and the rank
// that knows why (its pipeline peer, waiting on it with data) reports it. This long, a meeting
// waits for that report (and names it) before it raises its own, causeless error.
constexpr std::chrono::milliseconds kReportGrace{2000};
// The meeting that opens a control group (every replica is there): it connects every pair a
// meeting uses where the group connects pairs lazily (zbpipe/control_plane.py).
constexpr int kOpeningTag = 1 << 19;

std::string meet_subject(int tag, int64_t round, int k, int from) {
  return detail::str("meet ", tag, " ", round, " ", k, " ", from);
}

[[noreturn]] void late(int from, int size, std::chrono::milliseconds timeout, const std::string& what) {
  throw PipelineError(detail::str("waiting for ", what, " failed: data-parallel group rank ", from, " (one of its ",
                                  size, " replicas) did not reach it within ", timeout.count() / 1000.0,
                                  " s (a replica may have died, diverged or still be computing)"));
}

}  // namespace

ReplicaGroup::ReplicaGroup(std::shared_ptr<c10d::ProcessGroup> group, FailureWatch& watch, size_t channel,
                           std::string control_name, const ControlGroupFactory& factory, ControlLinks& links)
    : group_(std::move(group)), watch_(watch), channel_(channel), control_name_(std::move(control_name)),
      factory_(factory), links_(links) {
  ZB_CHECK(group_ && group_->getStore(), "a data-parallel stage without its group or the group's store");
  rank_ = group_->getRank();
  size_ = group_->getSize();
}

void ReplicaGroup::meet(int tag, int64_t round, std::chrono::milliseconds timeout, const std::function<void()>& check,
                        const std::string& what) {
  if (size_ < 2) return;
  const auto deadline = Clock::now() + timeout;
  if (control_) {
    meet_through_control(tag, round, deadline, timeout, what);
    return;
  }
  meet_through_store(watch_, channel_, rank_, size_, tag, round, timeout, check, what);
  // Every replica is here: the control group's rendezvous waits for no one who will not come.
  try {
    control_ = open_control(c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(group_.get()), control_name_,
                            factory_, timeout);
  } catch (const std::exception& e) {
    throw PipelineError(detail::str("opening the control group of the data-parallel group (for ", what,
                                    ") failed: ", short_what(e)));
  }
  links_.add(control_);
  meet_through_control(kOpeningTag, 1, deadline, timeout, what);
}

void ReplicaGroup::await_report(Clock::time_point until, const std::string& what) {
  while (true) {
    const uint64_t gen = watch_.generation();
    if (watch_.seen()) throw CommAborted(detail::str("waiting for ", what, " was aborted (a peer failed)"));
    if (Clock::now() >= until) return;
    watch_.wait(gen, until);
  }
}

void meet_through_store(FailureWatch& watch, size_t channel, int rank, int size, int tag, int64_t round,
                        std::chrono::milliseconds timeout, const std::function<void()>& check, const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  try {
    for (int k = 0, dist = 1; dist < size; ++k, dist *= 2) {
      const int to = (rank + dist) % size, from = (rank - dist + size) % size;
      watch.send(channel, to, meet_subject(tag, round, k, rank));
      while (true) {
        const uint64_t gen = watch.generation();
        if (check) check();
        if (watch.seen()) throw CommAborted(detail::str("waiting for ", what, " was aborted (a peer failed)"));
        if (watch.take(channel, meet_subject(tag, round, k, from))) break;
        if (Clock::now() > deadline) late(from, size, timeout, what);
        watch.wait(gen, deadline + std::chrono::milliseconds(1));
      }
    }
  } catch (const PipelineError&) {
    throw;
  } catch (const Cancelled&) {
    throw;
  } catch (const std::exception& e) {
    throw PipelineError(detail::str("waiting for ", what, " through the data-parallel group's store (",
                                    describe_store(*watch.channel(channel).store),
                                    ") failed (the process hosting it may have exited): ", short_what(e)));
  }
}

void ReplicaGroup::meet_through_control(int tag, int64_t round, Clock::time_point deadline,
                                        std::chrono::milliseconds timeout, const std::string& what) {
  std::vector<std::shared_ptr<Batch>> sends;
  for (int k = 0, dist = 1; dist < size_; ++k, dist *= 2) {
    const int to = (rank_ + dist) % size_, from = (rank_ - dist + size_) % size_;
    const int t = kMeetTagBase + tag * 64 + k;
    // The backend may refuse a post (Gloo, once a replica's connection closed): as a wait that
    // failed, the rank that knows why gets its time to report it.
    auto post = [&](P2POp op) {
      try {
        return control_->post({op});
      } catch (const PipelineError&) {
        throw;  // this rank's communication was aborted: a peer's failure, already known
      } catch (const std::exception& e) {
        await_report(std::min(deadline, Clock::now() + kReportGrace), what);
        throw PipelineError(detail::str("waiting for ", what, " failed: the connection ", op.is_send ? "to" : "from",
                                        " data-parallel group rank ", op.peer, " closed (the replica died or "
                                        "failed): ", short_what(e)));
      }
    };
    sends.push_back(post(P2POp{true, to, t, at::full({1}, round, at::kLong)}));
    auto got = at::empty({1}, at::kLong);
    auto batch = post(P2POp{false, from, t, got});
    const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                               std::chrono::milliseconds(1));
    try {
      control_->wait(batch, left, detail::str(what, " (data-parallel group rank ", from, ")"));
    } catch (const LateBatch&) {
      P2P::abandon(batch);
      if (control_->aborted()) throw;
      if (Clock::now() >= deadline) late(from, size_, timeout, what);
      await_report(std::min(deadline, Clock::now() + kReportGrace), what);
      throw;
    } catch (...) {
      P2P::abandon(batch);
      throw;
    }
    const int64_t theirs = got.data_ptr<int64_t>()[0];  // a host tensor: no dispatch
    ZB_CHECK(theirs == round, "data-parallel group rank ", from, " met ", what, " as its meeting ", theirs,
             " while this rank meets it as its ", round, "th: the replicas ran different numbers of steps");
  }
  // The previous meeting's sends were received before anyone got here (a barrier): complete
  // them; this meeting's complete at the next one.
  for (auto& b : previous_sends_) control_->wait(b, timeout, detail::str("a token of ", what));
  control_->drop_done();
  previous_sends_ = std::move(sends);
}

void ReplicaBarrier::arrive_and_wait(std::chrono::milliseconds timeout, const std::function<void()>& check,
                                     const std::string& what) {
  group_->meet(stage_ * 2, ++round_, timeout, check, what);
}

void ReplicaBarrier::arrive_at_step_start(std::chrono::milliseconds timeout, const std::function<void()>& check,
                                          const std::string& what) {
  group_->meet(stage_ * 2 + 1, ++starts_, timeout, check, what);
}

}  // namespace zbpipe::runtime

namespace zbpipe::runtime {

std::vector<std::shared_ptr<c10d::ProcessGroup>> gloo_groups(const std::vector<std::shared_ptr<c10d::ProcessGroup>>& groups) {
  std::vector<std::shared_ptr<c10d::ProcessGroup>> out;
  for (const auto& g : groups) {
    if (!g || std::find(out.begin(), out.end(), g) != out.end()) continue;
    try {
      (void)g->getBackend(c10d::ProcessGroup::BackendType::GLOO);
      out.push_back(g);
    } catch (const std::exception&) {
      // No Gloo backend: not bounded (see GlooTimeoutBound).
    }
  }
  return out;
}

GlooTimeoutBound::GlooTimeoutBound(const std::vector<std::shared_ptr<c10d::ProcessGroup>>& groups,
                                   std::chrono::milliseconds timeout) {
  for (const auto& g : groups) {
    try {
      auto backend = g->getBackend(c10d::ProcessGroup::BackendType::GLOO);
      const auto own = backend->getBackendOptions()->timeout;
      if (own <= timeout) continue;
      backend->setTimeout(timeout);
      lowered_.emplace_back(g, own);
    } catch (const std::exception&) {
      // A Gloo backend that does not say its timeout: left as it is.
    }
  }
}

GlooTimeoutBound::~GlooTimeoutBound() {
  for (auto& [g, own] : lowered_) {
    try {
      g->getBackend(c10d::ProcessGroup::BackendType::GLOO)->setTimeout(own);
    } catch (const std::exception&) {
    }
  }
}

}  // namespace zbpipe::runtime
