// Streams and timing events through c10's device-generic interface.
#include "runtime/device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace zbpipe::runtime {

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

bool device_has_events(const c10::Device& device) {
  return !device.is_cpu() && !device.is_meta();
}

void record_on_stream(const at::Tensor& t, const c10::Stream& stream) {
  if (!t.defined() || t.device().is_cpu() || !t.has_storage()) return;
  c10::impl::getDeviceGuardImpl(stream.device_type())->recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

DeviceTimer::DeviceTimer(const c10::Device& device, bool enabled, size_t actions)
    : device_(device), requested_(enabled), enabled_(enabled && device_has_events(device)) {
  if (!enabled_) return;
  begin_.reserve(actions);
  end_.reserve(actions);
  for (size_t i = 0; i < actions; ++i) {
    begin_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    end_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  }
  step_start_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  marked_.assign(actions, 0);
}

void DeviceTimer::start_step() {
  if (!enabled_) return;
  std::fill(marked_.begin(), marked_.end(), 0);
  step_start_[0].record(current_stream(device_));
}

void DeviceTimer::mark(size_t i, bool end) {
  if (!enabled_) return;
  auto stream = current_stream(device_);
  if (end) {
    end_[i].record(stream);
    marked_[i] = 1;
  } else {
    begin_[i].record(stream);
  }
}

void DeviceTimer::collect(std::vector<TraceRecord>& records) {
  if (!enabled_) return;
  for (size_t i = 0; i < marked_.size() && i < records.size(); ++i) {
    if (!marked_[i]) continue;
    end_[i].synchronize();
    records[i].device_start_us = step_start_[0].elapsedTime(begin_[i]) * 1000.0;
    records[i].device_end_us = step_start_[0].elapsedTime(end_[i]) * 1000.0;
  }
}

}  // namespace zbpipe::runtime
