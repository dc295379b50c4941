// Per-action timing of one executed step: host times always (two clock reads per action),
// device times through events when the executor runs on an accelerator with device timing on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zbpipe::runtime {

struct TraceRecord {
  std::string action;        // canonical action string; a comm batch joins its actions with '+'
  int rank = 0;
  int index = 0;             // position of the (first) action in the rank's program
  int entry = 0;             // this record's own position in the step (unique per record: the
                             // two halves of an OVERLAP_F_B share `index`, not `entry`)
  std::string unit;          // for a half of an OVERLAP_F_B: that unit's action string, else ""
  int64_t host_start_ns = 0; // steady clock (CLOCK_MONOTONIC): comparable across ranks of a host
  int64_t host_end_ns = 0;
  int64_t wait_ns = 0;       // part of the host time spent waiting for a receive
  int64_t cpu_ns = -1;       // CPU time of the thread that ran it (its receive wait included):
                             // the host time less what other processes took of this core;
                             // -1 unless device timing is on
  bool worker = false;       // ran on the executor's worker thread (OVERLAP_F_B's backward half),
                             // overlapping the host records around it
  // Relative to the step's first device event; -1 if untimed. The start is taken after the
  // compute stream's wait for a receive, so a device time is the action's own work.
  double device_start_us = -1.0;
  double device_end_us = -1.0;
};

int64_t now_ns();
int64_t thread_cpu_ns();  // the calling thread's CPU time (0 where the platform has no such clock)

// Chrome trace ("traceEvents", complete events): pid = rank, tid 0 host, tid 1 device; a
// worker record sits on the host lane too, with args.worker = 1.
std::string chrome_trace_json(const std::vector<TraceRecord>& records);
void write_chrome_trace(const std::string& path, const std::vector<TraceRecord>& records);

}  // namespace zbpipe::runtime
