// Schedule builders: each emits a compute-only Program (no SEND/RECV) after checking its
// constraints up front. The registry maps names to builders for compile().
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "zbpipe/cost_model.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/program.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

struct BuildArgs {
  int pp = 0;
  int microbatches = 0;
  int stages_per_rank = 0;  // 0 = the schedule's default; rejected where the schedule fixes it
  CostModel costs{};        // steers the cost-driven builders (zb_auto, v_half, v_min)
  MemoryModel memory{};     // their memory deltas per action kind (memory_model.h)
  // Memory per rank in mem_f's units (microbatches of one stage at mem_f = 1); 0 = the
  // schedule's default.
  double memory_cap = 0.0;
  // Cost-driven builders: run every point of the search grid to the end and score it with the
  // simulator (no merging of points that build the same program, no bound, no scores from the
  // scheduler's timing): the reference the fast search must agree with.
  bool exhaustive_search = false;
  // zb_auto, v_half, v_min: run the refinement pass (refine.h) on the search's pick. Off, the
  // pick is the heuristics' alone (the figures the Zero Bubble paper publishes for zb_auto, the
  // reference implementation's for v_half and v_min).
  bool refine = true;
  // Cost-driven builders: threads that share the search grid (0 = search_thread_count's
  // default). The program does not depend on it.
  int search_threads = 0;
  // Vocabulary parallelism (vocab.h): compile() places the S and T passes and their
  // collectives (insert_vocab) under `costs` and `vocab`.
  bool vocab_parallel = false;
  VocabModel vocab{};
  // The options among kBuildOptions the caller set. compile() refuses one the schedule does not
  // consult (ScheduleError naming the schedules that take it) instead of ignoring it.
  std::vector<std::string> given;
};

// The threads a cost-driven builder's search runs on for a given search_threads: that value when
// > 0, else the CPUs this process may run on (its affinity mask, which a container's or
// launcher's CPU pinning narrows), at most kMaxSearchThreads (a 96- or 144-point grid gains
// little from more).
inline constexpr int kMaxSearchThreads = 8;
int search_thread_count(int requested);

// The options a caller may set beyond the sizes: the cost model's fields, the memory model's,
// the memory cap, and the search mode of the cost-driven builders.
inline const std::vector<std::string> kBuildOptions = {
    "f",     "b",          "w",         "b_full",        "comm", "mem_f",
    "mem_w", "memory_cap", "exhaustive_search", "search_threads", "refine",
    "vocab_parallel", "s", "t", "collective", "mem_s", "backlog", "lookahead"};
// With vocab_parallel every schedule takes these: the vocabulary head's own (VocabModel) and
// the stage costs its placement is timed with.
inline const std::vector<std::string> kVocabOptions = {"s", "t", "collective", "mem_s", "backlog", "lookahead"};
inline const std::vector<std::string> kVocabPlacementCosts = {"f", "b", "w", "b_full", "comm"};

using Builder = std::function<Program(const BuildArgs&)>;

struct ScheduleInfo {
  std::string name;
  std::string summary;               // one line for CLI listings
  Builder build;
  std::vector<std::string> options;  // the kBuildOptions its builder consults
};

// Every builder, in a stable order.
const std::vector<ScheduleInfo>& schedule_registry();
std::vector<std::string> schedule_names();
// Throws ScheduleError listing the valid names when `name` is unknown.
const ScheduleInfo& find_schedule(const std::string& name);

// Throws ScheduleError for an option in `a.given` that `info`'s builder does not consult, naming
// the schedules that do; compile() calls it before building.
void check_options(const ScheduleInfo& info, const BuildArgs& a);

// Shared helpers for builders.
// Checks pp >= 1 and microbatches >= 1, naming the schedule.
void check_basic_args(const std::string& schedule, const BuildArgs& a);
// Resolves stages_per_rank: `fixed` > 0 means the schedule fixes it (a different explicit
// value is rejected); otherwise `dflt` is used when 0 and values below `min_spr` are rejected.
int resolve_stages_per_rank(const std::string& schedule, const BuildArgs& a, int fixed, int dflt,
                            int min_spr);
// An empty program with the given topology and sizes.
Program make_program(const std::string& schedule, const BuildArgs& a, int stages_per_rank,
                     const std::string& topology);

// The builders (one file each under csrc/core/builders/).
Program build_inference(const BuildArgs& a);
Program build_gpipe(const BuildArgs& a);
Program build_1f1b(const BuildArgs& a);
Program build_looped_bfs(const BuildArgs& a);
Program build_interleaved_1f1b(const BuildArgs& a);
Program build_interleaved_zb(const BuildArgs& a);
Program build_zb_h1(const BuildArgs& a);
Program build_zb_h2(const BuildArgs& a);
Program build_zbv(const BuildArgs& a);
Program build_dualpipev(const BuildArgs& a);
Program build_zb_auto(const BuildArgs& a);
Program build_v_half(const BuildArgs& a);
Program build_v_min(const BuildArgs& a);

}  // namespace zbpipe
