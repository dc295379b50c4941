// Failure propagation through c10d stores (every group has one, whatever the backend): a rank
// whose step fails publishes its failure (rank, where, step, message) under the executor's key
// on each of its channels -- the pipeline group's store and the store of every data-parallel
// group its stages sync gradients on -- and a watcher thread on every rank polls those keys
// while a step runs. Seeing a peer's failure on one channel, it forwards it to the others (so
// a failure crosses from one replica's pipeline to the next through the data-parallel groups,
// whatever the path) and calls `on_peer_failure` (the executor aborts its pending
// communication, P2P::abort_all), so a rank blocked in a wait fails within a poll interval
// instead of at its timeout. Only the first failure stands on a key (compare-and-set): a rank
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
#include <vector>

namespace c10d {
class Store;
}

namespace zbpipe::runtime {

struct StepFailure {
  int rank = -1;             // the failing rank, as the world knows it (its global rank)
  bool interrupted = false;  // Ctrl-C on that rank rather than an error
  // Where it failed: "in stage 1 at action 1F2 (microbatch 2)", "at the start of step 3", ...
  std::string where;
  int64_t step = 0;          // the failing rank's step count, from 1
  std::string message;       // "<Type>: <message>"; no traceback (that stays on the failing rank)

  // "rank 1 failed in stage 1 at action 1F2 (microbatch 2): ValueError: boom", or
  // "rank 1 was interrupted in stage 1 at action 1F2 (microbatch 2) (KeyboardInterrupt)".
  std::string describe() const;
};

// One place a failure is published and watched: a group's store and the executor's key there.
struct FailureChannel {
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;  // unique to the executor on that group, equal on its ranks (next_executor_id)
};

class FailureWatch {
 public:
  // `channels`: the pipeline group's first, then the data-parallel groups' (at least one).
  // `rank`: this rank's global rank (its own failures, read back, are not a peer's).
  // `group_rank` >= 0: this rank's rank in the pipeline group (channels[0]); the watcher then
  // also beats a heartbeat there for the watch's whole life, steps or not (heartbeat_key), so
  // a peer waiting for this rank outside a step can tell a dead process from a slow one.
  FailureWatch(std::vector<FailureChannel> channels, int rank, std::function<void()> on_peer_failure,
               std::chrono::milliseconds poll = std::chrono::milliseconds(50), int group_rank = -1);
  ~FailureWatch();
  FailureWatch(const FailureWatch&) = delete;
  FailureWatch& operator=(const FailureWatch&) = delete;

  // Polling runs between arm() and disarm() (a step); the first poll is immediate.
  void arm();
  void disarm();

  // Publishes this rank's failure on every channel unless another rank's is there already;
  // returns the one that stands (this rank's, or the earlier peer's, which is then also
  // seen()). Blocks on the stores only; never throws.
  StepFailure report(const StepFailure& mine);
  // A peer's failure seen by the watcher (or by report), if any.
  std::optional<StepFailure> seen() const;
  // One synchronous look at every channel (no thread): what bounded store waits call between
  // polls.
  std::optional<StepFailure> poll_now();

 private:
  void loop();
  // Decodes a failure published on channel `from` into seen_ and forwards it to the others.
  void take(const std::vector<uint8_t>& value, size_t from, bool watcher);

  std::vector<FailureChannel> channels_;       // the caller's stores (report, poll_now)
  std::vector<FailureChannel> poll_channels_;  // the watcher thread's own (clones if possible)
  void beat(const char* state);  // sets the heartbeat (poll_channels_[0]); never throws

  int rank_;
  int group_rank_;
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
// The failure key of executor `id` on a group.
std::string failure_key(int64_t id);

// Heartbeats: while a process holds a FailureWatch on a group, its watcher sets
// heartbeat_key(group rank) in the group's store every kHeartbeat to a new "beat <n>", and to
// "parked" when one goes (alive, maybe without executor: another watch of the process on the
// group beats again within kHeartbeat). A value
// "beat ..." that stays the same for kSilentAfter means the process died (or its threads no
// longer run): what a wait outside a step (the program comparison) uses to give up early.
constexpr std::chrono::milliseconds kHeartbeat{200};
constexpr std::chrono::milliseconds kSilentAfter{1500};
std::string heartbeat_key(int group_rank);

// Watches the heartbeats of some ranks of a group while a wait polls: look() (when due(), every
// kHeartbeat) reads them and returns a rank whose heartbeat was "beat ..." and has not changed
// for kSilentAfter, if any. A rank without heartbeat, or parked, is never called silent.
class HeartbeatWatch {
 public:
  explicit HeartbeatWatch(c10d::Store& store) : store_(store) {}
  bool due() const;
  std::optional<int> look(const std::vector<int>& ranks);

 private:
  struct Seen {
    std::vector<uint8_t> value;
    std::chrono::steady_clock::time_point since;
  };
  c10d::Store& store_;
  std::vector<std::pair<int, Seen>> seen_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace zbpipe::runtime
