// Cost-model simulation (see simulator.h for what is and is not modelled).
#include "zbpipe/simulator.h"

#include <algorithm>

#include "passes/action_table.h"
#include "passes/vocab_rules.h"
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

namespace {
// The collectives of a run: when each (kind, microbatch) was last posted, by how many ranks,
// and when it completes (kUnset until every rank posted it).
class CollectiveClock {
 public:
  CollectiveClock(int pp, int microbatches, double latency)
      : pp_(pp), latency_(latency), count_(static_cast<size_t>(microbatches) * 3, 0),
        latest_(count_.size(), 0.0), complete_(count_.size(), kUnset) {}
  void post(Kind k, int mb, double at) {
    const size_t i = index(k, mb);
    latest_[i] = std::max(latest_[i], at);
    if (++count_[i] == pp_) complete_[i] = latest_[i] + latency_;
  }
  double complete(Kind k, int mb) const { return complete_[index(k, mb)]; }

 private:
  static size_t index(Kind k, int mb) {
    return static_cast<size_t>(mb) * 3 + (k == Kind::BCAST_F ? 0 : k == Kind::ALLREDUCE_S ? 1 : 2);
  }
  int pp_;
  double latency_;
  std::vector<int> count_;
  std::vector<double> latest_, complete_;
};
}  // namespace

SimResult simulate(const Program& p, const CostModel& costs, const MemoryModel& memory,
                   bool with_timeline) {
  return simulate(p, costs, memory, VocabModel{}, with_timeline);
}

SimResult simulate(const Program& p, const CostModel& costs, const MemoryModel& memory,
                   const VocabModel& vocab, bool with_timeline) {
  costs.check(p.num_stages, p.microbatches, p.pp);
  memory.check(p.num_stages);
  const bool vocabulary = has_vocab(p);
  if (vocabulary) vocab.check(p.pp);
  bool has_t = false;
  for (const auto& acts : p.ranks)
    for (const Action& a : acts) has_t = has_t || a.kind == Kind::T;
  CollectiveClock collectives(p.pp, vocabulary ? p.microbatches : 0, vocab.collective);
  std::vector<std::vector<TimelineEvent>> posts(with_timeline && vocabulary ? p.pp : 0);
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
        if (is_collective(a.kind)) {  // a post: no rank time, but REDUCE_B waits to rescale
          double at = clock[r];
          if (a.kind == Kind::REDUCE_B) {
            const double stats = collectives.complete(Kind::ALLREDUCE_S, a.microbatch);
            if (stats == kUnset) break;
            at = clock[r] = std::max(at, stats);
          }
          collectives.post(a.kind, a.microbatch, at);
          if (with_timeline) posts[r].push_back({r, a, at, 0.0});
          ++next[r];
          progress = true;
          continue;
        }
        double ready = 0.0, duration = 0.0;
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
          double t = is_vocab(s->kind) ? 0.0 : input_time(*s);
          const Kind awaited = vocabulary ? detail::awaited_collective(p, *s) : Kind::F;
          if (t != kUnset && awaited != Kind::F) {
            const double c = collectives.complete(awaited, s->microbatch);
            t = c == kUnset ? kUnset : std::max(t, c);
          }
          if (t == kUnset) { ready = kUnset; break; }
          ready = std::max(ready, t);
          duration += s->kind == Kind::S   ? vocab.s_time(r)
                      : s->kind == Kind::T ? vocab.t_time(r)
                                           : table.of(*s).duration;
        }
        if (ready == kUnset) break;
        const double start = std::max(clock[r], ready), finish = start + duration;
        // Memory: every part's addition at the common start, then every part's release.
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
          held[r] += s->kind == Kind::S ? vocab.memory(r) : is_vocab(s->kind) ? 0.0 : table.of(*s).added;
        res.peak_memory[r] = std::max(res.peak_memory[r], held[r]);
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
          held[r] -= s->kind == Kind::T || (s->kind == Kind::S && !has_t) ? vocab.memory(r)
                     : is_vocab(s->kind)                                 ? 0.0
                                                                         : table.of(*s).freed;
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
    if (!posts.empty())
      for (auto& ev : posts[r]) {
        ev.end = collectives.complete(ev.action.kind, ev.action.microbatch);
        res.collectives.push_back(std::move(ev));
      }
  }
  res.bubble_rate = max_span > 0.0 ? 1.0 - total_busy / (p.pp * max_span) : 0.0;
  res.idle_rate = res.makespan > 0.0 ? 1.0 - total_busy / (p.pp * res.makespan) : 0.0;
  return res;
}

}  // namespace zbpipe
