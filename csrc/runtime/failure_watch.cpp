// FailureWatch: one compare-and-set failure key per executor and channel, one inbox per rank
// read by a watcher thread, each failure forwarded to the other channels; liveness pings.
#include "runtime/failure_watch.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zbpipe/error.h"

namespace zbpipe::runtime {

namespace {

// rank \n interrupted \n step \n where \n message (the message last: it may hold newlines).
std::string encode(const StepFailure& f) {
  return detail::str(f.rank, "\n", f.interrupted ? 1 : 0, "\n", f.step, "\n", f.where, "\n", f.message);
}

std::optional<StepFailure> decode(const std::string& s) {
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

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

constexpr size_t kMaxMessage = 6000;  // the store is no place for a whole program grid
const char* const kStop = "stop";
const char* const kFailure = "failure";

// Reads `key` in one request that never blocks: a compare-and-set that cannot match (a missing
// key gives back the expected value, which no writer sets).
std::optional<std::string> peek(c10d::Store& store, const std::string& key) {
  static const std::vector<uint8_t> absent = bytes("\x01zbpipe:absent");
  auto v = store.compareSet(key, absent, absent);
  if (v == absent) return std::nullopt;
  return std::string(v.begin(), v.end());
}

}  // namespace

std::string StepFailure::describe() const {
  if (interrupted) return detail::str("rank ", rank, " was interrupted ", where, " (", message, ")");
  return detail::str("rank ", rank, " failed ", where, ": ", message);
}

std::string failure_key(int64_t id) { return detail::str("zbpipe/x", id, "/failure"); }
std::string inbox_key(int64_t id, int rank) { return detail::str("zbpipe/x", id, "/inbox/rank", rank); }
std::string liveness_key(int rank) { return detail::str("zbpipe/alive/rank", rank); }

int64_t next_executor_id(c10d::Store& store, int rank) {
  return store.add(detail::str("zbpipe/executors/rank", rank), 1);
}

StepFailure publish_failure(const FailureChannel& c, const StepFailure& mine) {
  StepFailure f = mine;
  if (f.message.size() > kMaxMessage) f.message = f.message.substr(0, kMaxMessage) + "\n[...]";
  const std::string want = encode(f);
  std::string stands;
  try {
    auto v = c.store->compareSet(failure_key(c.id), {}, bytes(want));
    stands.assign(v.begin(), v.end());
  } catch (const std::exception&) {
    return mine;  // the store is gone too (the job is ending): nobody to tell
  }
  if (stands != want) {
    auto earlier = decode(stands);
    return earlier ? *earlier : mine;
  }
  const std::string message = std::string(kFailure) + "\n" + want;
  for (int r = 0; r < c.group_size; ++r) {
    if (r == c.group_rank) continue;
    try {
      push_message(*c.store, c.waits, inbox_key(c.id, r), message);
    } catch (const std::exception&) {
      return mine;
    }
  }
  return mine;
}

FailureWatch::FailureWatch(std::vector<FailureChannel> channels, int rank, std::function<void()> on_peer_failure)
    : channels_(std::move(channels)), rank_(rank), on_peer_failure_(std::move(on_peer_failure)) {
  ZB_CHECK(!channels_.empty(), "the failure watch needs at least the process group's store");
  for (auto& c : channels_) {
    ZB_CHECK(c.store, "the failure watch needs the process group's store");
    c.waits = store_waits(*c.store);
    readers_.push_back(std::make_unique<InboxReader>(c.store, c.waits, inbox_key(c.id, c.group_rank)));
  }
  senders_.resize(channels_.size());
  const FailureChannel& pipe = channels_[0];
  pipe.store->set(liveness_key(pipe.group_rank), bytes(detail::str("watching ", pipe.id)));
  for (size_t i = 0; i < channels_.size(); ++i) threads_.emplace_back([this, i] { loop(i); });
}

FailureWatch::~FailureWatch() {
  // Alive, without this watch: parked (unless a later watch of this rank took the key over),
  // before the readers stop. A peer asks only a watching rank, so no ping goes unanswered
  // while this watch winds down: with the readers stopped first, a loaded host's slow join
  // let two pings go unanswered, and the asker named a live rank dead.
  const FailureChannel& pipe = channels_[0];
  try {
    pipe.store->compareSet(liveness_key(pipe.group_rank), bytes(detail::str("watching ", pipe.id)), bytes("parked"));
  } catch (const std::exception&) {
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  for (size_t i = 0; i < readers_.size(); ++i) readers_[i]->stop(*channels_[i].store, kStop);
  for (auto& t : threads_)
    if (t.joinable()) t.join();
}

void FailureWatch::arm() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
  }
  for (auto& r : readers_) r->poke();
}

void FailureWatch::disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
}

std::optional<StepFailure> FailureWatch::seen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_;
}

std::optional<std::string> FailureWatch::lost() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

uint64_t FailureWatch::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

void FailureWatch::bump() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++generation_;
  }
  cv_.notify_all();
}

void FailureWatch::wake() { bump(); }

void FailureWatch::wait(uint64_t since, Clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, until, [&] { return generation_ != since; });
}

void FailureWatch::loop(size_t i) {
  InboxReader& reader = *readers_[i];
  while (true) {
    std::chrono::milliseconds period;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      period = armed_ ? kPollInStep : kPollBetweenSteps;
    }
    std::optional<std::string> message;
    try {
      message = reader.next(period);
    } catch (const std::exception& e) {
      // The store is unreachable (its host exited): no news will come through it. What needs
      // it (a new executor's agreement, a failure report) fails or gives up on its own.
      std::lock_guard<std::mutex> lock(mu_);
      if (!lost_) lost_ = detail::str(describe_store(*channels_[i].store), ": ", short_what(e));
      return;
    }
    if (message) handle(i, *message);
  }
}

void FailureWatch::handle(size_t i, const std::string& message) {
  const size_t eol = message.find('\n');
  const std::string subject = message.substr(0, eol);
  const std::string body = eol == std::string::npos ? std::string() : message.substr(eol + 1);
  if (subject == kStop) return;
  if (subject == kFailure) {
    take_failure(body, i);
    return;
  }
  if (subject.rfind("ping ", 0) == 0) {  // body: the asker's inbox
    try {
      const FailureChannel c = watcher_channel(i);
      push_message(*c.store, c.waits, body, detail::str("pong ", c.group_rank));
    } catch (const std::exception&) {
    }
    return;
  }
  if (subject.rfind("pong ", 0) == 0) {
    int peer = -1;
    try {
      peer = std::stoi(subject.substr(5));
    } catch (const std::exception&) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      pongs_[peer] = Clock::now();
      ++generation_;
    }
    cv_.notify_all();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    mail_.push_back(Mail{i, subject, body});
    ++generation_;
  }
  cv_.notify_all();
}

void FailureWatch::take_failure(const std::string& encoded, size_t from) {
  auto f = decode(encoded);
  if (!f || f->rank == rank_) return;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!seen_) {
      seen_ = f;
      first = true;
      ++generation_;
    }
  }
  if (!first) return;
  cv_.notify_all();
  for (size_t i = 0; i < channels_.size(); ++i)  // the other groups of this rank learn it too
    if (i != from) publish_failure(watcher_channel(i), *f);
  if (on_peer_failure_) on_peer_failure_();
}

FailureChannel FailureWatch::watcher_channel(size_t i) {
  FailureChannel c = channels_[i];
  std::lock_guard<std::mutex> lock(senders_mu_);
  if (!senders_[i]) {
    try {
      senders_[i] = c.store->clone();
    } catch (const std::exception&) {
      senders_[i] = c.store;  // no clone (a custom store): the group's connection
    }
  }
  c.store = senders_[i];
  return c;
}

void FailureWatch::look_now() {
  if (waits() != StoreWaits::Polled || seen()) return;
  for (size_t i = 0; i < channels_.size(); ++i) {
    std::optional<std::string> there;
    try {
      there = peek(*channels_[i].store, failure_key(channels_[i].id));
    } catch (const std::exception&) {
      continue;  // a store that is gone: its watcher reports it
    }
    if (there) take_failure(*there, i);
    if (seen()) return;
  }
}

StepFailure FailureWatch::report(const StepFailure& mine) {
  if (auto s = seen()) return *s;
  // A peer's failure standing on any channel (not yet seen here) is the cause: it is what every
  // channel is told, not this rank's (which may well be a consequence: a connection to the
  // failing rank that closed).
  StepFailure stands = mine;
  for (const auto& c : channels_) {
    std::optional<std::string> there;
    try {
      there = peek(*c.store, failure_key(c.id));
    } catch (const std::exception&) {
    }
    auto f = there ? decode(*there) : std::nullopt;
    if (f && f->rank != rank_) {
      stands = *f;
      break;
    }
  }
  for (const auto& c : channels_) {
    StepFailure s = publish_failure(c, stands);
    if (stands.rank == rank_ && s.rank != rank_) stands = s;
  }
  if (stands.rank == rank_) return stands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!seen_) {
      seen_ = stands;  // no abort: this rank is failing anyway
      ++generation_;
    }
  }
  cv_.notify_all();
  return *seen();
}

void FailureWatch::send(size_t channel, int to, const std::string& subject, const std::string& body) {
  const FailureChannel& c = channels_.at(channel);
  push_message(*c.store, c.waits, inbox_key(c.id, to), subject + "\n" + body);
}

std::optional<std::string> FailureWatch::take(size_t channel, const std::string& subject) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = mail_.begin(); it != mail_.end(); ++it) {
    if (it->channel != channel || it->subject != subject) continue;
    std::string body = std::move(it->body);
    mail_.erase(it);
    return body;
  }
  return std::nullopt;
}

std::optional<std::string> FailureWatch::ping(int peer) {
  const FailureChannel& pipe = channels_[0];
  const auto state = peek(*pipe.store, liveness_key(peer));
  if (!state || state->rfind("watching ", 0) != 0) return std::nullopt;  // never watched, or parked
  std::string their_id = state->substr(9);
  push_message(*pipe.store, pipe.waits, detail::str("zbpipe/x", their_id, "/inbox/rank", peer),
               detail::str("ping ", pipe.group_rank, "\n", inbox_key(pipe.id, pipe.group_rank)));
  return their_id;
}

FailureWatch::Clock::time_point FailureWatch::last_pong(int peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pongs_.find(peer);
  return it == pongs_.end() ? Clock::time_point{} : it->second;
}

}  // namespace zbpipe::runtime
