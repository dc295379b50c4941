// The core's Python face (see py_core.h).
#include "python/py_core.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <functional>

#include "zbpipe/builders.h"
#include "zbpipe/compile.h"
#include "zbpipe/error.h"
#include "zbpipe/limits.h"
#include "zbpipe/passes.h"
#include "zbpipe/program_io.h"
#include "zbpipe/refine.h"
#include "zbpipe/vocab.h"
#include "python/arguments.h"
#include "python/interrupt.h"

namespace zbpipe::python {

namespace {
CostModel make_costs(std::vector<double> f, std::vector<double> b, std::vector<double> w,
                     std::vector<double> b_full, double comm) {
  CostModel c;
  c.f = std::move(f);
  c.b = std::move(b);
  c.w = std::move(w);
  c.b_full = std::move(b_full);
  c.comm = comm;
  return c;
}

// mem_w empty: mem_w = mem_f (memory_model.h).
MemoryModel make_memory(std::vector<double> mem_f, std::vector<double> mem_w) {
  MemoryModel m;
  m.mem_f = std::move(mem_f);
  m.mem_w = std::move(mem_w);
  return m;
}

// A per-rank cap from the caller's (one value or one per rank), or, when none is given, the
// program's own peak memory under the model (no more than it already holds).
std::vector<double> per_rank_cap(const Program& p, const CostModel& costs, const MemoryModel& memory,
                                 std::vector<double> cap) {
  if (cap.empty()) return simulate(p, costs, memory, false).peak_memory;
  ZB_SCHEDULE_CHECK(cap.size() == 1 || static_cast<int>(cap.size()) == p.pp,
                    "memory_cap needs 1 value or one per rank (", p.pp, "), got ", cap.size());
  return cap.size() == 1 ? std::vector<double>(p.pp, cap[0]) : cap;
}

// The sizes of a compile/build request, checked against the limits (limits.h) on the caller's
// 64-bit values before they narrow to BuildArgs' ints.
BuildArgs build_args(const std::string& name, int64_t pp, int64_t microbatches, int64_t stages_per_rank) {
  find_schedule(name);  // an unknown name is the first thing to say
  check_build_size(name, pp, microbatches, stages_per_rank);
  auto narrow = [](int64_t v) { return static_cast<int>(std::max<int64_t>(v, INT32_MIN)); };
  BuildArgs args;
  args.pp = narrow(pp);
  args.microbatches = narrow(microbatches);
  args.stages_per_rank = narrow(stages_per_rank);
  return args;
}
}  // namespace

Program compile_program(const std::string& name, int64_t pp, int64_t microbatches, int64_t stages_per_rank,
                        std::optional<std::vector<double>> f, std::optional<std::vector<double>> b,
                        std::optional<std::vector<double>> w, std::optional<std::vector<double>> b_full,
                        std::optional<double> comm, std::optional<std::vector<double>> mem_f,
                        std::optional<std::vector<double>> mem_w, std::optional<double> memory_cap,
                        bool exhaustive_search, std::optional<int> search_threads,
                        std::optional<bool> refine, bool vocab_parallel,
                        std::optional<std::vector<double>> s, std::optional<std::vector<double>> t,
                        std::optional<double> collective, std::optional<std::vector<double>> mem_s,
                        std::optional<int> backlog, std::optional<int> lookahead) {
  BuildArgs args = build_args(name, pp, microbatches, stages_per_rank);
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
  take("mem_f", mem_f, args.memory.mem_f);
  take("mem_w", mem_w, args.memory.mem_w);
  take("memory_cap", memory_cap, args.memory_cap);
  if (exhaustive_search) {
    args.exhaustive_search = true;
    args.given.emplace_back("exhaustive_search");
  }
  take("search_threads", search_threads, args.search_threads);
  take("refine", refine, args.refine);
  if (vocab_parallel) {
    args.vocab_parallel = true;
    args.given.emplace_back("vocab_parallel");
  }
  take("s", s, args.vocab.s);
  take("t", t, args.vocab.t);
  take("collective", collective, args.vocab.collective);
  take("mem_s", mem_s, args.vocab.mem_s);
  take("backlog", backlog, args.vocab.backlog);
  take("lookahead", lookahead, args.vocab.lookahead);
  return interruptible([&] { return compile(name, args); });
}

Program build_program(const std::string& name, int64_t pp, int64_t microbatches, int64_t stages_per_rank) {
  const BuildArgs args = build_args(name, pp, microbatches, stages_per_rank);
  return interruptible([&] { return build(name, args); });
}

namespace {
VocabModel make_vocab(std::vector<double> s, std::vector<double> t, double collective, std::vector<double> mem_s,
                      int backlog = 2) {
  VocabModel v;
  v.s = std::move(s);
  v.t = std::move(t);
  v.collective = collective;
  v.mem_s = std::move(mem_s);
  v.backlog = backlog;
  return v;
}
}  // namespace

SimResult simulate_program(const Program& p, std::vector<double> f, std::vector<double> b,
                           std::vector<double> w, std::vector<double> b_full, double comm,
                           std::vector<double> mem_f, std::vector<double> mem_w, std::vector<double> s,
                           std::vector<double> t, double collective, std::vector<double> mem_s) {
  const CostModel costs = make_costs(std::move(f), std::move(b), std::move(w), std::move(b_full), comm);
  const MemoryModel memory = make_memory(std::move(mem_f), std::move(mem_w));
  const VocabModel vocab = make_vocab(std::move(s), std::move(t), collective, std::move(mem_s));
  return interruptible([&] { return simulate(p, costs, memory, vocab); });
}

Program insert_vocab_program(const Program& lowered, std::vector<double> f, std::vector<double> b,
                             std::vector<double> w, double comm, std::vector<double> s, std::vector<double> t,
                             double collective, std::vector<double> mem_s, int backlog) {
  const CostModel costs = make_costs(std::move(f), std::move(b), std::move(w), {}, comm);
  const VocabModel vocab = make_vocab(std::move(s), std::move(t), collective, std::move(mem_s), backlog);
  return interruptible([&] {
    Program out = insert_vocab(lowered, costs, vocab);
    validate(out);
    return out;
  });
}

SpanBound span_lower_bound_program(const Program& p, std::vector<double> f, std::vector<double> b,
                                   std::vector<double> w, double comm, std::vector<double> mem_f,
                                   std::vector<double> mem_w, std::vector<double> memory_cap) {
  ZB_SCHEDULE_CHECK(!has_vocab(p), "lower_bound does not bound vocabulary-parallel programs ('", p.schedule, "')");
  const CostModel costs = make_costs(std::move(f), std::move(b), std::move(w), {}, comm);
  const MemoryModel memory = make_memory(std::move(mem_f), std::move(mem_w));
  return interruptible([&] {
    return span_lower_bound(p, costs, memory, per_rank_cap(p, costs, memory, std::move(memory_cap)));
  });
}

Program refine_program(const Program& p, std::vector<double> f, std::vector<double> b,
                       std::vector<double> w, double comm, std::vector<double> mem_f,
                       std::vector<double> mem_w, std::vector<double> memory_cap,
                       const std::string& objective, int64_t budget) {
  ZB_SCHEDULE_CHECK(objective == "span" || objective == "makespan",
                    "refine: objective must be 'span' or 'makespan', got '", objective, "'");
  ZB_SCHEDULE_CHECK(!has_vocab(p), "refine does not reorder vocabulary-parallel programs ('", p.schedule,
                    "'): refine the program without them, then compile with vocab_parallel");
  const CostModel costs = make_costs(std::move(f), std::move(b), std::move(w), {}, comm);
  const MemoryModel memory = make_memory(std::move(mem_f), std::move(mem_w));
  RefineOptions opt;
  opt.objective = objective == "span" ? Objective::kSpan : Objective::kMakespan;
  opt.budget = budget;
  return interruptible([&] {
    const Program compute = p.has_comms() ? strip_comms(p) : p;
    const std::vector<double> cap = per_rank_cap(compute, costs, memory, std::move(memory_cap));
    opt.target = opt.objective == Objective::kSpan ? span_lower_bound(compute, costs, memory, cap).max_span : 0.0;
    return lower(refine_order(compute, costs, memory, cap, opt));
  });
}

std::vector<std::pair<std::string, std::string>> schedule_summaries() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& info : schedule_registry()) out.emplace_back(info.name, info.summary);
  return out;
}

std::vector<std::string> schedule_option_names(const std::string& name) { return find_schedule(name).options; }

void validate_program(const Program& p, bool rendezvous) {
  interruptible([&] {
    validate(p);
    if (rendezvous) validate_rendezvous(p);
  });
}

Program insert_send_recv_program(const Program& compute_only) {
  return interruptible([&] { return insert_send_recv(compute_only); });
}

Program lower_program(const Program& compute_only) {
  return interruptible([&] { return lower(compute_only); });
}

std::map<std::string, int64_t> size_limits() {
  return {{"pp", kMaxPipelineRanks},       {"stages", kMaxStages},
          {"microbatches", kMaxMicrobatches}, {"stages_x_microbatches", kMaxCells},
          {"actions", kMaxActions},        {"bytes_per_stage_microbatch", kBytesPerCell},
          {"csv_bytes", kMaxCsvBytes}};
}

Action parse_action_arg(const pybind11::object& text) {
  return parse_action(str_arg(text, "Action.parse", "text", "an action string such as '2F0'"));
}

Program program_from_csv_arg(const pybind11::object& path, const pybind11::object& rendezvous) {
  const char* fn = "Program.from_csv";
  const std::string file = path_arg(path, fn, "path");
  const bool rv = arg<bool>(rendezvous, fn, "rendezvous", "a bool");
  return interruptible([&] { return read_csv_file(file, rv); });
}

Program program_from_csv_text_arg(const pybind11::object& text, const pybind11::object& rendezvous) {
  const char* fn = "Program.from_csv_text";
  const std::string csv = str_arg(text, fn, "text");
  const bool rv = arg<bool>(rendezvous, fn, "rendezvous", "a bool");
  return interruptible([&] { return program_from_csv_text(csv, rv); });
}

Program program_from_actions_arg(const pybind11::object& ranks, const pybind11::object& stage_to_rank,
                                 const pybind11::object& microbatches, const pybind11::object& name,
                                 const pybind11::object& rendezvous) {
  const char* fn = "Program.from_actions";
  auto rows = arg<std::vector<std::vector<std::string>>>(
      ranks, fn, "ranks", "a list of lists of action strings (one list per rank)");
  auto placement = arg<std::vector<int>>(stage_to_rank, fn, "stage_to_rank", "a list of ints (the rank of each stage)");
  auto mb = arg<int64_t>(microbatches, fn, "microbatches", "an int");
  auto label = str_arg(name, fn, "name");
  auto rv = arg<bool>(rendezvous, fn, "rendezvous", "a bool");
  return interruptible([&] { return program_from_actions(rows, placement, mb, label, rv); });
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
std::size_t program_hash(const Program& p) { return std::hash<std::string>()(fingerprint(p)); }

std::string program_repr(const Program& p) {
  return detail::str("Program(schedule='", p.schedule, "', pp=", p.pp, ", num_stages=", p.num_stages,
                     ", microbatches=", p.microbatches, ")");
}

std::string timeline_event_repr(const TimelineEvent& e) {
  return detail::str("TimelineEvent(rank=", e.rank, ", action=", to_string(e.action), ", start=", e.start,
                     ", end=", e.end, ")");
}

std::string span_bound_repr(const SpanBound& s) {
  return detail::str("SpanBound(max_span=", s.max_span, ", bubble_rate=", s.bubble_rate, ")");
}

std::string sim_result_repr(const SimResult& r) {
  return detail::str("SimResult(makespan=", r.makespan, ", bubble_rate=", r.bubble_rate, ")");
}

}  // namespace zbpipe::python
