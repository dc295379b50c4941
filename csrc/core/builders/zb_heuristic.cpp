// The Zero Bubble paper's greedy scheduler (see zb_heuristic.h), written from the paper's
// section 3.1 and the public reference's description of it: the order is built stage by stage
// in the time order of its microbatches, and every placed action is timed on the spot the way
// zbpipe::simulate times the finished program (it starts when its rank is free and its input
// has arrived), so the knobs decide on the real timing of what is already placed.
#include "zb_heuristic.h"

#include <algorithm>
#include <limits>

#include "../stage_values.h"
#include "zbpipe/cancel.h"
#include "zbpipe/error.h"

namespace zbpipe::detail {

namespace {

constexpr double kUnplaced = -1.0;

class PaperGreedy {
 public:
  PaperGreedy(Program& p, const CostModel& costs, const MemoryModel& memory,
              const std::vector<double>& cap, const ZbHeuristicKnobs& knobs)
      : p_(p), cap_(cap), knobs_(knobs), ns_(p.num_stages), m_(p.microbatches),
        comm_(costs.comm), per_(ns_, costs, memory), nf_(ns_, 0), ni_(ns_, 0), nw_(ns_, 0), clock_(ns_, 0.0),
        mem_(ns_, 0.0), idle_(ns_, 0.0), first_(ns_, 0.0), busy_(ns_, 0.0), peak_(ns_, 0.0),
        end_f_(static_cast<size_t>(ns_) * m_, kUnplaced), end_i_(end_f_) {
    for (int s = 0; s < ns_; ++s) {
      p.ranks[s].clear();
      p.ranks[s].reserve(static_cast<size_t>(3) * m_);
    }
  }

  ListRunResult run() {
    if (!warm_up()) return {};
    for (int mb = 1; mb < m_; ++mb)
      if (!steady_microbatch(mb)) return {};
    for (int s = 0; s < ns_; ++s)
      while (nw_[s] < m_) place(s, Kind::W);
    // zbpipe::simulate's summary, from the same per-rank numbers in the same order.
    ListRunResult res;
    res.complete = true;
    double total_busy = 0.0;
    for (int s = 0; s < ns_; ++s) {
      res.makespan = std::max(res.makespan, clock_[s]);
      res.max_span = std::max(res.max_span, clock_[s] - first_[s]);
      total_busy += busy_[s];
      res.peak_memory.push_back(peak_[s]);
    }
    res.bubble_rate = res.max_span > 0.0 ? 1.0 - total_busy / (ns_ * res.max_span) : 0.0;
    return res;
  }

 private:
  size_t idx(int s, int mb) const { return static_cast<size_t>(s) * m_ + mb; }
  bool has_w(int s) const { return nw_[s] < ni_[s]; }
  bool room_for_forward(int s, double extra) const {
    return within_cap(mem_[s] + extra + per_.held_by_forward(s), cap_[s]);
  }

  // When the input of the next `kind` (F or I) of stage s, for microbatch mb, reaches its rank;
  // kUnplaced while its producer is not placed yet (the order would wait on a later action).
  double arrival(int s, Kind kind, int mb) const {
    if (kind == Kind::F) {
      if (s == 0) return 0.0;
      const double e = end_f_[idx(s - 1, mb)];
      return e == kUnplaced ? kUnplaced : e + comm_;
    }
    if (s + 1 == ns_) return 0.0;  // its own F, placed earlier on this rank
    const double e = end_i_[idx(s + 1, mb)];
    return e == kUnplaced ? kUnplaced : e + comm_;
  }

  // Appends stage s's next `kind` action and times it; idle time after the stage's first
  // action counts toward its bubble.
  void place(int s, Kind kind) {
    poll_cancel();
    int& next = kind == Kind::F ? nf_[s] : kind == Kind::I ? ni_[s] : nw_[s];
    const int mb = next++;
    const double cost = kind == Kind::F ? per_.f(s) : kind == Kind::I ? per_.b(s) : per_.w(s);
    const double start = kind == Kind::W ? clock_[s] : std::max(clock_[s], arrival(s, kind, mb));
    const double end = start + cost;
    if (!p_.ranks[s].empty()) {
      idle_[s] += end - (clock_[s] + cost);
      most_idle_ = std::max(most_idle_, idle_[s]);
    } else {
      first_[s] = start;
    }
    clock_[s] = end;
    busy_[s] += cost;
    if (kind == Kind::F) {
      end_f_[idx(s, mb)] = end;
      mem_[s] += per_.of(s, Kind::F).added;
      peak_[s] = std::max(peak_[s], mem_[s]);
    } else if (kind == Kind::I) {
      end_i_[idx(s, mb)] = end;
      mem_[s] -= per_.of(s, Kind::I).freed;
    } else {
      mem_[s] -= per_.of(s, Kind::W).freed;
    }
    p_.ranks[s].emplace_back(s, kind, mb);
  }

  // Before an F or I whose input arrives at `arrive`: the W that end by then, and one more
  // into the gap left when leaving it idle would grow the bubble, or when filling greedily.
  void fill_gap(int s, double arrive) {
    while (has_w(s) && clock_[s] + per_.w(s) <= arrive) place(s, Kind::W);
    if (!has_w(s) || clock_[s] >= arrive) return;
    const bool hidden = arrive - clock_[s] <= most_idle_ - idle_[s];
    if (!hidden || knobs_.fill_short_gaps) place(s, Kind::W);
  }

  // Microbatch 0 runs F down the pipeline; then each stage adds the forwards that fit before
  // microbatch 0's backward reaches it (timed from the last stage back, each stage's backward
  // starting when both it and its input are ready), fewer on each later stage; then
  // microbatch 0's backward runs up.
  bool warm_up() {
    for (int s = 0; s < ns_; ++s) place(s, Kind::F);
    std::vector<int> extra(ns_, 0);
    double backward_end = clock_[ns_ - 1] + per_.b(ns_ - 1);  // the last stage's first I
    for (int s = ns_ - 2; s >= 0; --s) {
      double t = clock_[s], mem = 0.0;
      const double arrive = backward_end + comm_;
      while (nf_[s] + extra[s] < m_ && room_for_forward(s, mem)) {
        const bool stop = knobs_.idle_before_first_backward ? t + per_.f(s) > arrive : t >= arrive;
        if (stop) break;
        mem += per_.held_by_forward(s);
        t += per_.f(s);
        ++extra[s];
      }
      backward_end = std::max(t, arrive) + per_.b(s);
    }
    for (int s = 1; s < ns_; ++s)
      while (extra[s] > 0 && extra[s] >= extra[s - 1] && nf_[s] + extra[s] < m_) --extra[s];
    for (int s = 0; s < ns_; ++s)
      for (int k = 0; k < extra[s]; ++k) {
        if (arrival(s, Kind::F, nf_[s]) == kUnplaced) return false;
        place(s, Kind::F);
      }
    for (int s = ns_ - 1; s >= 0; --s) place(s, Kind::I);
    return true;
  }

  // One forward per stage (unless a stage skips it to let the next one catch up, which then
  // holds back every earlier stage too), then microbatch mb's backward up the pipeline.
  bool steady_microbatch(int mb) {
    std::vector<char> wants(ns_, 0);
    for (int s = 0; s < ns_; ++s) wants[s] = nf_[s] < m_ && !skips_forward(s);
    for (int s = ns_ - 2; s >= 0; --s) wants[s] = wants[s] && wants[s + 1];
    for (int s = 0; s < ns_; ++s) {
      if (!wants[s]) continue;
      while (!room_for_forward(s, 0.0)) {
        if (!has_w(s)) return false;
        place(s, Kind::W);
      }
      const double arrive = arrival(s, Kind::F, nf_[s]);
      if (arrive == kUnplaced) return false;
      if (s > 0) fill_gap(s, arrive);
      place(s, Kind::F);
    }
    for (int s = ns_ - 1; s >= 0; --s) {
      if (ni_[s] != mb || nf_[s] <= mb) return false;
      if (s + 1 < ns_) fill_gap(s, arrival(s, Kind::I, mb));
      if (s == 0 && nf_[0] == m_)
        while (has_w(0)) place(0, Kind::W);  // stage 0's I feeds nobody: W first costs nothing
      place(s, Kind::I);
    }
    return true;
  }

  // prioritize_backward: a stage two forwards ahead of the next skips its forward when the
  // next stage's F + I (and the message back) would end before this stage could run its F
  // and the W that make room for it, unless the wait that causes fits in the bubble.
  bool skips_forward(int s) const {
    if (!knobs_.prioritize_backward || s + 1 >= ns_ || nf_[s] < nf_[s + 1] + 2) return false;
    const double next_back = clock_[s + 1] + per_.f(s + 1) + per_.b(s + 1) + comm_;
    if (clock_[s] >= next_back) return true;
    double w_time = 0.0, mem = mem_[s] + per_.held_by_forward(s);
    for (int k = nw_[s]; !within_cap(mem, cap_[s]) && k < ni_[s]; ++k) {
      w_time += per_.w(s);
      mem -= per_.of(s, Kind::W).freed;
    }
    if (clock_[s] + per_.f(s) + w_time <= next_back) return false;
    return next_back - clock_[s] <= most_idle_ - idle_[s];
  }

  Program& p_;
  const std::vector<double>& cap_;
  const ZbHeuristicKnobs knobs_;
  const int ns_, m_;
  const double comm_;
  const StageTable per_;                          // per-stage costs and memory deltas
  std::vector<int> nf_, ni_, nw_;                  // per stage: F / I / W placed so far
  std::vector<double> clock_, mem_, idle_;         // per stage: end of its last action, memory
                                                   // held, idle time after its first action
  std::vector<double> first_, busy_, peak_;        // per stage: the simulator's span start,
                                                   // compute time and peak memory
  double most_idle_ = 0.0;                         // the largest idle_ (it only grows)
  std::vector<double> end_f_, end_i_;              // per (stage, mb): end time, or kUnplaced
};

}  // namespace

ListRunResult zb_heuristic_order(Program& p, const CostModel& costs, const MemoryModel& memory,
                                 const std::vector<double>& cap, const ZbHeuristicKnobs& knobs) {
  ZB_CHECK(p.num_stages == p.pp && static_cast<int>(p.ranks.size()) == p.pp,
           "the paper heuristic takes one stage per rank");
  for (int s = 0; s < p.num_stages; ++s)
    ZB_CHECK(p.stage_to_rank[s] == s, "the paper heuristic takes the loop topology");
  ZB_CHECK(static_cast<int>(cap.size()) == p.pp, "cap needs one value per rank");
  return PaperGreedy(p, costs, memory, cap, knobs).run();
}

std::vector<Seed> zb_heuristic_candidates(const Program& shell, const CostModel& costs,
                                          const MemoryModel& memory,
                                          const std::vector<double>& cap) {
  std::vector<Seed> out;
  for (bool idle_first : {true, false})
    for (bool prioritize : {true, false})
      for (bool greedy : {true, false}) {
        Seed seed{shell, Seed::Role::kCandidate};
        seed.timing = zb_heuristic_order(seed.program, costs, memory, cap,
                                         {idle_first, prioritize, greedy});
        if (!seed.timing.complete) continue;
        bool seen = false;  // knob settings often agree: offer each order once
        for (const Seed& other : out) seen = seen || other.program.ranks == seed.program.ranks;
        if (!seen) out.push_back(std::move(seed));
      }
  return out;
}

}  // namespace zbpipe::detail
