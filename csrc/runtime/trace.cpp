// Chrome-trace export of executor timings.
#include "runtime/trace.h"

#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>

#include "zbpipe/error.h"

namespace zbpipe::runtime {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t thread_cpu_ns() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
#endif
  return 0;
}

namespace {
void append_event(std::string& out, const TraceRecord& r, int tid, double ts_us, double dur_us,
                  int64_t wait_ns) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                "\"args\":{\"wait_us\":%.3f,\"entry\":%d%s",
                r.action.c_str(), r.rank, tid, ts_us, dur_us, wait_ns / 1000.0, r.entry,
                r.worker ? ",\"worker\":1" : "");
  if (out.back() != '[') out += ",\n";
  out += buf;
  if (!r.unit.empty()) out += ",\"unit\":\"" + r.unit + "\"";
  out += "}}";
}
}  // namespace

std::string chrome_trace_json(const std::vector<TraceRecord>& records) {
  std::string out = "{\"traceEvents\":[";
  for (const auto& r : records) {
    // Action strings are [0-9A-Z_();+] only: nothing to escape.
    append_event(out, r, 0, r.host_start_ns / 1000.0, (r.host_end_ns - r.host_start_ns) / 1000.0,
                 r.wait_ns);
    if (r.device_start_us >= 0)
      append_event(out, r, 1, r.device_start_us, r.device_end_us - r.device_start_us, 0);
  }
  out += "],\"displayTimeUnit\":\"ms\"}\n";
  return out;
}

void write_chrome_trace(const std::string& path, const std::vector<TraceRecord>& records) {
  std::ofstream f(path, std::ios::binary);
  ZB_CHECK(f.good(), "cannot open '", path, "' for writing");
  f << chrome_trace_json(records);
}

}  // namespace zbpipe::runtime
