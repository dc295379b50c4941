// The refinement pass (see refine.h): first-improvement local search over per-rank orders.
//
// Candidates are timed by a lean copy of zbpipe::simulate's arithmetic (same operations in the
// same order, so the same numbers to the last bit, without the timeline and the checks a user's
// program needs); the refined program is then run through zbpipe::simulate itself, which must
// agree. A move is applied in place (std::rotate) and only what it can change is timed again:
// every action that started before the moved-to place's predecessor ended keeps its times
// (an action's start depends only on actions that ended by then, none of which moved). When
// the move does not help, the order is rotated back and the saved times are put back.
#include <algorithm>
#include <cmath>

#include "../stage_values.h"
#include "zbpipe/cancel.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"
#include "zbpipe/vocab.h"
#include "zbpipe/refine.h"

namespace zbpipe {

namespace {

constexpr double kUnset = -1.0;

// What the search compares: the objective's figure (longest span or makespan), its sum over
// the ranks (progress on the other ranks while the longest stays), and the other figure.
struct Figures {
  double primary = 0.0, sum = 0.0, other = 0.0;
};

// One timing of the orders: per rank and position, start and end; per rank, its last end and
// first start.
struct Timing {
  std::vector<std::vector<double>> start, end;
  std::vector<double> clock, first;
};

bool below(double a, double b) { return a < b - 1e-9 * (1.0 + std::abs(b)); }
bool not_above(double a, double b) { return !below(b, a); }

// Same-microbatch order inside one rank: whether `z` must run before `y` (z is one of y's
// transitive producers). All forwards of a microbatch precede all its backwards; forwards go
// up the stages, backwards down, and W follows its stage's I.
bool needed_before(const Action& z, const Action& y) {
  if (z.stage == y.stage && z.kind == y.kind) return true;  // each stage keeps its order
  if (z.microbatch != y.microbatch || z.kind == Kind::W) return false;
  if (z.kind == Kind::F) return y.kind != Kind::F || z.stage < y.stage;
  if (y.kind == Kind::F) return false;
  return y.kind == Kind::W ? z.stage >= y.stage : z.stage > y.stage;  // z is B or I
}

class OrderSearch {
 public:
  OrderSearch(const Program& p, const CostModel& costs, const MemoryModel& memory,
              const std::vector<double>& cap, const RefineOptions& opt)
      : p_(p), cap_(cap), opt_(opt), ns_(p.num_stages), m_(p.microbatches), comm_(costs.comm),
        per_(ns_, costs, memory),
        end_f_(static_cast<size_t>(ns_) * m_, kUnset), end_b_(end_f_), ranks_(p.ranks) {
    for (const auto& acts : ranks_) actions_ += static_cast<long>(acts.size());
    now_.start.resize(p.pp);
    now_.end.resize(p.pp);
    for (int r = 0; r < p.pp; ++r) {
      now_.start[r].resize(ranks_[r].size());
      now_.end[r].resize(ranks_[r].size());
    }
    now_.clock.assign(p.pp, 0.0);
    now_.first.assign(p.pp, -1.0);
    from_.assign(p.pp, 0);
  }

  // Times the program given; false when it deadlocks.
  bool start() {
    if (!time_from()) return false;
    initial_ = cur_ = figures(now_);
    return true;
  }

  // Whether rank r's order stays within its cap.
  bool fits(int r) const {
    double held = 0.0;
    for (const Action& a : ranks_[r]) {
      if ((&a - ranks_[r].data()) % 256 == 0) poll_cancel();  // a hot loop: every 256th
      held += per_.of(a).added;
      if (!within_cap(held, cap_[r])) return false;
      held -= per_.of(a).freed;
    }
    return true;
  }

  // Runs the search from the started program; returns whether some move was kept.
  bool run() {
    bool moved = false;
    while (!done() && improve_pass(initial_.other)) moved = true;
    return moved;
  }

  const std::vector<std::vector<Action>>& orders() const { return ranks_; }
  Figures initial() const { return initial_; }
  Figures current() const { return cur_; }

 private:
  double cost(const Action& a) const { return per_.of(a).duration; }
  size_t idx(int s, int mb) const { return static_cast<size_t>(s) * m_ + mb; }
  bool done() const {
    return spent_ >= opt_.budget || not_above(cur_.primary, opt_.target);
  }

  // zbpipe::simulate's timing of ranks_ into now_, from position from_[r] of every rank on
  // (the positions before keep their times, and their results are in end_f_ / end_b_); false
  // when it deadlocks.
  bool time_from() {
    const int pp = p_.pp;
    long left = 0;
    for (int r = 0; r < pp; ++r) {
      left += static_cast<long>(ranks_[r].size() - from_[r]);
      now_.clock[r] = from_[r] == 0 ? 0.0 : now_.end[r][from_[r] - 1];
      if (from_[r] == 0) now_.first[r] = -1.0;
    }
    spent_ += left;
    std::vector<size_t>& next = from_;
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < pp; ++r) {
        const auto& acts = ranks_[r];
        while (next[r] < acts.size()) {
          if (next[r] % 256 == 0) poll_cancel();  // a hot loop: every 256th action
          const Action& a = acts[next[r]];
          double ready = 0.0;
          bool met = true;
          for (const Producer& d : producers_of(a, ns_)) {
            double e = (d.kind == Kind::F ? end_f_ : end_b_)[idx(d.stage, a.microbatch)];
            if (e == kUnset) {
              met = false;
              break;
            }
            if (d.data && p_.stage_to_rank[d.stage] != r) e += comm_;
            ready = std::max(ready, e);
          }
          if (!met) break;
          const double start = std::max(now_.clock[r], ready), finish = start + cost(a);
          record(a, finish);
          if (now_.first[r] < 0.0) now_.first[r] = start;
          now_.clock[r] = finish;
          now_.start[r][next[r]] = start;
          now_.end[r][next[r]] = finish;
          ++next[r];
          --left;
          progress = true;
        }
      }
    }
    return left == 0;
  }

  // Sets (or, with kUnset, clears) the end time others read of action a.
  void record(const Action& a, double end) {
    if (a.kind == Kind::F) end_f_[idx(a.stage, a.microbatch)] = end;
    else if (a.kind != Kind::W) end_b_[idx(a.stage, a.microbatch)] = end;
  }

  // Before moving an action to position `to` of rank r: sets from_ to the first action of each
  // rank that may change (its start is not before the end of r's action at to - 1), saves the
  // times from there on and clears their end times.
  void prepare(int r, int to) {
    const double t0 = to == 0 ? 0.0 : now_.end[r][to - 1];
    saved_.clear();
    saved_clock_ = now_.clock;
    saved_first_ = now_.first;
    for (int q = 0; q < p_.pp; ++q) {
      const auto& starts = now_.start[q];
      size_t from = std::lower_bound(starts.begin(), starts.end(), t0) - starts.begin();
      if (q == r) from = std::min(from, static_cast<size_t>(to));
      from_[q] = from;
      for (size_t i = from; i < starts.size(); ++i) {
        saved_.push_back(now_.start[q][i]);
        saved_.push_back(now_.end[q][i]);
        record(ranks_[q][i], kUnset);
      }
    }
  }

  // Puts back what prepare() saved (the order already restored).
  void restore() {
    size_t k = 0;
    for (int q = 0; q < p_.pp; ++q) {
      const size_t from = saved_from(q);
      for (size_t i = from; i < ranks_[q].size(); ++i) {
        now_.start[q][i] = saved_[k++];
        now_.end[q][i] = saved_[k++];
        record(ranks_[q][i], now_.end[q][i]);
      }
    }
    now_.clock = saved_clock_;
    now_.first = saved_first_;
  }
  size_t saved_from(int q) const { return saved_from_[q]; }

  // The objective's figure of rank r in timing t.
  double rank_figure(const Timing& t, int r) const {
    const double span = t.first[r] < 0.0 ? 0.0 : t.clock[r] - t.first[r];
    return opt_.objective == Objective::kSpan ? span : t.clock[r];
  }

  Figures figures(const Timing& t) const {
    Figures f;
    double makespan = 0.0, max_span = 0.0;
    for (int r = 0; r < p_.pp; ++r) {
      makespan = std::max(makespan, t.clock[r]);
      max_span = std::max(max_span, t.first[r] < 0.0 ? 0.0 : t.clock[r] - t.first[r]);
      f.sum += rank_figure(t, r);
    }
    const bool span = opt_.objective == Objective::kSpan;
    f.primary = span ? max_span : makespan;
    f.other = span ? makespan : max_span;
    return f;
  }

  bool better(const Figures& c, double other_limit) const {
    if (!not_above(c.other, other_limit)) return false;
    if (below(c.primary, cur_.primary)) return true;
    return not_above(c.primary, cur_.primary) && below(c.sum, cur_.sum);
  }

  // Moves rank r's action at `from` to `to` (< from), times the result and keeps it if better;
  // otherwise restores the order.
  bool try_move(int r, int from, int to, double other_limit) {
    auto& acts = ranks_[r];
    const auto first = acts.begin() + to, moved = acts.begin() + from;
    std::rotate(first, moved, moved + 1);
    if (!fits(r)) {
      std::rotate(first, first + 1, moved + 1);
      return false;
    }
    prepare(r, to);
    saved_from_ = from_;
    if (time_from()) {
      const Figures f = figures(now_);
      if (better(f, other_limit)) {
        cur_ = f;
        return true;
      }
    }
    std::rotate(first, first + 1, moved + 1);
    restore();
    return false;
  }

  // One pass over the ranks, whose figure is largest first: on each, improving moves gap by
  // gap until none of its gaps has one. Returns whether some move was kept.
  bool improve_pass(double other_limit) {
    std::vector<int> order(p_.pp);
    for (int r = 0; r < p_.pp; ++r) order[r] = r;
    std::vector<double> fig(p_.pp);
    for (int r = 0; r < p_.pp; ++r) fig[r] = rank_figure(now_, r);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return fig[a] > fig[b]; });
    bool any = false;
    for (int r : order) {
      for (bool kept = true; kept;) {
        kept = false;
        for (int x : gaps_of(r)) {
          if (done()) return any;
          if (fill_gap(r, x, other_limit) || hurry_input(r, x, other_limit) ||
              advance(r, x, other_limit)) {
            kept = any = true;
            break;
          }
        }
      }
    }
    return any;
  }

  // The positions of rank r that start after an idle gap, the largest gap first.
  std::vector<int> gaps_of(int r) const {
    std::vector<std::pair<double, int>> gaps;
    for (size_t x = 1; x < ranks_[r].size(); ++x) {
      poll_cancel();
      const double idle = now_.start[r][x] - now_.end[r][x - 1];
      if (idle > 1e-9 * (1.0 + now_.end[r][x - 1])) gaps.emplace_back(-idle, static_cast<int>(x));
    }
    std::stable_sort(gaps.begin(), gaps.end());
    std::vector<int> out;
    for (const auto& gap : gaps) out.push_back(gap.second);
    return out;
  }

  // Moves into the gap before position x the first later action of some (stage, kind) that
  // may run before everything it passes.
  bool fill_gap(int r, int x, double other_limit) {
    const auto& acts = ranks_[r];
    std::vector<int> firsts;
    std::vector<std::pair<int, Kind>> seen;
    for (size_t y = x + 1; y < acts.size(); ++y) {
      poll_cancel();
      const std::pair<int, Kind> key{acts[y].stage, acts[y].kind};
      if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
      seen.push_back(key);
      bool free = true;
      for (int z = x; z < static_cast<int>(y) && free; ++z) free = !needed_before(acts[z], acts[y]);
      if (free) firsts.push_back(static_cast<int>(y));
    }
    for (int y : firsts) {
      if (done()) return false;
      if (try_move(r, y, x, other_limit)) return true;
    }
    return false;
  }

  // Moves the action at position x (which waited for its input) a few places earlier, so that
  // what ran before it fills the gap behind it instead.
  bool advance(int r, int x, double other_limit) {
    for (int to = x - 1; to >= 0 && to >= x - kReach; --to) {
      if (needed_before(ranks_[r][to], ranks_[r][x])) break;
      if (done()) return false;
      if (try_move(r, x, to, other_limit)) return true;
    }
    return false;
  }

  // Moves the producer whose message the action at position x waited for a few places earlier
  // on its own rank.
  bool hurry_input(int r, int x, double other_limit) {
    const Action waiting = ranks_[r][x];
    for (const Producer& d : producers_of(waiting, ns_)) {
      const int q = p_.stage_to_rank[d.stage];
      if (!d.data || q == r) continue;
      const auto& acts = ranks_[q];
      int at = -1;
      for (size_t i = 0; i < acts.size() && at < 0; ++i) {
        const Action& a = acts[i];
        const bool kind_ok = d.either_backward() ? a.kind == Kind::B || a.kind == Kind::I
                                                 : a.kind == d.kind;
        if (a.stage == d.stage && a.microbatch == waiting.microbatch && kind_ok)
          at = static_cast<int>(i);
      }
      for (int to = at - 1; to >= 0 && to >= at - kReach; --to) {
        if (needed_before(ranks_[q][to], ranks_[q][at])) break;
        if (done()) return false;
        if (try_move(q, at, to, other_limit)) return true;
      }
    }
    return false;
  }

  static constexpr int kReach = 6;  // how many places advance() and hurry_input() try

  const Program& p_;
  const std::vector<double>& cap_;
  const RefineOptions& opt_;
  const int ns_, m_;
  const double comm_;
  const detail::StageTable per_;          // per-stage costs and memory deltas
  std::vector<double> end_f_, end_b_;      // per (stage, mb): end of F / of B or I
  std::vector<std::vector<Action>> ranks_;  // the orders being refined
  Timing now_;                             // the timing of ranks_ as they are
  std::vector<size_t> from_;               // per rank: first position (still) to time
  std::vector<size_t> saved_from_;         // prepare()'s from_, for restore()
  std::vector<double> saved_, saved_clock_, saved_first_;  // prepare()'s copy of the times
  long actions_ = 0, spent_ = 0;
  Figures initial_, cur_;
};

}  // namespace

Program refine_order(const Program& compute_only, const CostModel& costs,
                     const MemoryModel& memory, const std::vector<double>& cap,
                     const RefineOptions& options) {
  ZB_SCHEDULE_CHECK(!compute_only.has_comms(), "refine_order expects a compute-only program, but '",
                    compute_only.schedule, "' has communication actions");
  ZB_SCHEDULE_CHECK(!has_vocab(compute_only), "refine_order does not reorder vocabulary-parallel programs ('",
                    compute_only.schedule, "'): refine the program without them, then compile with vocab_parallel");
  ZB_SCHEDULE_CHECK(static_cast<int>(cap.size()) == compute_only.pp, "refine_order: cap needs one "
                    "value per rank (", compute_only.pp, "), got ", cap.size());
  costs.check(compute_only.num_stages, compute_only.microbatches, compute_only.pp);
  memory.check(compute_only.num_stages);
  for (const auto& acts : compute_only.ranks)
    for (const Action& a : acts)
      if (a.kind == Kind::OVERLAP_F_B) return compute_only;
  OrderSearch search(compute_only, costs, memory, cap, options);
  if (!search.start()) simulate(compute_only, costs, memory, false);  // throws, naming the deadlock
  for (int r = 0; r < compute_only.pp; ++r)
    if (!search.fits(r)) return compute_only;
  if (!search.run()) return compute_only;
  Program out = compute_only;
  out.ranks = search.orders();
  // The oracle: zbpipe::simulate agrees with the lean timing and confirms the claims.
  const SimResult after = simulate(out, costs, memory, false);
  const double span = *std::max_element(after.span.begin(), after.span.end());
  const bool by_span = options.objective == Objective::kSpan;
  const Figures now{by_span ? span : after.makespan, 0.0, by_span ? after.makespan : span};
  const Figures lean = search.current(), was = search.initial();
  ZB_CHECK(!below(now.primary, lean.primary) && !below(lean.primary, now.primary) &&
               !below(now.other, lean.other) && !below(lean.other, now.other),
           "refine_order: the lean timing and the simulator disagree");
  ZB_CHECK(not_above(now.primary, was.primary) && not_above(now.other, was.other),
           "refine_order made '", compute_only.schedule, "' worse");
  for (int r = 0; r < out.pp; ++r)
    ZB_CHECK(within_cap(after.peak_memory[r], cap[r]), "refine_order broke the cap on rank ", r);
  return out;
}

}  // namespace zbpipe
