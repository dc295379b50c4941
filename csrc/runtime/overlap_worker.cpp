// OverlapWorker: one persistent thread, one task at a time, joined by events on accelerators.
#include "runtime/overlap_worker.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "runtime/device.h"
#include "runtime/errors.h"

namespace zbpipe::runtime {

OverlapWorker::OverlapWorker(c10::Device device) : device_(device) {
  if (device_has_events(device_)) {
    stream_ = c10::impl::getDeviceGuardImpl(device_.type())->getStreamFromGlobalPool(device_, false);
    ready_.emplace(device_.type());
    finished_.emplace(device_.type());
  }
  thread_ = std::thread([this] { loop(); });
}

OverlapWorker::~OverlapWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void OverlapWorker::start(std::function<void()> task) {
  ZB_CHECK(!busy_, "OverlapWorker::start while a task runs");
  if (stream_) ready_->record(current_stream(device_));
  at::ThreadLocalState state;  // grad mode, autocast, saved-tensor hooks, ... of the caller
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = [state = std::move(state), task = std::move(task)] {
      at::ThreadLocalStateGuard guard(state);
      task();
    };
    has_task_ = true;
    error_ = nullptr;
  }
  busy_ = true;
  cv_.notify_all();
}

void OverlapWorker::join() {
  if (!busy_) return;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !has_task_; });
    error = error_;
    error_ = nullptr;
  }
  busy_ = false;
  if (stream_) finished_->block(current_stream(device_));
  if (error) std::rethrow_exception(error);
}

void OverlapWorker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return has_task_ || stop_; });
    if (stop_) return;
    auto task = std::move(task_);
    lock.unlock();
    std::exception_ptr error;
    try {
      if (stream_) {
        c10::StreamGuard guard(*stream_);
        ready_->block(*stream_);
        task();
        finished_->record(*stream_);
      } else {
        task();
      }
    } catch (...) {
      error = std::current_exception();
      // Nothing may leave the thread's function (std::terminate): the task's error is the one
      // the caller gets; a device error recording the event after it adds nothing.
      try {
        if (stream_) finished_->record(*stream_);
      } catch (...) {
      }
    }
    lock.lock();
    error_ = error;
    has_task_ = false;
    cv_.notify_all();
  }
}

}  // namespace zbpipe::runtime
