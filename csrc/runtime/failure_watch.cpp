// FailureWatch: one compare-and-set key per executor and channel, polled by a watcher thread
// during steps, each failure forwarded to the other channels.
#include "runtime/failure_watch.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>

#include "zbpipe/error.h"

namespace zbpipe::runtime {

namespace {

// rank \n interrupted \n step \n where \n message (the message last: it may hold newlines).
std::vector<uint8_t> encode(const StepFailure& f) {
  std::string s = detail::str(f.rank, "\n", f.interrupted ? 1 : 0, "\n", f.step, "\n", f.where, "\n", f.message);
  return {s.begin(), s.end()};
}

std::optional<StepFailure> decode(const std::vector<uint8_t>& v) {
  std::string s(v.begin(), v.end());
  size_t at[4];
  size_t from = 0;
  for (size_t& a : at) {
    a = s.find('\n', from);
    if (a == std::string::npos) return std::nullopt;
    from = a + 1;
  }
  StepFailure f;
  try {
    f.rank = std::stoi(s.substr(0, at[0]));
    f.interrupted = s.substr(at[0] + 1, at[1] - at[0] - 1) == "1";
    f.step = std::stoll(s.substr(at[1] + 1, at[2] - at[1] - 1));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  f.where = s.substr(at[2] + 1, at[3] - at[2] - 1);
  f.message = s.substr(at[3] + 1);
  return f;
}

constexpr size_t kMaxMessage = 6000;  // the store is no place for a whole program grid


}  // namespace

std::string StepFailure::describe() const {
  if (interrupted) return detail::str("rank ", rank, " was interrupted ", where, " (", message, ")");
  return detail::str("rank ", rank, " failed ", where, ": ", message);
}

std::string failure_key(int64_t id) { return detail::str("zbpipe/x", id, "/failure"); }

FailureWatch::FailureWatch(std::vector<FailureChannel> channels, int rank, std::function<void()> on_peer_failure,
                           std::chrono::milliseconds poll, int group_rank)
    : channels_(std::move(channels)),
      rank_(rank),
      group_rank_(group_rank),
      on_peer_failure_(std::move(on_peer_failure)),
      poll_(poll) {
  ZB_CHECK(!channels_.empty(), "the failure watch needs at least the process group's store");
  for (const auto& c : channels_) {
    ZB_CHECK(c.store, "the failure watch needs the process group's store");
    FailureChannel mine{c.store, c.key};
    try {
      mine.store = c.store->clone();  // its own connection: polls never queue behind the caller's
    } catch (const std::exception&) {
      // Stores are thread-safe; a clone only avoids contention.
    }
    poll_channels_.push_back(std::move(mine));
  }
  thread_ = std::thread([this] { loop(); });
}

FailureWatch::~FailureWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Alive, without this watch: parked (another watch of this process on the group, if any,
  // beats again within kHeartbeat).
  if (group_rank_ >= 0) beat("parked");
}

void FailureWatch::arm() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
  }
  cv_.notify_all();
}

void FailureWatch::disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
}

std::optional<StepFailure> FailureWatch::seen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_;
}

void FailureWatch::take(const std::vector<uint8_t>& value, size_t from, bool watcher) {
  auto f = decode(value);
  if (!f || f->rank == rank_) return;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!seen_) {
      seen_ = f;
      first = true;
    }
  }
  if (!first) return;
  auto& channels = watcher ? poll_channels_ : channels_;
  for (size_t i = 0; i < channels.size(); ++i)  // the other groups of this rank learn it too
    if (i != from) publish_failure(*channels[i].store, channels[i].key, *f);
  if (on_peer_failure_) on_peer_failure_();
}

std::optional<StepFailure> FailureWatch::poll_now() {
  if (auto s = seen()) return s;
  for (size_t i = 0; i < channels_.size(); ++i) {
    const auto& c = channels_[i];
    try {
      if (c.store->check({c.key})) take(c.store->get(c.key), i, /*watcher=*/false);
    } catch (const std::exception&) {
      // The store is unreachable: no news from it.
    }
  }
  return seen();
}

StepFailure publish_failure(c10d::Store& store, const std::string& key, const StepFailure& mine) {
  StepFailure f = mine;
  if (f.message.size() > kMaxMessage) f.message = f.message.substr(0, kMaxMessage) + "\n[...]";
  const auto want = encode(f);
  std::vector<uint8_t> stands;
  try {
    stands = store.compareSet(key, {}, want);
  } catch (const std::exception&) {
    return mine;  // the store is gone too (the job is ending): nobody to tell
  }
  if (stands == want) return mine;
  auto earlier = decode(stands);
  return earlier ? *earlier : mine;
}

StepFailure FailureWatch::report(const StepFailure& mine) {
  if (auto s = seen()) return *s;
  // A peer's failure standing on one channel is what the later channels are told.
  StepFailure stands = mine;
  for (const auto& c : channels_) {
    StepFailure s = publish_failure(*c.store, c.key, stands);
    if (stands.rank == rank_ && s.rank != rank_) stands = s;
  }
  if (stands.rank == rank_) return stands;
  std::lock_guard<std::mutex> lock(mu_);
  if (!seen_) seen_ = stands;  // no abort: this rank is failing anyway
  return *seen_;
}

void FailureWatch::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (group_rank_ >= 0) {  // between steps too: the heartbeat
      lock.unlock();
      beat("beat");
      lock.lock();
      cv_.wait_for(lock, kHeartbeat, [&] { return stopping_ || (armed_ && !seen_); });
      if (stopping_) break;
      if (!armed_ || seen_) continue;
    } else {
      cv_.wait(lock, [&] { return stopping_ || (armed_ && !seen_); });
      if (stopping_) break;
    }
    lock.unlock();
    for (size_t i = 0; i < poll_channels_.size(); ++i) {
      const auto& c = poll_channels_[i];
      std::optional<std::vector<uint8_t>> value;
      try {
        if (c.store->check({c.key})) value = c.store->get(c.key);
      } catch (const std::exception&) {
        // The store is unreachable (its host exited): no news to take; keep polling slowly.
      }
      if (value) take(*value, i, /*watcher=*/true);
    }
    lock.lock();
    cv_.wait_for(lock, std::min(poll_, kHeartbeat), [&] { return stopping_ || !armed_; });
  }
}

void FailureWatch::beat(const char* state) {
  static std::atomic<int64_t> beats{0};  // process-wide: every set is a new value
  const std::string v = std::string(state) == "beat" ? detail::str("beat ", ++beats) : std::string(state);
  try {
    poll_channels_[0].store->set(heartbeat_key(group_rank_), std::vector<uint8_t>(v.begin(), v.end()));
  } catch (const std::exception&) {
    // The store is unreachable: nobody to tell.
  }
}

std::string heartbeat_key(int group_rank) { return detail::str("zbpipe/alive/rank", group_rank); }

bool HeartbeatWatch::due() const { return std::chrono::steady_clock::now() - last_ >= kHeartbeat; }

std::optional<int> HeartbeatWatch::look(const std::vector<int>& ranks) {
  const auto now = std::chrono::steady_clock::now();
  last_ = now;
  for (int r : ranks) {
    auto it = std::find_if(seen_.begin(), seen_.end(), [&](const auto& s) { return s.first == r; });
    if (it == seen_.end()) it = seen_.insert(seen_.end(), {r, Seen{{}, now}});
    std::vector<uint8_t> value;
    try {
      if (!store_.check({heartbeat_key(r)})) continue;
      value = store_.get(heartbeat_key(r));
    } catch (const std::exception&) {
      continue;  // the store's own failure is the wait's business
    }
    if (value != it->second.value) {
      it->second = Seen{std::move(value), now};
      continue;
    }
    const bool beating = value.size() > 5 && std::string(value.begin(), value.begin() + 5) == "beat ";
    if (beating && now - it->second.since >= kSilentAfter) return r;
  }
  return std::nullopt;
}

int64_t next_executor_id(c10d::Store& store, int rank) {
  return store.add(detail::str("zbpipe/executors/rank", rank), 1);
}

}  // namespace zbpipe::runtime
