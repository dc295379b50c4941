// Failure propagation through the process group's c10d store (every group has one, whatever
// the backend): a rank whose step fails publishes its failure (rank, action, step, message)
// under the executor's key; a watcher thread on every rank polls that key while a step runs
// and, seeing a peer's failure, calls `on_peer_failure` (the executor aborts its pending
// communication, P2P::abort_all), so a rank blocked in a wait fails within a poll interval
// instead of at its timeout. Only the first failure is published (compare-and-set): a rank
// failing because its peer did never reports itself as the cause.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace c10d {
class Store;
}

namespace zbpipe::runtime {

struct StepFailure {
  int rank = -1;
  std::string action;  // "1F2", "(start of step)", ...
  int64_t step = 0;    // the failing rank's step count, from 1
  std::string message;

  std::string describe() const;  // "rank 1 failed at action 1F2 (step 3): <message>"
};

class FailureWatch {
 public:
  // `key`: unique to this executor on the group and equal on every rank (see ExecutorIds).
  FailureWatch(c10::intrusive_ptr<c10d::Store> store, std::string key, int rank,
               std::function<void()> on_peer_failure,
               std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  ~FailureWatch();
  FailureWatch(const FailureWatch&) = delete;
  FailureWatch& operator=(const FailureWatch&) = delete;

  // Polling runs between arm() and disarm() (a step); the first poll is immediate.
  void arm();
  void disarm();

  // Publishes this rank's failure unless another rank's is there already; returns the one
  // that stands (this rank's, or the earlier peer's, which is then also seen()).
  StepFailure report(const StepFailure& mine);
  // A peer's failure seen by the watcher (or by report), if any.
  std::optional<StepFailure> seen() const;
  // One synchronous look at the key (no thread): what bounded store waits call between polls.
  std::optional<StepFailure> poll_now();

 private:
  void loop();
  void take(const std::vector<uint8_t>& value);  // decodes a published failure into seen_

  c10::intrusive_ptr<c10d::Store> store_;        // the caller's (report, poll_now)
  c10::intrusive_ptr<c10d::Store> poll_store_;   // the watcher thread's own (a clone if possible)
  std::string key_;
  int rank_;
  std::function<void()> on_peer_failure_;
  std::chrono::milliseconds poll_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, stopping_ = false;
  std::optional<StepFailure> seen_;
  std::thread thread_;
};

// Publishes `f` under `key` unless a failure is there already; returns the one that stands
// (a decode of the earlier one, or `f`). Store errors are swallowed: nobody is left to tell.
StepFailure publish_failure(c10d::Store& store, const std::string& key, const StepFailure& f);

// Per-group executor numbering: the n-th executor a rank runs on a group gets id n on every
// rank (ranks create their schedules on a group in the same order), so its store keys match.
int64_t next_executor_id(c10d::Store& store, int rank);

}  // namespace zbpipe::runtime
