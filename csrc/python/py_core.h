// The core's Python face where a binding needs more than a direct call: collecting compile()'s
// optional arguments into BuildArgs, cost lists into a CostModel, and the values and reprs the
// core's types show in Python.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "zbpipe/action.h"
#include "zbpipe/program.h"
#include "zbpipe/simulator.h"
#include "zbpipe/span_bound.h"

namespace zbpipe::python {

// compile(name, pp, microbatches, stages_per_rank, *options): an option left at None (false
// for exhaustive_search) is not given, so the schedule's default applies and no schedule
// refuses it (check_options). Sizes past limits.h raise ScheduleError before anything is
// allocated. Runs without the GIL; Ctrl-C stops it (interrupt.h).
Program compile_program(const std::string& name, int64_t pp, int64_t microbatches, int64_t stages_per_rank,
                        std::optional<std::vector<double>> f, std::optional<std::vector<double>> b,
                        std::optional<std::vector<double>> w, std::optional<std::vector<double>> b_full,
                        std::optional<double> comm, std::optional<std::vector<double>> mem_f,
                        std::optional<std::vector<double>> mem_w, std::optional<double> memory_cap,
                        bool exhaustive_search, std::optional<int> search_threads,
                        std::optional<bool> refine, bool vocab_parallel = false,
                        std::optional<std::vector<double>> s = std::nullopt,
                        std::optional<std::vector<double>> t = std::nullopt,
                        std::optional<double> collective = std::nullopt,
                        std::optional<std::vector<double>> mem_s = std::nullopt,
                        std::optional<int> backlog = std::nullopt, std::optional<int> lookahead = std::nullopt);
// Only the builder: the compute-only program, neither lowered nor validated.
Program build_program(const std::string& name, int64_t pp, int64_t microbatches, int64_t stages_per_rank);
// Costs as CostModel's lists; mem_w empty: mem_w = mem_f (memory_model.h).
// s, t, collective, mem_s: the vocabulary head's (vocab.h; used where the program has
// vocabulary actions), mem_s empty: none.
SimResult simulate_program(const Program& p, std::vector<double> f, std::vector<double> b,
                           std::vector<double> w, std::vector<double> b_full, double comm,
                           std::vector<double> mem_f, std::vector<double> mem_w,
                           std::vector<double> s = {1.0}, std::vector<double> t = {1.0},
                           double collective = 0.0, std::vector<double> mem_s = {});
// insert_vocab (vocab.h) on a lowered program, placed under these costs; then validated.
Program insert_vocab_program(const Program& lowered, std::vector<double> f, std::vector<double> b,
                             std::vector<double> w, double comm, std::vector<double> s, std::vector<double> t,
                             double collective, std::vector<double> mem_s, int backlog);
// span_bound.h's bound and refine.h's pass under these costs and memory; memory_cap: one value
// or one per rank, or empty for the program's own peak memory under the model.
SpanBound span_lower_bound_program(const Program& p, std::vector<double> f, std::vector<double> b,
                                   std::vector<double> w, double comm, std::vector<double> mem_f,
                                   std::vector<double> mem_w, std::vector<double> memory_cap);
// objective: "span" or "makespan"; returns the lowered program.
Program refine_program(const Program& p, std::vector<double> f, std::vector<double> b,
                       std::vector<double> w, double comm, std::vector<double> mem_f,
                       std::vector<double> mem_w, std::vector<double> memory_cap,
                       const std::string& objective, int64_t budget);

std::vector<std::pair<std::string, std::string>> schedule_summaries();  // (name, summary)
std::vector<std::string> schedule_option_names(const std::string& name);
void validate_program(const Program& p, bool rendezvous);
Program insert_send_recv_program(const Program& compute_only);
Program lower_program(const Program& compute_only);
// The limits of limits.h by name (size_limits()).
std::map<std::string, int64_t> size_limits();

// The text doors of Program and Action: arguments type-checked with one-line TypeErrors
// (arguments.h), long work interruptible.
Action parse_action_arg(const pybind11::object& text);
Program program_from_csv_arg(const pybind11::object& path, const pybind11::object& rendezvous);
Program program_from_csv_text_arg(const pybind11::object& text, const pybind11::object& rendezvous);
Program program_from_actions_arg(const pybind11::object& ranks, const pybind11::object& stage_to_rank,
                                 const pybind11::object& microbatches, const pybind11::object& name,
                                 const pybind11::object& rendezvous);
// The runtime's batches of `rank` as (begin, end, after_f_half) action index ranges.
std::vector<std::tuple<int, int, bool>> comm_batch_ranges(const Program& p, int rank, bool split_overlap);

// Program.actions / compute_actions: canonical strings of one rank.
std::vector<std::string> actions_with_comms(const Program& p, int rank);
std::vector<std::string> compute_actions(const Program& p, int rank);

bool action_is_compute(const Action& a);
std::size_t action_hash(const Action& a);
std::size_t program_hash(const Program& p);  // of its fingerprint: equal programs, equal hashes
std::string program_repr(const Program& p);
std::string timeline_event_repr(const TimelineEvent& e);
std::string sim_result_repr(const SimResult& r);
std::string span_bound_repr(const SpanBound& s);

}  // namespace zbpipe::python
