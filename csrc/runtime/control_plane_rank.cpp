// ControlPlaneRank: an executor's store-facing setup and failure path, without the executor.
#include "runtime/control_plane_rank.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <vector>

#include "runtime/program_agreement.h"
#include "runtime/replica_barrier.h"

namespace zbpipe::runtime {

ControlPlaneRank::ControlPlaneRank(c10::intrusive_ptr<c10d::Store> pp_store, int pp_rank, int pp,
                                   c10::intrusive_ptr<c10d::Store> dp_store, int dp_rank, int dp, int rank)
    : rank_(rank), pp_rank_(pp_rank), pp_(pp), dp_rank_(dp_rank), dp_(dp) {
  std::vector<FailureChannel> channels{{pp_store, next_executor_id(*pp_store, pp_rank), pp_rank, pp}};
  if (dp > 1) channels.push_back({dp_store, next_executor_id(*dp_store, dp_rank), dp_rank, dp});
  watch_ = std::make_unique<FailureWatch>(std::move(channels), rank, [this] {
    int64_t none = -1;
    const int64_t now =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
    seen_at_ns_.compare_exchange_strong(none, now);
  });
}

void ControlPlaneRank::agree(const std::string& fingerprint, std::chrono::milliseconds timeout) {
  agree_on_program(*watch_, pp_rank_, pp_, fingerprint, timeout, nullptr);
}

void ControlPlaneRank::meet(std::chrono::milliseconds timeout) {
  if (dp_ < 2) return;
  meet_through_store(*watch_, 1, dp_rank_, dp_, /*tag=*/1, ++meetings_, timeout, nullptr,
                     "the data-parallel replicas of this stage to start step 1");
}

void ControlPlaneRank::fail(const std::string& message) {
  watch_->report(StepFailure{rank_, false, "in the benchmark", 1, message});
}

std::string ControlPlaneRank::seen() const {
  auto f = watch_->seen();
  return f ? f->describe() : std::string();
}

}  // namespace zbpipe::runtime
