// Store inboxes: a queue per inbox where the store has queues (the reader's pop is answered by
// the server), numbered keys polled by the reader where it has not.
#include "runtime/store_inbox.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cctype>

#include "zbpipe/error.h"

namespace zbpipe::runtime {

namespace {

// A blocked read outlives any step; the server answers it when a message comes (or the reader's
// stop message). Only its expiry costs a request (and c10d's timeout warning), once a day.
constexpr std::chrono::hours kReadTimeout{24};

// The store behind any PrefixStores.
c10d::Store& underlying(c10d::Store& store) {
  if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(&store)) return *prefix->getUnderlyingNonPrefixStore();
  return store;
}

bool is_timeout(const c10::DistStoreError& e) {
  std::string what = e.what_without_backtrace();
  std::transform(what.begin(), what.end(), what.begin(), [](unsigned char c) { return std::tolower(c); });
  return what.find("timeout") != std::string::npos;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

StoreWaits store_waits(c10d::Store& store) {
  try {
    (void)store.queueLen("zbpipe/inbox-probe");
    return StoreWaits::Blocking;
  } catch (const c10::NotImplementedError&) {
    return StoreWaits::Polled;
  } catch (const c10::DistError&) {
    return StoreWaits::Blocking;  // a store that is gone: its next read fails as it would anyway
  } catch (const std::exception&) {
    return StoreWaits::Polled;  // a custom store raising something else for queues
  }
}

std::string describe_store(c10d::Store& store) {
  c10d::Store& s = underlying(store);
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(&s)) return detail::str("TCPStore at ", tcp->getHost(), ":", tcp->getPort());
  if (dynamic_cast<c10d::FileStore*>(&s)) return "FileStore";
  if (dynamic_cast<c10d::HashStore*>(&s)) return "HashStore";
  return c10::demangle(typeid(s).name());
}

std::string short_what(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) return c10e->what_without_backtrace();
  return e.what();
}

void push_message(c10d::Store& store, StoreWaits waits, const std::string& key, const std::string& message) {
  if (waits == StoreWaits::Blocking) {
    store.queuePush(key, bytes(message));
    // A HashStore (ranks as threads of one process) wakes one waiter per push, maybe the pop
    // of another rank's inbox, which waits on again; a set wakes every waiter to look.
    if (dynamic_cast<c10d::HashStore*>(&underlying(store))) store.set("zbpipe/inbox-pushed", std::vector<uint8_t>{});
    return;
  }
  const int64_t n = store.add(key + "/n", 1);
  store.set(detail::str(key, "/", n), bytes(message));
}

InboxReader::InboxReader(c10::intrusive_ptr<c10d::Store> store, StoreWaits waits, std::string key)
    : store_(std::move(store)), waits_(waits), key_(std::move(key)) {
  if (waits_ != StoreWaits::Blocking) return;
  try {
    auto mine = store_->clone();
    // A TCPStore clone is a connection of its own: its timeout bounds only this reader's pops.
    // (A HashStore clones to itself: its timeout stays the caller's, and a read that expires
    // is simply made again.)
    if (mine.get() != store_.get() && dynamic_cast<c10d::TCPStore*>(&underlying(*mine)))
      mine->setTimeout(kReadTimeout);
    store_ = std::move(mine);
  } catch (const std::exception&) {
    // No clone: reads share the caller's connection (stores are thread-safe).
  }
}

std::optional<std::string> InboxReader::next(std::chrono::milliseconds period) {
  if (waits_ == StoreWaits::Blocking) {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopped_) return std::nullopt;
      }
      std::vector<uint8_t> v;
      try {
        v = store_->queuePop(key_, /*block=*/true);
      } catch (const c10::DistStoreError& e) {
        if (is_timeout(e)) continue;  // the read expired: read again
        throw;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return std::nullopt;
      return std::string(v.begin(), v.end());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return std::nullopt;
  }
  const std::string item = detail::str(key_, "/", next_);
  if (store_->check({item})) {
    auto v = store_->get(item);
    ++next_;
    return std::string(v.begin(), v.end());
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, period, [&] { return stopped_ || poked_; });
  poked_ = false;
  return std::nullopt;
}

void InboxReader::stop(c10d::Store& store, const std::string& stop_message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
  if (waits_ != StoreWaits::Blocking) return;
  try {
    push_message(store, waits_, key_, stop_message);  // answers the blocked pop
  } catch (const std::exception&) {
    // The store is gone: the blocked pop failed with it.
  }
}

void InboxReader::poke() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    poked_ = true;
  }
  cv_.notify_all();
}

}  // namespace zbpipe::runtime
