// The core's Python face (see py_core.h).
#include "python/py_core.h"

#include <pybind11/pybind11.h>

#include <functional>

#include "zbpipe/builders.h"
#include "zbpipe/compile.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"
#include "zbpipe/program_io.h"

namespace zbpipe::python {

Program compile_program(const std::string& name, int pp, int microbatches, int stages_per_rank,
                        std::optional<std::vector<double>> f, std::optional<std::vector<double>> b,
                        std::optional<std::vector<double>> w, std::optional<std::vector<double>> b_full,
                        std::optional<double> comm, std::optional<int> memory_cap,
                        bool exhaustive_search, std::optional<int> search_threads) {
  BuildArgs args;
  args.pp = pp;
  args.microbatches = microbatches;
  args.stages_per_rank = stages_per_rank;
  auto take = [&](const char* option, auto& from, auto& to) {
    if (!from) return;
    to = std::move(*from);
    args.given.emplace_back(option);
  };
  take("f", f, args.costs.f);
  take("b", b, args.costs.b);
  take("w", w, args.costs.w);
  take("b_full", b_full, args.costs.b_full);
  take("comm", comm, args.costs.comm);
  take("memory_cap", memory_cap, args.memory_cap);
  if (exhaustive_search) {
    args.exhaustive_search = true;
    args.given.emplace_back("exhaustive_search");
  }
  take("search_threads", search_threads, args.search_threads);
  pybind11::gil_scoped_release nogil;
  return compile(name, args);
}

Program build_program(const std::string& name, int pp, int microbatches, int stages_per_rank) {
  BuildArgs args;
  args.pp = pp;
  args.microbatches = microbatches;
  args.stages_per_rank = stages_per_rank;
  return find_schedule(name).build(args);
}

SimResult simulate_program(const Program& p, std::vector<double> f, std::vector<double> b,
                           std::vector<double> w, std::vector<double> b_full, double comm) {
  CostModel costs;
  costs.f = std::move(f);
  costs.b = std::move(b);
  costs.w = std::move(w);
  costs.b_full = std::move(b_full);
  costs.comm = comm;
  return simulate(p, costs);
}

std::vector<std::pair<std::string, std::string>> schedule_summaries() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& info : schedule_registry()) out.emplace_back(info.name, info.summary);
  return out;
}

std::vector<std::string> schedule_option_names(const std::string& name) { return find_schedule(name).options; }

void validate_program(const Program& p, bool rendezvous) {
  validate(p);
  if (rendezvous) validate_rendezvous(p);
}

std::vector<std::tuple<int, int, bool>> comm_batch_ranges(const Program& p, int rank, bool split_overlap) {
  std::vector<std::tuple<int, int, bool>> out;
  for (const auto& b : comm_batches(rank_actions(p, rank), split_overlap)) out.emplace_back(b.begin, b.end, b.after_f_half);
  return out;
}

std::vector<std::string> actions_with_comms(const Program& p, int rank) { return action_strings(p, rank, false); }
std::vector<std::string> compute_actions(const Program& p, int rank) { return action_strings(p, rank, true); }

bool action_is_compute(const Action& a) { return is_compute(a.kind); }
std::size_t action_hash(const Action& a) { return std::hash<std::string>()(to_string(a)); }

std::string program_repr(const Program& p) {
  return detail::str("Program(schedule='", p.schedule, "', pp=", p.pp, ", num_stages=", p.num_stages,
                     ", microbatches=", p.microbatches, ")");
}

std::string timeline_event_repr(const TimelineEvent& e) {
  return detail::str("TimelineEvent(rank=", e.rank, ", action=", to_string(e.action), ", start=", e.start,
                     ", end=", e.end, ")");
}

std::string sim_result_repr(const SimResult& r) {
  return detail::str("SimResult(makespan=", r.makespan, ", bubble_rate=", r.bubble_rate, ")");
}

}  // namespace zbpipe::python
