// HeadLane: a thread running queued tasks in order (see head_lane.h).
#include "runtime/head_lane.h"

namespace zbpipe::runtime {

HeadLane::HeadLane() : thread_([this] { loop(); }) {}

HeadLane::~HeadLane() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void HeadLane::push(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) return;  // the lane failed: what follows would read what that task did not make
    tasks_.push_back(std::move(task));
  }
  cv_.notify_all();
}

void HeadLane::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return tasks_.empty() && !running_; });
  if (!error_) return;
  std::exception_ptr e = error_;
  error_ = nullptr;
  std::rethrow_exception(e);
}

void HeadLane::mark(int key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    marks_.insert(key);
  }
  cv_.notify_all();
}

bool HeadLane::wait_mark(int key, std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return marks_.count(key) > 0 || error_ != nullptr; });
  if (marks_.count(key)) return true;
  if (error_) std::rethrow_exception(error_);  // kept: drain reports it again
  return false;
}

void HeadLane::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  marks_.clear();
}

void HeadLane::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return !tasks_.empty() || stop_; });
    if (tasks_.empty()) return;  // stopped, nothing left
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    running_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    running_ = false;
    if (error && !error_) {
      error_ = error;
      tasks_.clear();
    }
    cv_.notify_all();
  }
}

}  // namespace zbpipe::runtime
