// The thread that runs the backward half of an OVERLAP_F_B unit while the executor's thread
// runs the forward half (the backward is C++ autograd and needs no GIL; the forward is Python).
// On accelerators the worker computes on a stream of its own, ordered after the caller's
// stream when a task starts and joined back into it by an event when the caller joins.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

namespace zbpipe::runtime {

class OverlapWorker {
 public:
  explicit OverlapWorker(c10::Device device);
  ~OverlapWorker();
  OverlapWorker(const OverlapWorker&) = delete;
  OverlapWorker& operator=(const OverlapWorker&) = delete;

  // Runs `task` on the worker with the caller's thread-local autograd/dispatch state; on
  // accelerators its stream first waits for what the caller's current stream has queued.
  // One task at a time: call join() before the next.
  void start(std::function<void()> task);
  // Waits for the task; orders the caller's current stream after the worker's; rethrows what
  // the task threw. No-op when idle.
  void join();
  bool busy() const { return busy_; }
  // The worker's stream (accelerators), e.g. to record tensors crossing into the caller's.
  const std::optional<c10::Stream>& stream() const { return stream_; }

 private:
  void loop();

  c10::Device device_;
  std::optional<c10::Stream> stream_;
  std::optional<c10::Event> ready_, finished_;  // caller -> worker, worker -> caller
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> task_;
  bool has_task_ = false, stop_ = false;
  bool busy_ = false;  // started and not joined (caller's view)
  std::exception_ptr error_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace zbpipe::runtime
