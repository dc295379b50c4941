// The program sizes zbpipe accepts, and what a program of a given size costs in memory.
//
// Every entry point that makes a program (compile / build, Program.from_actions, CSV import)
// checks the request against these limits before it allocates anything in proportion to it,
// and refuses one beyond them with a ScheduleError naming the limit and the memory the request
// would take. Within the limits memory is linear in the program: about kBytesPerCell per
// (stage, microbatch) pair at compile's peak, plus a little per rank and per stage.
#pragma once

#include <cstdint>
#include <string>

namespace zbpipe {

// Pipeline ranks. The lowering and validation passes advance the ranks in lock-step sweeps,
// whose time grows as pp^2 (a few seconds at this limit).
inline constexpr int64_t kMaxPipelineRanks = 16384;
// Global stages (pp x stages per rank).
inline constexpr int64_t kMaxStages = 65536;
inline constexpr int64_t kMaxMicrobatches = int64_t{1} << 20;
// (stage, microbatch) pairs, the unit a program's memory and time grow with: about 1.9 GB at
// compile's peak at this limit for the fixed schedules. The searched ones (zb_auto, v_half,
// v_min) take more: zb_auto peaks at about 5.2 GB here with one search thread, 7.7 GB with
// eight (measured, docs/schedules.md).
inline constexpr int64_t kMaxCells = int64_t{1} << 22;
// Actions handed in as text or lists (a lowered program holds at most 7 per pair).
inline constexpr int64_t kMaxActions = int64_t{1} << 25;
// A CSV schedule file read by Program.from_csv: room for kMaxActions actions of up to 7
// characters and their separators; a larger file is refused before it is read.
inline constexpr int64_t kMaxCsvBytes = int64_t{1} << 28;

// Memory per (stage, microbatch) pair while compile() runs: the compute-only and the lowered
// program side by side (40 bytes an action, up to 3 + 7 actions) and the passes' lookup tables.
inline constexpr int64_t kBytesPerCell = 448;

// A request's size; a value <= 0 is not checked here (the builders and validate() name it).
// actions: how many actions are handed in (-1: none, a builder makes them).
struct ProgramSize {
  int64_t pp = 0;
  int64_t stages = 0;
  int64_t microbatches = 0;
  int64_t actions = -1;
};

// The memory a program of this size takes at compile's peak, in bytes (saturates, no overflow).
double program_bytes(const ProgramSize& size);
// "1.9 GB", "45 MB", "3 kB": for messages.
std::string format_bytes(double bytes);

// Throws ScheduleError when `size` is beyond a limit: "<what>: <field>=<value> is above zbpipe's
// limit of <limit> <unit> (this request would take about <memory>; the limits: ...)".
void check_program_size(const std::string& what, const ProgramSize& size);

}  // namespace zbpipe
