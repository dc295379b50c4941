// FailureWatch: one compare-and-set key per executor, polled by a watcher thread during steps.
#include "runtime/failure_watch.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zbpipe/error.h"

namespace zbpipe::runtime {

namespace {

// rank \n step \n action \n message (the message last: it may hold newlines).
std::vector<uint8_t> encode(const StepFailure& f) {
  std::string s = std::to_string(f.rank) + "\n" + std::to_string(f.step) + "\n" + f.action + "\n" + f.message;
  return {s.begin(), s.end()};
}

std::optional<StepFailure> decode(const std::vector<uint8_t>& v) {
  std::string s(v.begin(), v.end());
  const size_t a = s.find('\n');
  const size_t b = a == std::string::npos ? a : s.find('\n', a + 1);
  const size_t c = b == std::string::npos ? b : s.find('\n', b + 1);
  if (c == std::string::npos) return std::nullopt;
  StepFailure f;
  try {
    f.rank = std::stoi(s.substr(0, a));
    f.step = std::stoll(s.substr(a + 1, b - a - 1));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  f.action = s.substr(b + 1, c - b - 1);
  f.message = s.substr(c + 1);
  return f;
}

constexpr size_t kMaxMessage = 6000;  // the store is no place for a whole program grid

}  // namespace

std::string StepFailure::describe() const {
  return detail::str("rank ", rank, " failed at action ", action, " (its step ", step, "): ", message);
}

FailureWatch::FailureWatch(c10::intrusive_ptr<c10d::Store> store, std::string key, int rank,
                           std::function<void()> on_peer_failure, std::chrono::milliseconds poll)
    : store_(std::move(store)), key_(std::move(key)), rank_(rank),
      on_peer_failure_(std::move(on_peer_failure)), poll_(poll) {
  ZB_CHECK(store_, "the failure watch needs the process group's store");
  try {
    poll_store_ = store_->clone();  // its own connection: polls never queue behind the caller's
  } catch (const std::exception&) {
    poll_store_ = store_;  // stores are thread-safe; a clone only avoids contention
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

void FailureWatch::take(const std::vector<uint8_t>& value) {
  auto f = decode(value);
  if (!f || f->rank == rank_) return;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!seen_) {
      seen_ = std::move(f);
      first = true;
    }
  }
  if (first && on_peer_failure_) on_peer_failure_();
}

std::optional<StepFailure> FailureWatch::poll_now() {
  if (auto s = seen()) return s;
  if (store_->check({key_})) take(store_->get(key_));
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
  StepFailure stands = publish_failure(*store_, key_, mine);
  if (stands.rank != rank_) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!seen_) seen_ = stands;  // no abort: this rank is failing anyway
  }
  return stands;
}

void FailureWatch::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait(lock, [&] { return stopping_ || (armed_ && !seen_); });
    if (stopping_) break;
    lock.unlock();
    std::optional<std::vector<uint8_t>> value;
    try {
      if (poll_store_->check({key_})) value = poll_store_->get(key_);
    } catch (const std::exception&) {
      // The store is unreachable (its host exited): no news to take; keep polling slowly.
    }
    if (value) take(*value);
    lock.lock();
    cv_.wait_for(lock, poll_, [&] { return stopping_ || !armed_; });
  }
}

int64_t next_executor_id(c10d::Store& store, int rank) {
  return store.add(detail::str("zbpipe/executors/rank", rank), 1);
}

}  // namespace zbpipe::runtime
