// HeadLane: the vocabulary head's lane on a host without device streams (a CPU pipeline posted
// as on NCCL): one thread running the head's actions in program order, so a pass waiting for a
// collective holds back none of the stages' posts, as a stream of its own does on a device
// (vocab_run.h; the core's rendezvous model, validate_rendezvous.cpp, checks every program
// under these lanes).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

namespace zbpipe::runtime {

// Thread-safe.
class HeadLane {
 public:
  HeadLane();
  ~HeadLane();  // runs what is queued, then stops
  HeadLane(const HeadLane&) = delete;
  HeadLane& operator=(const HeadLane&) = delete;

  // Queues `task`; after a task failed, the ones queued after it are dropped.
  void push(std::function<void()> task);
  // Blocks until every queued task ran; rethrows the first error, which is then forgotten.
  void drain();
  // Marks `key` reached (from a task).
  void mark(int key);
  // Blocks until `key` was marked (true), a task failed (rethrows its error) or `deadline`
  // passed (false). Marks last until clear().
  bool wait_mark(int key, std::chrono::steady_clock::time_point deadline);
  void clear();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool running_ = false, stop_ = false;
  std::exception_ptr error_;
  std::set<int> marks_;
  std::thread thread_;
};

}  // namespace zbpipe::runtime
