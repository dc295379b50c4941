// Lower bounds of every rank's span (see span_bound.h for the three arguments).
#include "zbpipe/cancel.h"
#include "zbpipe/span_bound.h"

#include <algorithm>
#include <cmath>

#include "stage_values.h"
#include "zbpipe/error.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

namespace {

class Bounds {
 public:
  Bounds(const Program& p, const CostModel& costs, const MemoryModel& memory,
         const std::vector<double>& cap)
      : p_(p), c_(costs), t_(p.num_stages, costs, memory), cap_(cap), m_(p.microbatches),
        ns_(p.num_stages) {}

  double rank_bound(int r) const {
    const std::vector<int> own = p_.stages_of(r);
    double work = 0.0;
    for (int s : own) work += m_ * (f(s) + b(s) + w(s));
    double bound = work + unavoidable_idle(r, own);
    for (int q = 0; q < p_.pp; ++q) {
      poll_cancel();  // pp^2 chains of O(pp) each: seconds at pp = 1024
      const std::vector<int> theirs = p_.stages_of(q);
      if (theirs[0] > own[0]) bound = std::max(bound, chain(own, theirs, q));
    }
    return bound;
  }

 private:
  // Message latency from stage j to stage j + 1 (either way).
  double hop(int j) const { return p_.rank_of(j) != p_.rank_of(j + 1) ? c_.comm : 0.0; }
  double f(int s) const { return t_.f(s); }
  double b(int s) const { return t_.b(s); }
  double w(int s) const { return t_.w(s); }

  // From the end of F(s, k) to the earliest start of I(s, k): the forwards of the later
  // stages, then their backward-inputs back, with a message each way between ranks.
  double round_trip(int s) const {
    double t = 0.0;
    for (int j = s; j + 1 < ns_; ++j) t += 2.0 * hop(j) + f(j + 1) + b(j + 1);
    return t;
  }

  // From the end of I(hi, k) to the end of I(lo, k), lo < hi: the backward-inputs between.
  double backward_path(int hi, int lo) const {
    double t = 0.0;
    for (int j = lo; j < hi; ++j) t += hop(j) + b(j);
    return t;
  }

  // The least W time rank q must spend before its last F to have room for it: the cap holds
  // what the forwards add less what was freed, and the I done by then free at most all but
  // one microbatch's share (the last F's own I comes after it).
  double forced_w(const std::vector<int>& stages, int q) const {
    double total = 0.0, by_i = 0.0, least_i = 0.0;
    for (size_t k = 0; k < stages.size(); ++k) {
      const int s = stages[k];
      total += m_ * t_.held_by_forward(s);
      const double share = t_.of(s, Kind::I).freed;
      by_i += m_ * share;
      least_i = k == 0 ? share : std::min(least_i, share);
    }
    const double by_w = total - cap_[q] - (by_i - least_i);
    if (by_w <= 1e-9 * total) return 0.0;
    // One stage: whole W, each freeing mem_w. Several: the cheapest rate of freeing.
    if (stages.size() == 1) {
      const int s = stages[0];
      if (t_.of(s, Kind::W).freed <= 0.0) return 0.0;
      return std::ceil(by_w / t_.of(s, Kind::W).freed - 1e-9) * w(s);
    }
    double rate = -1.0;
    for (int s : stages)
      if (t_.of(s, Kind::W).freed > 0.0) rate = rate < 0.0 ? w(s) / t_.of(s, Kind::W).freed : std::min(rate, w(s) / t_.of(s, Kind::W).freed);
    return rate < 0.0 ? 0.0 : by_w * rate;
  }

  // Rank r's span covers rank q's F and I (see span_bound.h, "chain").
  double chain(const std::vector<int>& own, const std::vector<int>& theirs, int q) const {
    double start = 0.0;
    for (int j = own[0]; j < theirs[0]; ++j) start += f(j) + hop(j);
    double busy = forced_w(theirs, q);
    for (int s : theirs) busy += m_ * (f(s) + b(s));
    // q's last I is of some stage tau of q; r then runs, for each of its stages below tau,
    // that microbatch's I and W. The stage of the last I is not known: the least tail counts.
    double tail = -1.0;
    for (int tau : theirs) {
      double after = 0.0;
      for (int rho : own)
        if (rho < tau) after = std::max(after, backward_path(tau, rho) + w(rho));
      tail = tail < 0.0 ? after : std::min(tail, after);
    }
    return start + busy + tail;
  }

  // The most forward time rank r can run before its first backward: what the cap holds.
  double forwards_before_backward(const std::vector<int>& own, int r, bool& all) const {
    double total = 0.0, rate = 0.0;
    for (int s : own) {
      total += m_ * f(s);
      rate = std::max(rate, f(s) / t_.held_by_forward(s));
    }
    double most = cap_[r] * rate;
    if (own.size() == 1) {  // whole forwards
      const int s = own[0];
      most = std::min<double>(m_, std::floor(cap_[r] / t_.held_by_forward(s) + 1e-9)) * f(s);
    }
    all = most >= total - 1e-9 * total;
    return std::min(most, total);
  }

  // The most backward work rank r can have pending when its last F starts, within the cap
  // less that F's own memory.
  double backward_held(const std::vector<int>& own, int r) const {
    if (own.size() == 1) {  // a microbatches before their I, b between I and W: exact
      const int s = own[0];
      const double mf = t_.held_by_forward(s), mw = t_.of(s, Kind::W).freed, room = cap_[r] - mf;
      double best = 0.0;
      for (int a = 0; a < m_ && a * mf <= room + 1e-9 * cap_[r]; ++a) {
        poll_cancel();
        const double rest = room - a * mf;
        const int most_b = m_ - 1 - a;
        // In double: under an infinite cap rest / mw is no int.
        const int held_b =
            mw > 0.0 ? static_cast<int>(std::min<double>(most_b, std::floor(rest / mw + 1e-9))) : most_b;
        best = std::max(best, a * (b(s) + w(s)) + std::max(0, held_b) * w(s));
      }
      return best;
    }
    // Several stages: the best rate of backward work per unit of memory held, plus the last
    // microbatch's own backward on the rank's higher stages (it runs inside the window too).
    double rate = 0.0, own_work = 0.0, least_f = t_.held_by_forward(own[0]);
    for (int s : own) {
      rate = std::max(rate, (b(s) + w(s)) / t_.held_by_forward(s));
      if (t_.of(s, Kind::W).freed > 0.0) rate = std::max(rate, w(s) / t_.of(s, Kind::W).freed);
      if (s != own[0]) own_work += b(s) + w(s);
      least_f = std::min(least_f, t_.held_by_forward(s));
    }
    return std::max(0.0, cap_[r] - least_f) * rate + own_work;
  }

  // Idle time rank r cannot avoid at the start and at the end (see span_bound.h, "idle").
  double unavoidable_idle(int r, const std::vector<int>& own) const {
    const int low = own[0];
    // Start: the first backward of r is an I of some stage rho, a round trip after F(rho).
    double first_backward = -1.0, reach = 0.0;
    for (int j = low; j < ns_; ++j) {
      reach += f(j);
      if (p_.rank_of(j) == r) {
        const double t = reach + round_trip(j);
        first_backward = first_backward < 0.0 ? t : std::min(first_backward, t);
      }
      if (j + 1 < ns_) reach += hop(j);
    }
    bool all_forwards_fit = false;
    const double start_idle =
        std::max(0.0, first_backward - forwards_before_backward(own, r, all_forwards_fit));
    // End: after the last F (of some stage rho of r), r waits for that microbatch's backward
    // to come back down to its lowest stage.
    double wait = -1.0;
    for (int rho : own) {
      double t = round_trip(rho);
      if (rho > low) t += b(rho) + backward_path(rho, low) - b(low);
      wait = wait < 0.0 ? t : std::min(wait, t);
    }
    const double end_idle = std::max(0.0, wait - backward_held(own, r));
    return all_forwards_fit ? std::max(start_idle, end_idle) : start_idle + end_idle;
  }

  const Program& p_;
  const CostModel& c_;
  const detail::StageTable t_;  // durations and memory deltas per (stage, kind)
  const std::vector<double>& cap_;
  const int m_, ns_;
};

}  // namespace

SpanBound span_lower_bound(const Program& shape, const CostModel& costs,
                           const MemoryModel& memory, const std::vector<double>& cap) {
  costs.check(shape.num_stages, shape.microbatches, shape.pp);
  memory.check(shape.num_stages);
  ZB_SCHEDULE_CHECK(!has_vocab(shape), "span_lower_bound does not bound vocabulary-parallel programs ('",
                    shape.schedule, "')");
  ZB_SCHEDULE_CHECK(cap.size() == 1 || static_cast<int>(cap.size()) == shape.pp,
                    "span_lower_bound: memory_cap needs 1 value or one per rank (", shape.pp,
                    "), got ", cap.size());
  bool any = false, backward = false;
  for (const auto& acts : shape.ranks)
    for (const Action& a : acts) {
      any = true;
      backward = backward || a.kind == Kind::B || a.kind == Kind::I || a.kind == Kind::OVERLAP_F_B;
    }
  ZB_SCHEDULE_CHECK(!any || backward, "span_lower_bound bounds training programs, but '",
                    shape.schedule, "' runs no backward");
  const std::vector<double> caps = cap.size() == 1 ? std::vector<double>(shape.pp, cap[0]) : cap;
  for (int r = 0; r < shape.pp; ++r)
    for (int s : shape.stages_of(r))
      ZB_SCHEDULE_CHECK(within_cap(memory.forward(s), caps[r]), "span_lower_bound: memory_cap=",
                        caps[r], " of rank ", r, " holds no microbatch of stage ", s,
                        " (mem_f=", memory.forward(s), ")");
  SpanBound out;
  const Bounds bounds(shape, costs, memory, caps);
  double work = 0.0;
  for (int r = 0; r < shape.pp; ++r) {
    out.span.push_back(bounds.rank_bound(r));
    out.max_span = std::max(out.max_span, out.span.back());
    for (int s : shape.stages_of(r))
      work += shape.microbatches *
              (costs.forward(s) + costs.backward_input(s) + costs.backward_weight(s));
  }
  out.bubble_rate = out.max_span > 0.0 ? 1.0 - work / (shape.pp * out.max_span) : 0.0;
  return out;
}

}  // namespace zbpipe
