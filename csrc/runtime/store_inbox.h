// Messages between the ranks of a group through the group's store, one inbox per rank: what the
// control plane still sends through the store (a failure, the setup agreement, a liveness ping)
// is pushed into the receiver's inbox, and the receiver's thread blocks on it until the server
// answers -- no request while nothing happens. Stores without queues (FileStore, custom Python
// stores) keep an inbox as numbered keys that its reader looks at on a bounded period instead.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>

namespace c10d {
class Store;
}

namespace zbpipe::runtime {

enum class StoreWaits : uint8_t {
  Blocking,  // queuePop(block) answered by the server when a message comes (TCPStore, HashStore)
  Polled,    // no queues: the reader checks for the next message's key every period
};

// How `store` (behind any PrefixStores) serves inboxes: asks it once (queueLen). Never throws:
// an unreachable store is taken as Blocking, whose reads then fail as the store does.
StoreWaits store_waits(c10d::Store& store);
// What errors call the store: "TCPStore at 127.0.0.1:29500", "FileStore", "HashStore", ...
std::string describe_store(c10d::Store& store);
// An exception's text without a c10 backtrace.
std::string short_what(const std::exception& e);

// Pushes `message` into inbox `key` (Polled: under key "<key>/<n>", n counted by "<key>/n").
// Throws what the store throws.
void push_message(c10d::Store& store, StoreWaits waits, const std::string& key, const std::string& message);

// The reading end of one inbox: one reader per inbox (its rank's), on a thread of its own.
class InboxReader {
 public:
  // `store`: the group's store; Blocking reads go through a clone (a connection of their own,
  // so a blocked read never holds the caller's).
  InboxReader(c10::intrusive_ptr<c10d::Store> store, StoreWaits waits, std::string key);

  // Blocking: the next message, waiting for it as long as it takes (stop() pushes one that
  // ends the wait). Polled: the next message if there is one now, else waits `period` (or
  // until stop()) and returns nullopt. nullopt once stopped. Throws what the store throws
  // (it is unreachable: the caller stops reading).
  std::optional<std::string> next(std::chrono::milliseconds period);
  // Ends next() from another thread: Polled at once; Blocking by pushing the stop message
  // `stop_message` through `store` (the caller's connection). Never throws.
  void stop(c10d::Store& store, const std::string& stop_message);
  // Polled: ends the current period's wait early (the period changed). Thread-safe.
  void poke();

 private:
  c10::intrusive_ptr<c10d::Store> store_;  // Blocking: a clone where the store clones
  StoreWaits waits_;
  std::string key_;
  int64_t next_ = 1;  // Polled: the number of the next message
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false, poked_ = false;
};

}  // namespace zbpipe::runtime
