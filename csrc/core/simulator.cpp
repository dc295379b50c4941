// Cost-model simulation (see simulator.h for what is and is not modelled).
#include "zbpipe/simulator.h"

#include <algorithm>

#include "passes/action_table.h"
#include "stage_values.h"
#include "zbpipe/cancel.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"

namespace zbpipe {

using detail::ActionTable;
using detail::StageTable;

namespace {
constexpr double kUnset = -1.0;
}  // namespace

SimResult simulate(const Program& p, const CostModel& costs, const MemoryModel& memory,
                   bool with_timeline) {
  costs.check(p.num_stages, p.microbatches, p.pp);
  memory.check(p.num_stages);
  ActionTable<double> end(p.num_stages, p.microbatches, kUnset);
  const StageTable table(p.num_stages, costs, memory);
  // Time at which everything `a` needs is on a's rank (producers_of), or kUnset if some of it
  // is not produced yet; data from another rank arrives `comm` after its producer ends.
  auto input_time = [&](const Action& a) -> double {
    double t = 0.0;
    for (const Producer& d : producers_of(a, p.num_stages)) {
      double e = end.of(d, a.microbatch);
      if (e == kUnset) return kUnset;
      if (d.data && p.rank_of(d.stage) != p.rank_of(a.stage)) e += costs.comm;
      t = std::max(t, e);
    }
    return t;
  };

  SimResult res;
  res.busy.assign(p.pp, 0.0);
  res.peak_activations.assign(p.pp, 0);
  res.peak_memory.assign(p.pp, 0.0);
  std::vector<double> clock(p.pp, 0.0), first_start(p.pp, -1.0), held(p.pp, 0.0);
  std::vector<int> live(p.pp, 0);
  std::vector<size_t> next(p.pp, 0);
  std::vector<std::vector<TimelineEvent>> per_rank(with_timeline ? p.pp : 0);
  for (size_t r = 0; r < per_rank.size(); ++r) per_rank[r].reserve(p.ranks[r].size());
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p.pp; ++r) {
      const auto& acts = p.ranks[r];
      poll_cancel();
      while (next[r] < acts.size()) {
        poll_cancel();
        const Action& a = acts[next[r]];
        if (is_comm(a.kind)) {  // takes no rank time; data readiness is modelled on computes
          ++next[r];
          continue;
        }
        double ready = 0.0, duration = 0.0;
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
          double t = input_time(*s);
          if (t == kUnset) { ready = kUnset; break; }
          ready = std::max(ready, t);
          duration += table.of(*s).duration;
        }
        if (ready == kUnset) break;
        const double start = std::max(clock[r], ready), finish = start + duration;
        // Memory: every part's addition at the common start, then every part's release.
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
          held[r] += table.of(*s).added;
        res.peak_memory[r] = std::max(res.peak_memory[r], held[r]);
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
          held[r] -= table.of(*s).freed;
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
          end.at(s->stage, s->kind, s->microbatch) = finish;
          if (s->kind == Kind::F) res.peak_activations[r] = std::max(res.peak_activations[r], ++live[r]);
          if (s->kind == Kind::B || s->kind == Kind::W) --live[r];
        }
        if (first_start[r] < 0.0) first_start[r] = start;
        clock[r] = finish;
        res.busy[r] += duration;
        if (with_timeline) per_rank[r].push_back({r, a, start, finish});
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p.pp; ++r)
    if (next[r] < p.ranks[r].size())
      throw ScheduleError(detail::str("simulate: program '", p.schedule, "' deadlocks at rank ", r,
                                      " on '", to_string(p.ranks[r][next[r]]), "'\n",
                                      format_program(p, r, static_cast<int>(next[r]))));
  double total_busy = 0.0, max_span = 0.0;
  res.span.assign(p.pp, 0.0);
  for (int r = 0; r < p.pp; ++r) {
    res.makespan = std::max(res.makespan, clock[r]);
    res.span[r] = first_start[r] < 0.0 ? 0.0 : clock[r] - first_start[r];
    max_span = std::max(max_span, res.span[r]);
    total_busy += res.busy[r];
    if (with_timeline)
      for (auto& ev : per_rank[r]) res.timeline.push_back(std::move(ev));
  }
  res.bubble_rate = max_span > 0.0 ? 1.0 - total_busy / (p.pp * max_span) : 0.0;
  res.idle_rate = res.makespan > 0.0 ? 1.0 - total_busy / (p.pp * res.makespan) : 0.0;
  return res;
}

}  // namespace zbpipe
