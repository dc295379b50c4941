// Name -> builder table and the argument checks every builder shares.
#include <algorithm>

#include "zbpipe/builders.h"
#include "zbpipe/error.h"
#include "zbpipe/limits.h"
#include "zbpipe/topology.h"

namespace zbpipe {

namespace {
// Cost-driven builders search under the costs, the memory model and a cap (and take the search
// mode), then refine their pick (refine.h) unless refine=false; no builder runs a full B, so
// b_full only matters to the simulator.
const std::vector<std::string> kSearchOptions = {
    "f",     "b",          "w",          "comm", "mem_f", "mem_w", "memory_cap", "exhaustive_search",
    "search_threads", "refine"};
}  // namespace

const std::vector<ScheduleInfo>& schedule_registry() {
  static const std::vector<ScheduleInfo> kRegistry = {
      {"inference", "forward only, 1 stage per rank", build_inference, {}},
      {"gpipe", "all forwards, then all backwards, 1 stage per rank", build_gpipe, {}},
      {"1f1b", "one-forward-one-backward, 1 stage per rank", build_1f1b, {}},
      {"looped_bfs", "breadth-first: all forwards per local stage, loop topology, >= 1 stage per rank",
       build_looped_bfs, {}},
      {"interleaved_1f1b", "Megatron interleaved 1F1B, loop topology, >= 1 stage per rank (default 2)",
       build_interleaved_1f1b, {}},
      {"interleaved_zb", "ZB1P: interleaved 1F1B with I/W split, loop topology, >= 1 stage per rank (default 2)",
       build_interleaved_zb, {}},
      {"zb_h1", "ZB-H1: 1F1B memory, I/W split, about 1/3 of 1F1B's bubble, 1 stage per rank",
       build_zb_h1, {}},
      {"zb_h2", "ZB-H2: 2p-1 warm-up forwards, bubble-free when microbatches >= 2*pp-1, 1 stage per rank",
       build_zb_h2, {}},
      {"zbv", "ZB-V: zero bubble on the V topology, I/W split, 2 stages per rank", build_zbv, {}},
      {"dualpipev", "DeepSeek DualPipeV: F/B pairs run concurrently (backward on a worker thread), V topology, 2 stages per rank",
       build_dualpipev, {}},
      {"zb_auto", "Zero Bubble automatic: greedy search under the costs and a memory cap, 1 stage per rank",
       build_zb_auto, kSearchOptions},
      {"v_half", "V-Half: V shape, 2 stages per rank, ~1/2 of 1F1B's activations", build_v_half,
       kSearchOptions},
      {"v_min", "V-Min: V shape, 2 stages per rank, ~1/3 of 1F1B's activations", build_v_min,
       kSearchOptions},
  };
  return kRegistry;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const auto& info : schedule_registry()) names.push_back(info.name);
  return names;
}

const ScheduleInfo& find_schedule(const std::string& name) {
  for (const auto& info : schedule_registry())
    if (info.name == name) return info;
  std::string valid;
  for (const auto& info : schedule_registry()) valid += (valid.empty() ? "" : ", ") + info.name;
  throw ScheduleError(detail::str("unknown schedule '", name, "' (valid: ", valid, ")"));
}

void check_options(const ScheduleInfo& info, const BuildArgs& a) {
  auto has = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  auto is_cost = [](const std::string& option) {
    return option == "f" || option == "b" || option == "w" || option == "b_full" ||
           option == "comm" || option == "mem_f" || option == "mem_w";
  };
  for (const std::string& option : a.given) {
    std::string valid;
    for (const auto& name : kBuildOptions) valid += (valid.empty() ? "" : ", ") + name;
    ZB_SCHEDULE_CHECK(has(kBuildOptions, option), "unknown compile option '", option,
                      "' (valid: ", valid, ")");
    if (has(info.options, option) || option == "vocab_parallel") continue;
    if (has(kVocabOptions, option)) {
      ZB_SCHEDULE_CHECK(a.vocab_parallel, "option '", option, "' is the vocabulary head's: it needs vocab_parallel=True");
      continue;
    }
    if (a.vocab_parallel && has(kVocabPlacementCosts, option)) continue;  // they time the placement
    std::string takers;
    for (const auto& other : schedule_registry())
      if (has(other.options, option)) takers += (takers.empty() ? "" : ", ") + other.name;
    ZB_SCHEDULE_CHECK(false, info.name, " does not use option '", option, "' (",
                      takers.empty() ? std::string("no schedule builds with it")
                                     : "only " + takers + " take it",
                      is_cost(option) ? "; zbpipe.simulate takes costs and memory" : "", ")");
  }
}

void check_basic_args(const std::string& schedule, const BuildArgs& a) {
  ZB_SCHEDULE_CHECK(a.pp >= 1, schedule, ": pp must be >= 1, got pp=", a.pp);
  ZB_SCHEDULE_CHECK(a.microbatches >= 1, schedule, ": microbatches must be >= 1, got microbatches=",
                    a.microbatches);
  ZB_SCHEDULE_CHECK(a.stages_per_rank >= 0, schedule,
                    ": stages_per_rank must be >= 1 when given, got stages_per_rank=",
                    a.stages_per_rank);
}

int resolve_stages_per_rank(const std::string& schedule, const BuildArgs& a, int fixed, int dflt,
                            int min_spr) {
  if (fixed > 0) {
    ZB_SCHEDULE_CHECK(a.stages_per_rank == 0 || a.stages_per_rank == fixed, schedule,
                      " fixes stages_per_rank=", fixed, ", got stages_per_rank=", a.stages_per_rank);
    return fixed;
  }
  int spr = a.stages_per_rank == 0 ? dflt : a.stages_per_rank;
  ZB_SCHEDULE_CHECK(spr >= min_spr, schedule, " needs stages_per_rank >= ", min_spr,
                    ", got stages_per_rank=", spr);
  return spr;
}

Program make_program(const std::string& schedule, const BuildArgs& a, int stages_per_rank,
                     const std::string& topology) {
  // Every builder lays its program out here, so the exact stage count is checked once more.
  check_program_size(detail::str("schedule '", schedule, "' (pp=", a.pp, ", microbatches=",
                                 a.microbatches, ", stages_per_rank=", stages_per_rank, ")"),
                     {a.pp, static_cast<int64_t>(a.pp) * stages_per_rank, a.microbatches});
  Program p;
  p.schedule = schedule;
  p.pp = a.pp;
  p.num_stages = a.pp * stages_per_rank;
  p.microbatches = a.microbatches;
  p.stage_to_rank = make_topology(topology, a.pp, p.num_stages);
  p.ranks.assign(a.pp, {});
  return p;
}

}  // namespace zbpipe
