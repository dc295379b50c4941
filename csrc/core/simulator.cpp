// Cost-model simulation (see simulator.h for what is and is not modelled).
#include "zbpipe/simulator.h"

#include <algorithm>

#include "passes/action_table.h"
#include "zbpipe/error.h"

namespace zbpipe {

using detail::ActionTable;

namespace {
constexpr double kUnset = -1.0;

double cost_of(const CostModel& c, const Action& a) {
  switch (a.kind) {
    case Kind::F: return c.forward(a.stage);
    case Kind::B: return c.backward_full(a.stage);
    case Kind::I: return c.backward_input(a.stage);
    case Kind::W: return c.backward_weight(a.stage);
    default: return 0.0;
  }
}
}  // namespace

SimResult simulate(const Program& p, const CostModel& costs) {
  costs.check(p.num_stages);
  const int last = p.num_stages - 1;
  ActionTable<double> end(p.num_stages, p.microbatches, kUnset);
  // Time at which the input of `a` is available on a's rank, or kUnset if not produced yet.
  auto arrival = [&](int producer_stage, double t, int consumer_stage) {
    if (t == kUnset) return kUnset;
    return p.rank_of(producer_stage) == p.rank_of(consumer_stage) ? t : t + costs.comm;
  };
  auto input_time = [&](const Action& a) -> double {
    const int s = a.stage, mb = a.microbatch;
    switch (a.kind) {
      case Kind::F: return s == 0 ? 0.0 : arrival(s - 1, end.at(s - 1, Kind::F, mb), s);
      case Kind::B:
      case Kind::I: {
        double own = end.at(s, Kind::F, mb);
        if (own == kUnset || s == last) return own;
        double up = end.at(s + 1, Kind::B, mb);
        if (up == kUnset) up = end.at(s + 1, Kind::I, mb);
        double t = arrival(s + 1, up, s);
        return t == kUnset ? kUnset : std::max(own, t);
      }
      case Kind::W: return end.at(s, Kind::I, mb);
      default: return 0.0;
    }
  };

  SimResult res;
  res.busy.assign(p.pp, 0.0);
  res.peak_activations.assign(p.pp, 0);
  std::vector<double> clock(p.pp, 0.0), first_start(p.pp, -1.0);
  std::vector<int> live(p.pp, 0);
  std::vector<size_t> next(p.pp, 0);
  std::vector<std::vector<TimelineEvent>> per_rank(p.pp);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p.pp; ++r) {
      const auto& acts = p.ranks[r];
      while (next[r] < acts.size()) {
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
          duration += cost_of(costs, *s);
        }
        if (ready == kUnset) break;
        const double start = std::max(clock[r], ready), finish = start + duration;
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
          end.at(s->stage, s->kind, s->microbatch) = finish;
          if (s->kind == Kind::F) res.peak_activations[r] = std::max(res.peak_activations[r], ++live[r]);
          if (s->kind == Kind::B || s->kind == Kind::W) --live[r];
        }
        if (first_start[r] < 0.0) first_start[r] = start;
        clock[r] = finish;
        res.busy[r] += duration;
        per_rank[r].push_back({r, a, start, finish});
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
    for (auto& ev : per_rank[r]) res.timeline.push_back(std::move(ev));
  }
  res.bubble_rate = max_span > 0.0 ? 1.0 - total_busy / (p.pp * max_span) : 0.0;
  res.idle_rate = res.makespan > 0.0 ? 1.0 - total_busy / (p.pp * res.makespan) : 0.0;
  return res;
}

}  // namespace zbpipe
