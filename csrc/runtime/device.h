// Device-generic stream/event helpers (c10::Stream / c10::Event), so one source builds against
// a CPU torch and drives CUDA with a CUDA torch. Used for per-action device timing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <vector>

#include "runtime/trace.h"

namespace zbpipe::runtime {

// The stream compute runs on: the current stream of `device`.
c10::Stream current_stream(const c10::Device& device);

// Does this device type have timing events (CUDA and other accelerators; not CPU)?
bool device_has_events(const c10::Device& device);

// Tells the caching allocator that `t` is used on `stream` too (its memory is not reused
// before the work queued there so far is done). No-op on the CPU.
void record_on_stream(const at::Tensor& t, const c10::Stream& stream);

// Timing events around each traced action on the compute stream; read once per step (one
// host sync at the end of the step, only when device timing is on).
class DeviceTimer {
 public:
  DeviceTimer(const c10::Device& device, bool enabled, size_t actions);
  bool enabled() const { return enabled_; }
  // Timing was asked for (device_timing): the scopes also read their thread's CPU time, a
  // system call per read (about 1 us here), so only then.
  bool cpu_timing() const { return requested_; }
  void start_step();
  // Records entry i's start (end=false) or end event on the compute stream; marking the start
  // again moves it later (after a stream's wait for a receive).
  void mark(size_t i, bool end);
  // Fills device_start_us / device_end_us of records[i] for every marked i.
  void collect(std::vector<TraceRecord>& records);

 private:
  c10::Device device_;
  bool requested_ = false;
  bool enabled_ = false;
  std::vector<c10::Event> begin_, end_;
  std::vector<uint8_t> marked_;
  std::vector<c10::Event> step_start_;  // 0 or 1 element (c10::Event has no default ctor)
};

}  // namespace zbpipe::runtime
