// The size limits every program-making entry point checks before allocating (see limits.h).
#include "zbpipe/limits.h"

#include <algorithm>
#include <cstdio>

#include "zbpipe/error.h"

namespace zbpipe {

namespace {
// Per rank: its action lists in two programs and the passes' per-rank cursors.
constexpr double kBytesPerRank = 256;
// Per stage: the stage -> rank maps.
constexpr double kBytesPerStage = 16;
constexpr double kBytesPerAction = 40;  // sizeof(Action)

double positive(int64_t v) { return v > 0 ? static_cast<double>(v) : 0.0; }

std::string limits_line() {
  return detail::str("the limits: pp <= ", kMaxPipelineRanks, ", stages <= ", kMaxStages,
                     ", microbatches <= ", kMaxMicrobatches, ", stages x microbatches <= ", kMaxCells,
                     " (about ", format_bytes(kMaxCells * static_cast<double>(kBytesPerCell)),
                     "; zb_auto's search about 5.2 GB, more with search threads), actions <= ",
                     kMaxActions);
}
}  // namespace

double program_bytes(const ProgramSize& s) {
  const double cells = positive(std::max<int64_t>(s.stages, 1)) * positive(s.microbatches);
  return cells * kBytesPerCell + positive(s.pp) * kBytesPerRank + positive(s.stages) * kBytesPerStage +
         positive(s.actions) * kBytesPerAction;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"bytes", "kB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  while (bytes >= 1000.0 && u < 6) {
    bytes /= 1000.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, bytes < 10.0 && u > 0 ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

void check_program_size(const std::string& what, const ProgramSize& s) {
  auto refuse = [&](const char* field, int64_t value, int64_t limit, const char* unit) {
    throw ScheduleError(detail::str(what, ": ", field, "=", value, " is above zbpipe's limit of ",
                                    limit, " ", unit, " (this request would take about ",
                                    format_bytes(program_bytes(s)), "; ", limits_line(), ")"));
  };
  if (s.pp > kMaxPipelineRanks) refuse("pp", s.pp, kMaxPipelineRanks, "pipeline ranks");
  if (s.stages > kMaxStages) refuse("stages", s.stages, kMaxStages, "stages");
  if (s.microbatches > kMaxMicrobatches)
    refuse("microbatches", s.microbatches, kMaxMicrobatches, "microbatches");
  // Both factors are within their limits here, so the product fits in int64.
  if (s.stages > 0 && s.microbatches > 0 && s.stages * s.microbatches > kMaxCells)
    refuse("stages x microbatches", s.stages * s.microbatches, kMaxCells, "(stage, microbatch) pairs");
  if (s.actions > kMaxActions) refuse("actions", s.actions, kMaxActions, "actions");
}

}  // namespace zbpipe
