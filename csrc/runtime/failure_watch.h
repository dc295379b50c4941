// Failure propagation, and the other control messages that go through c10d stores (every group
// has one, whatever the backend): pushed by the sender, answered by the server, never polled
// where the store can block (store_inbox.h).
//
// Channels: the pipeline group's store first, then the store of every data-parallel group this
// rank's stages sync gradients on. On each the executor has an id (next_executor_id) and each
// rank an inbox; a watcher thread per channel blocks on this rank's inbox for the watch's whole
// life, steps or not. What arrives:
//  - a failure. A rank whose step fails publishes it under the channel's failure key (compare-
//    and-set: only the first failure stands, so a rank failing because its peer did never
//    reports itself as the cause) and, where its own stood, pushes it into every other rank's
//    inbox. The watcher forwards it to its other channels (a failure crosses from one replica's
//    pipeline to the next through the data-parallel groups) and calls `on_peer_failure` (the
//    executor aborts its communication), so a rank blocked in a wait -- or, between steps, in
//    a collective of its own -- fails within a second instead of at its timeout;
//  - a liveness ping, answered at once (see kPingEvery);
//  - the setup messages of the program agreement and of the replicas' first meeting, kept
//    until taken (take).
// So once set up a rank asks nothing of the store until a failure or a liveness question.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/store_inbox.h"

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

// One group as a failure channel: its store, the executor's id there and this rank's place.
struct FailureChannel {
  c10::intrusive_ptr<c10d::Store> store;
  int64_t id = -1;      // unique to the executor on that group, equal on its ranks (next_executor_id)
  int group_rank = 0;   // this rank in the group
  int group_size = 1;
  StoreWaits waits = StoreWaits::Blocking;  // how the store serves inboxes (store_waits)
};

// Liveness: while a FailureWatch lives, "zbpipe/alive/rank<g>" in its pipeline group's store
// reads "watching <id>" (the last started watch of that rank on the group), and "parked" once
// that watch is gone (the process is alive, maybe without executor). A rank waiting for a peer
// (the program agreement) asks a silent peer every kPingEvery: a ping into the inbox of the
// peer's watch, answered at once by a pong. A peer has died (or its threads no longer run) when
// it answered none of two pings in a row to the same watch, the last of them for kAnswerWithin.
// A peer found parked, or watching through another watch than the one last asked, has moved
// since: it lives, and the count starts again (a ping into a watch that was winding down may
// never be read). Costs the asker two requests per kPingEvery and the asked two per ping, only
// while someone waits; a peer that never held a watch on the group, or is parked, cannot be
// asked.
constexpr std::chrono::milliseconds kAskAfter{1000};  // a wait asks no one before this
constexpr std::chrono::milliseconds kPingEvery{2000};
constexpr std::chrono::milliseconds kAnswerWithin{2000};  // the second unanswered ping's time
// Polled stores (StoreWaits::Polled): how often a watcher looks at its inbox.
constexpr std::chrono::milliseconds kPollInStep{50};
constexpr std::chrono::milliseconds kPollBetweenSteps{500};

class FailureWatch {
 public:
  using Clock = std::chrono::steady_clock;

  // `channels`: the pipeline group's first (its liveness key is this rank's), then the
  // data-parallel groups' (their `waits` are asked here). `rank`: this rank's global rank (its
  // own failures, read back, are not a peer's). `on_peer_failure` runs on a watcher thread.
  // Starts one watcher per channel; sets the liveness key. Throws what the stores throw.
  FailureWatch(std::vector<FailureChannel> channels, int rank, std::function<void()> on_peer_failure);
  ~FailureWatch();
  FailureWatch(const FailureWatch&) = delete;
  FailureWatch& operator=(const FailureWatch&) = delete;

  // Polled stores only: a watcher looks every kPollInStep while a step runs (between arm and
  // disarm), every kPollBetweenSteps otherwise. No effect where the store blocks.
  void arm();
  void disarm();

  // Publishes this rank's failure on every channel unless another rank's is there already;
  // returns the one that stands (this rank's, or the earlier peer's, which is then also
  // seen()). Blocks on the stores only; never throws.
  StepFailure report(const StepFailure& mine);
  // Polled stores only (a no-op where the store blocks): looks at every channel's failure key
  // now, on the caller's thread, taking a peer's failure there as a watcher would (abort
  // included). A watcher looks every kPollInStep: a step ending sooner after a peer's failure
  // than that would otherwise report success. One request per channel. Never throws.
  void look_now();
  // A peer's failure seen by a watcher (or by report), if any.
  std::optional<StepFailure> seen() const;
  // How the pipeline group's store serves inboxes.
  StoreWaits waits() const { return channels_[0].waits; }
  const FailureChannel& channel(size_t i) const { return channels_[i]; }
  // The first error of a store that became unreachable (its watcher stopped), if any.
  std::optional<std::string> lost() const;

  // ---- setup messages ----------------------------------------------------------------------
  // Pushes message `subject` (one line) with `body` into group rank `to`'s inbox on channel
  // `channel`. Throws what the store throws.
  void send(size_t channel, int to, const std::string& subject, const std::string& body = "");
  // The body of a message `subject` that arrived on `channel`, removed; nullopt if none yet.
  std::optional<std::string> take(size_t channel, const std::string& subject);
  // Counts what wakes a waiter: every message kept, pong, failure seen and wake(). Read it
  // before looking at what came, then wait(generation, until): nothing is missed in between.
  uint64_t generation() const;
  // Blocks until generation() differs from `since`, or `until`.
  void wait(uint64_t since, Clock::time_point until);
  // Wakes the waiters (Ctrl-C). Thread-safe.
  void wake();

  // ---- liveness (the pipeline channel) -----------------------------------------------------
  // Asks group rank `peer` whether its process runs (see kPingEvery); returns the id of the
  // peer's watch that was asked, nullopt where none can be (it never watched the group, or is
  // parked). Throws what the store throws.
  std::optional<std::string> ping(int peer);
  // When `peer` last answered a ping (Clock::time_point{} if never).
  Clock::time_point last_pong(int peer) const;

 private:
  struct Mail {
    size_t channel;
    std::string subject, body;
  };
  void loop(size_t i);
  void handle(size_t i, const std::string& message);
  // A failure that arrived on channel `from`: kept in seen_, forwarded to the other channels.
  void take_failure(const std::string& encoded, size_t from);
  void bump();  // generation_ + 1, waiters notified
  // Channel `i` as the watcher threads write to it: through a connection of their own, made at
  // their first write (a TCPStore serves one request at a time per connection, a blocking wait
  // included, so the group's connection may be held for seconds by this rank's main thread --
  // in dist.new_group's rendezvous or a user's store.wait -- and a pong or a forwarded failure
  // must not wait behind it). Where the store does not clone to a new connection, the group's.
  FailureChannel watcher_channel(size_t i);

  std::vector<FailureChannel> channels_;
  std::vector<std::unique_ptr<InboxReader>> readers_;  // per channel: this rank's inbox
  int rank_;
  std::function<void()> on_peer_failure_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, stopping_ = false;
  std::optional<StepFailure> seen_;
  std::optional<std::string> lost_;
  std::deque<Mail> mail_;
  std::map<int, Clock::time_point> pongs_;  // pipeline group rank -> last pong
  uint64_t generation_ = 0;
  std::vector<std::thread> threads_;
  std::mutex senders_mu_;
  std::vector<c10::intrusive_ptr<c10d::Store>> senders_;  // per channel: watcher_channel's
};

// Publishes `f` on channel `c` unless a failure is there already, pushing it into every other
// rank's inbox where it stood; returns the one that stands (a decode of the earlier one, or
// `f`). Store errors are swallowed: nobody is left to tell.
StepFailure publish_failure(const FailureChannel& c, const StepFailure& f);

// Per-group executor numbering: the n-th executor a rank runs on a group gets id n on every
// rank (ranks create their schedules on a group in the same order), so its store keys match.
int64_t next_executor_id(c10d::Store& store, int rank);
// The failure key of executor `id` on a group, and group rank `rank`'s inbox of it.
std::string failure_key(int64_t id);
std::string inbox_key(int64_t id, int rank);
// The liveness key of group rank `rank` (see kPingEvery).
std::string liveness_key(int rank);

}  // namespace zbpipe::runtime
