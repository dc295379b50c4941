// The greedy list scheduler behind zb_auto / v_half / v_min (see list_scheduler.h).
//
// Time model = the simulator's: a rank runs one compute at a time; an F needs the previous
// stage's F (plus `comm` across ranks), an I needs its own F and the next stage's I (plus
// `comm`), a W needs its own I. Decisions are taken in global time order: the rank whose next
// action starts earliest commits it, so every input that can be ready at that moment is known.
#include "list_scheduler.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <tuple>
#include <utility>

#include "zbpipe/error.h"
#include "zbpipe/simulator.h"

namespace zbpipe::detail {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;

struct Choice {
  Kind kind = Kind::W;
  int stage = -1;
  int mb = -1;
  double ready = kNever;  // when its inputs are on this rank; kNever = not known yet
  bool valid() const { return stage >= 0; }
};

// What a rank would do next: run `choice` at its clock, or wait until `time`.
struct Proposal {
  bool act = false;
  Choice choice;
  double time = kNever;
};

class ListScheduler {
 public:
  ListScheduler(Program& p, const CostModel& costs, const std::vector<int>& cap,
                const std::vector<int>& warmup, const ListPolicy& policy)
      : p_(p), c_(costs), cap_(cap), warmup_(warmup), pol_(policy), m_(p.microbatches),
        last_stage_(p.num_stages - 1),
        end_f_(static_cast<size_t>(p.num_stages) * m_, kNever),
        end_i_(static_cast<size_t>(p.num_stages) * m_, kNever),
        next_f_(p.num_stages, 0), next_i_(p.num_stages, 0), ranks_(p.pp) {
    for (int r = 0; r < p.pp; ++r) {
      ranks_[r].stages = p.stages_of(r);
      ranks_[r].left_fi = 2 * m_ * static_cast<int>(ranks_[r].stages.size());
      const int spr = static_cast<int>(ranks_[r].stages.size());
      ZB_CHECK(spr <= 2, "the list scheduler handles 1 or 2 stages per rank, got ", spr);
      ZB_CHECK(cap[r] >= spr, "rank ", r, " cap ", cap[r], " below its stage count");
    }
  }

  void run() {
    int left = 0;
    for (const auto& rk : ranks_) left += rk.left_fi + rk.left_fi / 2;  // F + I + W
    while (left > 0) {
      int act_r = -1, wait_r = -1;
      Proposal act, wait;
      for (int r = 0; r < p_.pp; ++r) {
        Proposal pr = propose(r);
        if (pr.act && (act_r < 0 || pr.time < act.time)) act = pr, act_r = r;
        if (!pr.act && pr.time < wait.time) wait = pr, wait_r = r;
      }
      if (wait_r >= 0 && (act_r < 0 || wait.time < act.time)) {
        ranks_[wait_r].clock = wait.time;  // idle until its next input arrives
        continue;
      }
      ZB_CHECK(act_r >= 0, "list scheduler stalled on '", p_.schedule, "' with ", left,
               " actions left");
      apply(act_r, act.choice);
      --left;
    }
  }

 private:
  struct RankState {
    std::vector<int> stages;          // local stages, ascending (= the order a microbatch visits)
    double clock = 0.0;               // when the rank is next free
    int live = 0;                     // activations held (F started, W not done)
    bool backward_started = false;    // warm-up ends at the first I
    Kind last = Kind::W;              // last F or I run, for Order::kAlternate
    std::deque<std::pair<int, int>> pending_w;  // (stage, mb) whose I ran, FIFO
    int left_fi = 0;                  // F and I actions not yet run
  };

  size_t idx(int s, int mb) const { return static_cast<size_t>(s) * m_ + mb; }
  double arrive(int from, double t, int to) const {
    if (t == kNever) return kNever;
    return p_.rank_of(from) == p_.rank_of(to) ? t : t + c_.comm;
  }
  double cost(const Choice& ch) const {
    switch (ch.kind) {
      case Kind::F: return c_.forward(ch.stage);
      case Kind::I: return c_.backward_input(ch.stage);
      default: return c_.backward_weight(ch.stage);
    }
  }
  int spr(int r) const { return static_cast<int>(ranks_[r].stages.size()); }
  bool admits(int r, int s) const { return s == ranks_[r].stages.front(); }

  // Stages in the order forwards are preferred on ties.
  std::vector<int> forward_order(int r) const {
    std::vector<int> order = ranks_[r].stages;
    if (pol_.deep_first) std::reverse(order.begin(), order.end());
    return order;
  }

  // The earliest-ready forward this rank may start under its memory limits; `held` gets the
  // earliest ready time of a forward that only the memory limits hold back.
  Choice next_forward(int r, double& held) const {
    const RankState& rk = ranks_[r];
    Choice best;
    held = kNever;
    for (int s : forward_order(r)) {
      const int mb = next_f_[s];
      if (mb >= m_) continue;
      const double ready = s == 0 ? 0.0 : arrive(s - 1, end_f_[idx(s - 1, mb)], s);
      // Entering: room for this F and the later-stage F some admitted microbatch still owes.
      const int need = rk.live + (admits(r, s) ? spr(r) : 1);
      const bool fits = need <= cap_[r] &&
                        (!admits(r, s) || rk.backward_started || need <= warmup_[r]);
      if (!fits) {
        held = std::min(held, ready);
        continue;
      }
      if (ready < best.ready) best = {Kind::F, s, mb, ready};
    }
    return best;
  }

  // The earliest-ready backward-input; ties go to the later stage (it feeds the earlier one).
  Choice next_backward(int r) const {
    Choice best;
    const auto& stages = ranks_[r].stages;
    for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
      const int s = *it, mb = next_i_[s];
      if (mb >= m_ || mb >= next_f_[s]) continue;
      const double own = end_f_[idx(s, mb)];
      const double ready =
          s == last_stage_ ? own : std::max(own, arrive(s + 1, end_i_[idx(s + 1, mb)], s));
      if (ready < best.ready) best = {Kind::I, s, mb, ready};
    }
    return best;
  }

  Proposal run_now(const Choice& ch, double t) const { return {true, ch, t}; }
  Proposal run_w(int r) const {
    const auto& [s, mb] = ranks_[r].pending_w.front();
    return {true, {Kind::W, s, mb, ranks_[r].clock}, ranks_[r].clock};
  }

  Proposal propose(int r) const {
    const RankState& rk = ranks_[r];
    const double t = rk.clock;
    const bool has_w = !rk.pending_w.empty();
    if (rk.left_fi == 0) return has_w ? run_w(r) : Proposal{};
    double held = kNever;
    const Choice f = next_forward(r, held), b = next_backward(r);
    const bool f_now = f.ready <= t + kEps, b_now = b.ready <= t + kEps;
    const double tw = has_w ? c_.backward_weight(rk.pending_w.front().first) : 0.0;
    auto fill_fits = [&](double gap) {
      return has_w && pol_.fill_ratio >= 0.0 && gap + kEps >= pol_.fill_ratio * tw;
    };
    // A forward waits only for memory: free it before anything else (1F1B's B = I + W).
    if (pol_.recycle_first && has_w && held <= t + kEps) return run_w(r);
    if (f_now && b_now) {
      switch (pol_.order) {
        case ListPolicy::Order::kBackwardFirst: return run_now(b, t);
        case ListPolicy::Order::kForwardFirst: return run_now(f, t);
        case ListPolicy::Order::kAlternate: return run_now(rk.last == Kind::I ? f : b, t);
      }
    }
    if (b_now) return run_now(b, t);
    if (f_now) {
      // An F ending after the backward's input lands would delay that backward.
      if (pol_.avoid_delaying_backward && b.ready < t + c_.forward(f.stage) - kEps) {
        if (fill_fits(b.ready - t)) return run_w(r);
        return {false, {}, b.ready};
      }
      return run_now(f, t);
    }
    if (held <= t + kEps && has_w) return run_w(r);  // recycle memory for a waiting forward
    // Wake up when an input lands, or when a held-back forward could run after a W.
    const double next = std::min({f.ready, b.ready, has_w ? held : kNever});
    // Stage 0's backward feeds no one: delaying it behind a W costs only this rank's own time,
    // which the W uses, so any gap before it is worth filling.
    const bool harmless = b.valid() && b.stage == 0 && b.ready <= f.ready;
    if (fill_fits(harmless ? kNever : next - t)) return run_w(r);
    return {false, {}, next};
  }

  void apply(int r, const Choice& ch) {
    RankState& rk = ranks_[r];
    const double end = rk.clock + cost(ch);
    rk.clock = end;
    switch (ch.kind) {
      case Kind::F:
        end_f_[idx(ch.stage, ch.mb)] = end;
        ++next_f_[ch.stage];
        ++rk.live;
        --rk.left_fi;
        rk.last = Kind::F;
        break;
      case Kind::I:
        end_i_[idx(ch.stage, ch.mb)] = end;
        ++next_i_[ch.stage];
        rk.backward_started = true;
        rk.pending_w.emplace_back(ch.stage, ch.mb);
        --rk.left_fi;
        rk.last = Kind::I;
        break;
      default:
        --rk.live;
        rk.pending_w.pop_front();
        break;
    }
    p_.ranks[r].emplace_back(ch.stage, ch.kind, ch.mb);
  }

  Program& p_;
  const CostModel& c_;
  const std::vector<int>& cap_;
  const std::vector<int>& warmup_;
  const ListPolicy pol_;
  const int m_, last_stage_;
  std::vector<double> end_f_, end_i_;   // end time per (stage, mb); kNever = not run yet
  std::vector<int> next_f_, next_i_;    // per stage: next microbatch to run F / I on (in order)
  std::vector<RankState> ranks_;
};

}  // namespace

void list_schedule(Program& p, const CostModel& costs, const std::vector<int>& cap,
                   const std::vector<int>& warmup, const ListPolicy& policy) {
  ZB_CHECK(static_cast<int>(cap.size()) == p.pp && static_cast<int>(warmup.size()) == p.pp,
           "cap/warmup need one value per rank");
  for (auto& acts : p.ranks) acts.clear();
  ListScheduler(p, costs, cap, warmup, policy).run();
}

namespace {

// One scored candidate. Bubble rate is monotone in the longest span (total work is fixed), so
// spans are compared; rounding keeps float noise from choosing between equal schedules.
struct Scored {
  Program program;
  double makespan, max_span, bubble;
  long memory;  // sum of per-rank peaks
};

double round9(double x) { return std::round(x * 1e9) / 1e9; }

// How much worse than `ref` a candidate is on its worse metric (1 = no worse on either).
double regret(const Scored& c, const Scored& ref) {
  auto ratio = [](double x, double y) { return y > 0.0 ? x / y : (x > 0.0 ? kNever : 1.0); };
  return std::max(ratio(c.makespan, ref.makespan), ratio(c.max_span, ref.max_span));
}

}  // namespace

Program search_list_schedules(const Program& shell, const CostModel& costs,
                              const std::vector<int>& cap,
                              const std::vector<std::vector<int>>& warmups,
                              const std::vector<Seed>& seeds) {
  costs.check(shell.num_stages);
  using Order = ListPolicy::Order;
  std::vector<Scored> cands, refs;
  int primary = -1;  // index into refs
  auto score = [&](Program prog, bool is_seed, Seed::Role role) {
    const SimResult res = simulate(prog, costs);
    long mem = 0;
    for (int r = 0; r < prog.pp; ++r) {
      if (res.peak_activations[r] > cap[r]) {
        ZB_CHECK(is_seed, "list scheduler broke the memory cap on rank ", r, ": ",
                 res.peak_activations[r], " > ", cap[r]);
        return;  // a seed that does not fit the cap is no reference
      }
      mem += res.peak_activations[r];
    }
    double span = *std::max_element(res.span.begin(), res.span.end());
    Scored sc{std::move(prog), round9(res.makespan), round9(span), round9(res.bubble_rate), mem};
    if (role == Seed::Role::kPrimary) primary = static_cast<int>(refs.size());
    if (role != Seed::Role::kCandidate) refs.push_back(sc);
    cands.push_back(std::move(sc));
  };
  for (const Seed& seed : seeds) score(seed.program, true, seed.role);
  const bool multi = shell.num_stages > shell.pp;
  for (const auto& warmup : warmups)
    for (Order order : {Order::kBackwardFirst, Order::kForwardFirst, Order::kAlternate})
      for (double fill : {0.0, 0.5, 1.0, -1.0})
        for (bool avoid : {false, true})
          for (bool recycle : {false, true})
            for (bool deep : {true, false}) {
              if (!deep && !multi) continue;  // the knob only matters with several stages per rank
              Program cand = shell;
              list_schedule(cand, costs, cap, warmup, {order, fill, avoid, recycle, deep});
              score(std::move(cand), false, Seed::Role::kCandidate);
            }
  ZB_CHECK(!cands.empty(), "no candidate schedule for '", shell.schedule, "'");
  auto worst = [&](const Scored& c) {
    double w = 1.0;
    for (const auto& ref : refs) w = std::max(w, round9(regret(c, ref)));
    return w;
  };
  // Pool: those no worse than every reference; else those no worse than the primary; else all.
  std::vector<size_t> pool;
  for (size_t i = 0; i < cands.size(); ++i)
    if (worst(cands[i]) <= 1.0) pool.push_back(i);
  if (pool.empty() && primary >= 0)
    for (size_t i = 0; i < cands.size(); ++i)
      if (regret(cands[i], refs[primary]) <= 1.0) pool.push_back(i);
  if (pool.empty())
    for (size_t i = 0; i < cands.size(); ++i) pool.push_back(i);
  auto key = [&](size_t i) {
    const Scored& c = cands[i];
    return std::make_tuple(worst(c), c.makespan, c.bubble, c.memory);
  };
  size_t best = pool.front();
  for (size_t i : pool)
    if (key(i) < key(best)) best = i;
  return std::move(cands[best].program);
}

}  // namespace zbpipe::detail
