// ReplicaBarrier: one counter per stage in the data-parallel group's store, polled.
#include "runtime/replica_barrier.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <thread>

#include "runtime/errors.h"

namespace zbpipe::runtime {

std::shared_ptr<c10d::ProcessGroup> share_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group) return nullptr;
  return std::shared_ptr<c10d::ProcessGroup>(group.get(), [keep = group](c10d::ProcessGroup*) {});
}

ReplicaBarrier::ReplicaBarrier(std::shared_ptr<c10d::ProcessGroup> group, std::string key)
    : group_(std::move(group)), key_(std::move(key)) {
  ZB_CHECK(group_ && group_->getStore(), "a data-parallel stage without its group or the group's store");
  size_ = group_->getSize();
}

void ReplicaBarrier::arrive_and_wait(std::chrono::milliseconds timeout, const std::function<void()>& check,
                                     const std::string& what) {
  meet(key_, ++round_, timeout, check, what);
}

void ReplicaBarrier::arrive_at_step_start(std::chrono::milliseconds timeout, const std::function<void()>& check,
                                          const std::string& what) {
  meet(key_ + "/start", ++starts_, timeout, check, what);
}

void ReplicaBarrier::meet(const std::string& key, int64_t round, std::chrono::milliseconds timeout,
                          const std::function<void()>& check, const std::string& what) {
  auto add = [&](int64_t n) {  // a store failure is this wait's failure
    try {
      return group_->getStore()->add(key, n);
    } catch (const std::exception& e) {
      throw PipelineError(detail::str("waiting for ", what, " through the data-parallel group's store failed "
                                      "(the rank hosting it may have exited): ", e.what()));
    }
  };
  const int64_t want = round * size_;  // every rank's check-ins up to this round
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  for (int64_t arrived = add(1); arrived < want; arrived = add(0)) {
    check();
    if (std::chrono::steady_clock::now() > deadline)
      throw PipelineError(detail::str(
          "waiting for ", what, " failed: ", want - arrived, " of its ", size_,
          " replicas did not reach it within ", timeout.count() / 1000.0,
          " s (a replica may have died, diverged or still be computing)"));
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(10));
  }
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
