// Times one entry of a step, in the spirit of torch's record_function: the scope's start and
// end on the host clock and, when device timing is on, the CPU time of its thread in between
// and events on the compute stream.
#pragma once

#include <cstddef>
#include <exception>

#include "runtime/device.h"
#include "runtime/trace.h"

namespace zbpipe::runtime {

class TraceScope {
 public:
  // Does not block; throws what recording a device event throws.
  TraceScope(TraceRecord& rec, DeviceTimer& timer, size_t entry)
      : rec_(rec), timer_(timer), entry_(entry), exceptions_(std::uncaught_exceptions()) {
    rec_.host_start_ns = now_ns();
    if (timer_.cpu_timing()) cpu_start_ns_ = thread_cpu_ns();
    timer_.mark(entry_, false);
  }
  // A scope left by an exception records no end: the step failed and its trace is not read,
  // and recording a device event while a device error unwinds could throw again. Otherwise
  // throws what recording the event throws.
  ~TraceScope() noexcept(false) {
    if (std::uncaught_exceptions() > exceptions_) return;
    timer_.mark(entry_, true);
    rec_.host_end_ns = now_ns();
    if (timer_.cpu_timing()) rec_.cpu_ns = thread_cpu_ns() - cpu_start_ns_;
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  TraceRecord& rec_;
  DeviceTimer& timer_;
  size_t entry_;
  int exceptions_;  // uncaught at construction
  int64_t cpu_start_ns_ = 0;
};

}  // namespace zbpipe::runtime
