// The greedy list scheduler behind zb_auto / v_half / v_min (see list_scheduler.h).
//
// Time model = the simulator's: a rank runs one compute at a time; an F needs the previous
// stage's F (plus `comm` across ranks), an I needs its own F and the next stage's I (plus
// `comm`), a W needs its own I. Decisions are taken in global time order: the rank whose next
// action starts earliest commits it, so every input that can be ready at that moment is known.
//
// A rank's proposal (run this now, or wait until then) depends only on its own state and on the
// end times of the actions feeding its next F and I, so it is recomputed only when one of those
// changes: after the rank acts or wakes, and after a neighbour ends an action it consumes. A
// tournament tree over the ranks' proposals finds the next one; a run is O(actions * log pp).
//
// A run can also play every grid point of a policy set at once and fork where they part
// (ListRun): a knob check that splits the set hands the points that decide otherwise a copy of
// the run as it stands, to resume on their own, so a common prefix is played once.
//
// Alongside, each committed action is timed the way zbpipe::simulate would time the finished
// program (it starts when its rank's previous action ends and its inputs are there, which can be
// earlier than the scheduler's clock after a deliberate wait), so the run returns the simulator's
// numbers without a second pass.
#include "list_scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "../stage_values.h"
#include "zbpipe/cancel.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"

namespace zbpipe::detail {

int PolicyGrid::size(Knob k) const {
  switch (k) {
    case kWarmup: return static_cast<int>(warmups.size());
    case kOrder: return static_cast<int>(orders.size());
    case kFill: return static_cast<int>(fills.size());
    case kAvoid: return static_cast<int>(avoids.size());
    case kRecycle: return static_cast<int>(recycles.size());
    default: return static_cast<int>(deeps.size());
  }
}

PolicySet PolicySet::all(const PolicyGrid& g) {
  PolicySet s;
  for (int k = 0; k < kNumKnobs; ++k) {
    const int n = g.size(static_cast<Knob>(k));
    ZB_CHECK(n >= 1 && n <= 32, "search knob ", k, " needs 1 to 32 values, got ", n);
    s.bits[k] = n == 32 ? ~0u : (1u << n) - 1;
  }
  return s;
}

// Named (not anonymous): ListRun in list_scheduler.h holds a ListScheduler.
namespace list_run {

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

// The rank whose proposal comes first: earliest time, an action before a wake-up at the same
// time, then the lower rank (the order the scheduler has always used). A tournament tree with
// the keys in its nodes: an update replays one leaf-to-root path. A key packs the time's bits
// (times are >= 0, so their IEEE patterns order as unsigned integers) above the tie order, so
// one integer comparison, which compiles without branches, orders two proposals.
class ProposalTree {
 public:
  explicit ProposalTree(int ranks) {
    while (leaves_ < ranks) leaves_ *= 2;
    node_.assign(2 * leaves_, pack(kNever, ~0u));
  }
  void update(int r, const Proposal& pr) {
    size_t i = leaves_ + r;
    node_[i] = pack(pr.time, pr.act ? r : leaves_ + r);
    for (i /= 2; i >= 1; i /= 2) node_[i] = std::min(node_[2 * i], node_[2 * i + 1]);
  }
  // The first rank, or -1 when no rank has anything to do.
  int top() const {
    const Key k = node_[1];
    if (static_cast<uint64_t>(k >> 64) == bits(kNever)) return -1;
    const int order = static_cast<int>(static_cast<uint32_t>(k));
    return order >= leaves_ ? order - leaves_ : order;
  }

 private:
  using Key = unsigned __int128;
  static uint64_t bits(double t) {
    uint64_t u;
    std::memcpy(&u, &t, sizeof u);
    return u;
  }
  // t + 0.0 turns a -0.0 into +0.0, the one non-negative double whose bits would sort last.
  static Key pack(double t, uint32_t order) {
    return static_cast<Key>(bits(t + 0.0)) << 64 | order;
  }
  int leaves_ = 1;
  std::vector<Key> node_;  // heap layout: node_[leaves_ + r] is rank r's proposal
};

// Per (stage, microbatch) times, microbatch-major and grown as microbatches are reached, so a
// fork copies only what its run has reached (a stopped run seldom gets far).
class MicrobatchTimes {
 public:
  MicrobatchTimes(int stages, double absent) : ns_(stages), absent_(absent) {}
  double get(int s, int mb) const {
    const size_t i = index(s, mb);
    return i < v_.size() ? v_[i] : absent_;
  }
  void set(int s, int mb, double t) {
    const size_t i = index(s, mb);
    if (i >= v_.size()) v_.resize(static_cast<size_t>(mb + 1) * ns_, absent_);
    v_[i] = t;
  }
  void reserve(int microbatches) { v_.reserve(static_cast<size_t>(microbatches) * ns_); }

 private:
  size_t index(int s, int mb) const { return static_cast<size_t>(mb) * ns_ + s; }
  int ns_;
  double absent_;
  std::vector<double> v_;
};

// What the runs of one search share and never change: the inputs and the tables derived from
// them (a fork copies only a run's own state).
struct ListTables {
  ListTables(const Program& shell, const CostModel& costs, const MemoryModel& memory,
             const std::vector<double>& cap, const PolicyGrid& grid);
  const Program& shell;  // topology and sizes; its rank lists are not read
  const std::vector<double>& cap;
  const PolicyGrid& grid;
  const double comm;
  const StageTable per;            // per-stage costs and memory deltas
  std::vector<double> tail;        // per stage: least time from F start to W end
  std::vector<double> to_first;    // per stage: least time from its I end to W(0) end
};

ListTables::ListTables(const Program& shell, const CostModel& costs, const MemoryModel& memory,
                       const std::vector<double>& cap, const PolicyGrid& grid)
    : shell(shell), cap(cap), grid(grid), comm(costs.comm), per(shell.num_stages, costs, memory) {
  const int ns = shell.num_stages;
  auto same_rank = [&](int a, int b) { return shell.stage_to_rank[a] == shell.stage_to_rank[b]; };
  // tail[s]: the least time from the start of F(s, mb) to the end of W(s, mb): the forwards
  // down to the last stage, the backward-inputs back, W, and comm at each change of rank.
  tail.assign(ns, 0.0);
  for (int s = ns - 1; s >= 0; --s) {
    const double hop = s + 1 < ns && !same_rank(s, s + 1) ? 2.0 * comm : 0.0;
    tail[s] = per.f(s) + per.b(s) + (s + 1 < ns ? tail[s + 1] - per.w(s + 1) + hop : 0.0) + per.w(s);
  }
  // to_first[s]: the least time from the end of I(s, mb) to the end of W(0, mb): the
  // backward-inputs down to stage 0, with comm at each change of rank, and stage 0's W.
  to_first.assign(ns, 0.0);
  for (int s = 1; s < ns; ++s)
    to_first[s] = to_first[s - 1] + (same_rank(s - 1, s) ? 0.0 : comm) + per.b(s - 1) +
                  (s == 1 ? per.w(0) : 0.0);
}

class ListScheduler {
 public:
  // The run of every grid point in `cell` (a product set) at once, under its first point's
  // policy; a knob check that splits the set forks the run (see run()).
  ListScheduler(std::shared_ptr<const ListTables> tables, const PolicySet& cell)
      : t_(std::move(tables)), cell_(cell), p_(t_->shell), cap_(t_->cap),
        grid_(t_->grid), m_(p_.microbatches), ns_(p_.num_stages), comm_(t_->comm),
        per_(t_->per), tail_(t_->tail), to_first_(t_->to_first),
        end_f_(ns_, kNever), end_i_(ns_, kNever), sim_f_(ns_, 0.0), sim_i_(ns_, 0.0),
        next_f_(ns_, 0), next_i_(ns_, 0), done_w_(ns_, 0), f_ready_(ns_, kNever),
        i_ready_(ns_, kNever), ranks_(p_.pp), props_(p_.pp), tree_(p_.pp),
        dirty_flag_(p_.pp, 0), order_(p_.pp) {
    use_first_point();
    for (MicrobatchTimes* t : {&end_f_, &end_i_, &sim_f_, &sim_i_}) t->reserve(m_);
    if (m_ > 0) f_ready_[0] = 0.0;
    one_stage_ = p_.num_stages == p_.pp;
    for (int r = 0; r < p_.pp; ++r) {
      RankState& rk = ranks_[r];
      for (int s : p_.stages_of(r)) {
        ZB_CHECK(rk.nstages < 2, "the list scheduler handles 1 or 2 stages per rank");
        rk.stage[rk.nstages++] = s;
      }
      ZB_CHECK(rk.nstages >= 1, "rank ", r, " holds no stage");
      for (int k = 0; k < rk.nstages; ++k) rk.entry_mem += per_.held_by_forward(rk.stage[k]);
      ZB_CHECK(within_cap(rk.entry_mem, cap_[r]), "rank ", r, " cap ", cap_[r],
               " below one microbatch of its stages (", rk.entry_mem, ")");
      rk.left_fi = 2 * m_ * rk.nstages;
      for (int k = 0; k < rk.nstages; ++k) {
        rk.left_work += m_ * (per_.f(rk.stage[k]) + per_.b(rk.stage[k]) + per_.w(rk.stage[k]));
        rk.left_fi_work += m_ * (per_.f(rk.stage[k]) + per_.b(rk.stage[k]));
      }
      rk.pending_w.reserve(static_cast<size_t>(m_) * rk.nstages);
      order_[r].reserve(static_cast<size_t>(3) * m_ * rk.nstages);
      left_ += rk.left_fi + rk.left_fi / 2;  // F + I + W
    }
    for (int r = 0; r < p_.pp; ++r) mark_dirty(r);
  }

  // Plays on until every action has run, or until the bound stops the run (complete=false).
  // Each knob check that splits the set appends to `forks` a copy of this run as it stood
  // before the check, holding the points that decide otherwise and set to the first of them;
  // this run goes on with the points that decided as it did.
  ListRunResult run(const RunBound& bound, std::vector<ListRun>& forks) {
    while (left_ > 0) {
      poll_cancel();
      // A proposal reads the run's state and changes none of it, so a fork taken while one is
      // made resumes at that proposal: those before it hold for the fork's points too (they
      // decided every check so far as this run did).
      for (; dirty_at_ < dirty_.size(); ++dirty_at_) {
        const int r = dirty_[dirty_at_];
        const Proposal pr = propose(r);
        if (!splits_.empty()) fork(forks);
        props_[r] = pr;
        dirty_flag_[r] = 0;
        tree_.update(r, pr);
      }
      dirty_.clear();
      dirty_at_ = 0;
      const int r = tree_.top();
      ZB_CHECK(r >= 0, "list scheduler stalled on '", p_.schedule, "' with ", left_,
               " actions left");
      if (!props_[r].act) {
        ranks_[r].clock = props_[r].time;  // idle until its next input arrives
        mark_dirty(r);
        continue;
      }
      apply(r, props_[r].choice);
      --left_;
      // Its clock plus the compute it still owes bounds the rank's last end from below (the
      // running sum drifts by float noise only, far below the bound's margin); the rank has
      // started, so its span is that end minus its first start. Rank 0 ends no earlier than
      // this rank's last I plus that microbatch's way back (first_rank_bound).
      const RankState& rk = ranks_[r];
      const double last_end = std::max(rk.sim_clock + rk.left_work, drain_bound(r));
      const double first_end = first_rank_bound(r);
      const double makespan = std::max(last_end, first_end);
      const double span = std::max(last_end - rk.first_start, first_end - ranks_[0].first_start);
      const bool by_span = bound.objective == Objective::kSpan;
      if ((by_span ? span : makespan) > bound.objective_bar ||
          (by_span ? makespan : span) > bound.other_bar)
        return {};
    }
    return result();
  }

  // The grid points this run stands for: after a run, every one of them builds its program
  // (or stops where it stopped).
  const PolicySet& cell() const { return cell_; }
  // The policy it plays: the set's first grid point.
  const PolicyIndex& at() const { return at_; }
  // Each rank's compute order so far.
  std::vector<std::vector<Action>>& order() { return order_; }

 private:
  // Plays the set's first point: the lowest value of each knob (grid points nest knob by knob,
  // so that is the lowest grid point in a product set).
  void use_first_point() {
    for (int k = 0; k < kNumKnobs; ++k) at_[k] = __builtin_ctz(cell_.bits[k]);
    warmup_ = &grid_.warmups[at_[kWarmup]];
    ZB_CHECK(static_cast<int>(warmup_->size()) == p_.pp, "one warm-up value per rank");
    pol_.order = grid_.orders[at_[kOrder]];
    pol_.fill_ratio = grid_.fills[at_[kFill]];
    pol_.avoid_delaying_backward = grid_.avoids[at_[kAvoid]];
    pol_.recycle_first = grid_.recycles[at_[kRecycle]];
    pol_.deep_first = grid_.deeps[at_[kDeep]];
  }

  // One fork per split the last proposal made: this run as it stands (the proposal not yet
  // stored), with the split-off points.
  void fork(std::vector<ListRun>& forks) {
    std::vector<PolicySet> splits;
    splits.swap(splits_);
    for (const PolicySet& part : splits) {
      auto other = std::make_unique<ListScheduler>(*this);
      other->cell_ = part;
      other->use_first_point();
      forks.emplace_back(std::move(other));
    }
  }

  struct RankState {
    std::array<int, 2> stage{};       // local stages, ascending (= the order a microbatch visits)
    int nstages = 0;
    double clock = 0.0;               // when the rank is next free
    int live = 0;                     // (stage, microbatch) units held (F started, W not done)
    double mem = 0.0;                 // memory held (memory_model.h)
    double entry_mem = 0.0;           // what a microbatch entering the rank reserves: one F per stage
    bool backward_started = false;    // warm-up ends at the first I
    Kind last = Kind::W;              // last F or I run, for Order::kAlternate
    std::vector<std::pair<int, int>> pending_w;  // (stage, mb) whose I ran, FIFO from w_head
    size_t w_head = 0;
    int left_fi = 0;                  // F and I actions not yet run
    double left_work = 0.0;           // compute time of the actions not yet run
    double left_fi_work = 0.0;        // the same, of its F and I only
    // The simulator's view of the program so far.
    double sim_clock = 0.0, first_start = -1.0, busy = 0.0, peak_mem = 0.0;

    bool has_w() const { return w_head < pending_w.size(); }
  };

  // A second lower bound of a one-stage rank's last end: its last microbatch's W ends at least
  // tail_ after that microbatch's F starts, and before that F the rank must run every earlier
  // F of the stage and, to have room for it under the cap, enough I and W of earlier
  // microbatches to free all but cap - mem_f of their memory (least_time_to_free). It exceeds
  // clock + work left when the drain (the last microbatch's round trip) is longer than what
  // the rank still has to do meanwhile.
  double drain_bound(int r) const {
    const RankState& rk = ranks_[r];
    if (rk.nstages != 1) return v_drain_bound(r);
    const int s = rk.stage[0], last = m_ - 1;
    if (next_f_[s] > last) {
      if (next_i_[s] > last) return 0.0;  // only W left: clock + work left says it all
      return sim_f_.get(s, last) - per_.f(s) + tail_[s];
    }
    // Held at the last F's start, after the forwards still owed: at most cap - mem_f.
    const double to_free = rk.mem + (m_ - next_f_[s]) * per_.held_by_forward(s) - cap_[r];
    const double before = (last - next_f_[s]) * per_.f(s) +
                          least_time_to_free(s, to_free, next_i_[s] - done_w_[s]);
    return rk.sim_clock + before + tail_[s];
  }

  // The least compute time in which stage s's rank can free `amount` more memory, with
  // `pending` W whose I already ran: the optimum of the linear relaxation
  //   min b x + w y  s.t.  (mem_f - mem_w) x + mem_w y >= amount,  y <= x + pending,  x, y >= 0
  // (x more I, y more W; a W needs its I), taken at the best of its feasible vertices.
  double least_time_to_free(int s, double amount, int pending) const {
    if (amount <= 0.0) return 0.0;
    const double by_i = per_.of(s, Kind::I).freed, by_w = per_.of(s, Kind::W).freed;
    double best = kNever;
    if (by_i > 0.0) best = per_.b(s) * amount / by_i;                      // I only
    if (by_w > 0.0 && amount <= by_w * pending) best = std::min(best, per_.w(s) * amount / by_w);
    if (amount > by_w * pending) {                                     // every pending W, then I + W
      const double x = (amount - by_w * pending) / (by_i + by_w);
      best = std::min(best, per_.b(s) * x + per_.w(s) * (x + pending));
    }
    return best;
  }

  // A lower bound of rank 0's last end from one-stage rank r > 0: r's last I ends no earlier
  // than its clock plus the F and I it still owes and the W the cap forces before its last F
  // (or ended when it ran), and rank 0 then runs that microbatch's W after the backward-inputs
  // down to it. 0 when it does not apply.
  double first_rank_bound(int r) const {
    if (!one_stage_ || r == 0) return 0.0;
    const RankState& rk = ranks_[r];
    const int s = rk.stage[0];
    if (next_i_[s] == m_) return sim_i_.get(s, m_ - 1) + to_first_[s];
    double forced = 0.0;
    const double by_w = per_.of(s, Kind::W).freed;
    if (next_f_[s] < m_ && by_w > 0.0) {
      // Held at the last F's start at most cap - mem_f; every I but the last one's may help.
      const double to_free = rk.mem + (m_ - next_f_[s]) * per_.held_by_forward(s) - cap_[r] -
                             (m_ - 1 - next_i_[s]) * per_.of(s, Kind::I).freed;
      if (to_free > 1e-9 * cap_[r]) forced = std::ceil(to_free / by_w - 1e-9) * per_.w(s);
    }
    return rk.sim_clock + rk.left_fi_work + forced + to_first_[s];
  }

  // A V rank (stages s0 < s1) under whole-microbatch memory (both stages hold the same u from
  // F to W, I frees nothing; otherwise 0: no bound): with cap = cap / u microbatch units, the
  // last microbatch enters (F on s0) only with live <= cap - 2. By then every earlier F of s0
  // has run and each F of s1 that ran is a unit too, so W done >= last + F1 - cap + 2 (F1: F of
  // s1 run by then); a W of either stage of microbatch k waits for F(s1, k) (I(s0, k) follows
  // I(s1, k) round the V), so W done <= 2 F1, hence F1 >= last - cap + 2. Those F, F1, W and
  // their I run before it, its round trip tail_ after it. A V cap holds few microbatches, so
  // most of the rank's work must precede that F.
  double v_drain_bound(int r) const {
    const RankState& rk = ranks_[r];
    const int s0 = rk.stage[0], s1 = rk.stage[1], last = m_ - 1;
    const double u = per_.held_by_forward(s0);
    if (u <= 0.0 || per_.held_by_forward(s1) != u || per_.of(s0, Kind::I).freed != 0.0 ||
        per_.of(s1, Kind::I).freed != 0.0)
      return 0.0;
    // Saturated in double: 2m + 2 units already bind nothing below (and no int overflow
    // under an infinite or huge cap).
    const int cap = static_cast<int>(std::min(2.0 * m_ + 2, std::floor(cap_[r] / u + 1e-9)));
    if (next_f_[s0] > last) return 0.0;  // the round trip is under way: clock + work left
    const int f1 = std::max(next_f_[s1], last - cap + 2);
    const int w_done = last + f1 - cap + 2;
    const double before = (last - next_f_[s0]) * per_.f(s0) + (f1 - next_f_[s1]) * per_.f(s1) +
                          std::max(0, w_done - done_w_[s0] - done_w_[s1]) * std::min(per_.w(s0), per_.w(s1)) +
                          std::max(0, w_done - next_i_[s0] - next_i_[s1]) * std::min(per_.b(s0), per_.b(s1));
    return std::max(rk.sim_clock + before + tail_[s0], v_chain_bound(r, cap));
  }

  // [Note: the V chain bound] Under the same memory, microbatch k enters rank r (F on s0) only
  // with at most cap - 2 units held, so at most cap - 2 of the s0 units of microbatches before
  // k are still live: W(s0, k - c) has ended, c = cap - 1 (a stage's W run in microbatch order,
  // after its I). That W ends at least tail_[s0] after its F started, so F(s0, k) starts at
  // least tail_[s0] after F(s0, k - c) started. Chained from the last microbatch down to one
  // that has started (its start known) or to the first that has not (at the rank's clock at
  // the earliest), and the last microbatch's own round trip after it: the rank's last end.
  // Where the clock and work left amortise the wait for memory, this counts one whole round
  // trip per c microbatches, which stops runs that fall behind far sooner.
  double v_chain_bound(int r, int cap) const {
    const RankState& rk = ranks_[r];
    const int s0 = rk.stage[0], next = next_f_[s0], last = m_ - 1, c = cap - 1;
    if (c < 1 || next > last) return 0.0;
    const int steps = (last - next) / c + 1;  // the chain's first known link is last - steps * c
    const int known = last - steps * c;
    double start = rk.sim_clock + (steps - 1) * tail_[s0];
    if (known >= 0)
      start = std::max(start, sim_f_.get(s0, known) - per_.f(s0) + steps * tail_[s0]);
    return start + tail_[s0];
  }

  bool same_rank(int a, int b) const { return p_.stage_to_rank[a] == p_.stage_to_rank[b]; }
  double arrive(int from, double t, int to) const {
    if (t == kNever) return kNever;
    return same_rank(from, to) ? t : t + comm_;
  }
  // The scheduler chooses F, I and W only (Choice::kind).
  double cost(const Choice& ch) const { return ch.kind == Kind::F ? per_.f(ch.stage) : ch.kind == Kind::I ? per_.b(ch.stage) : per_.w(ch.stage); }
  bool admits(const RankState& rk, int s) const { return s == rk.stage[0]; }

  void mark_dirty(int r) {
    if (dirty_flag_[r]) return;
    dirty_flag_[r] = 1;
    dirty_.push_back(r);
  }

  // Keeps in the cell only the values of knob `k` for which `same(i)` holds, i.e. those that
  // would have taken the decision the run's own value took.
  // The values dropped go to a fork of their own (splits_).
  template <typename Same>
  void narrow(Knob k, Same same) const {
    uint32_t& bits = cell_.bits[k];
    if ((bits & (bits - 1)) == 0) return;  // one value left
    uint32_t keep = 0;
    for (uint32_t rest = bits; rest != 0; rest &= rest - 1) {
      const int i = __builtin_ctz(rest);
      if (same(i)) keep |= 1u << i;
    }
    if (keep == bits) return;
    splits_.push_back(cell_);
    splits_.back().bits[k] = bits & ~keep;
    bits = keep;
  }
  void narrow_to_own(Knob k) const {
    narrow(k, [&](int i) { return i == at_[k]; });
  }

  // The earliest-ready forward this rank may start under its memory limits; `held` gets the
  // earliest ready time of a forward that only the memory limits hold back.
  Choice next_forward(int r, double& held) const {
    const RankState& rk = ranks_[r];
    Choice fit[2];
    int nfit = 0;
    held = kNever;
    for (int k = 0; k < rk.nstages; ++k) {
      const int s = rk.stage[k], mb = next_f_[s];
      if (mb >= m_) continue;
      const double ready = f_ready_[s];
      // Entering: room for this F and the later-stage F some admitted microbatch still owes.
      const bool entering = admits(rk, s);
      bool fits = within_cap(rk.mem + (entering ? rk.entry_mem : per_.held_by_forward(s)), cap_[r]);
      if (fits && entering && !rk.backward_started) {
        const int need = rk.live + rk.nstages;
        fits = need <= (*warmup_)[r];
        narrow(kWarmup, [&](int i) { return (need <= grid_.warmups[i][r]) == fits; });
      }
      if (!fits) {
        held = std::min(held, ready);
        continue;
      }
      if (ready < kNever) fit[nfit++] = {Kind::F, s, mb, ready};
    }
    if (nfit == 0) return {};
    if (nfit == 1) return fit[0];
    if (fit[0].ready != fit[1].ready) return fit[0].ready < fit[1].ready ? fit[0] : fit[1];
    narrow_to_own(kDeep);  // a tie: the depth-first knob decides
    return pol_.deep_first ? fit[1] : fit[0];
  }

  // The earliest-ready backward-input; ties go to the later stage (it feeds the earlier one).
  Choice next_backward(int r) const {
    const RankState& rk = ranks_[r];
    Choice best;
    for (int k = rk.nstages - 1; k >= 0; --k) {
      const int s = rk.stage[k];
      if (i_ready_[s] < best.ready) best = {Kind::I, s, next_i_[s], i_ready_[s]};
    }
    return best;
  }

  Proposal run_w(int r) const {
    const RankState& rk = ranks_[r];
    const auto& [s, mb] = rk.pending_w[rk.w_head];
    return {true, {Kind::W, s, mb, rk.clock}, rk.clock};
  }

  Proposal propose(int r) const {
    const RankState& rk = ranks_[r];
    const double t = rk.clock;
    const bool has_w = rk.has_w();
    if (rk.left_fi == 0) return has_w ? run_w(r) : Proposal{};
    double held = kNever;
    const Choice f = next_forward(r, held), b = next_backward(r);
    const bool f_now = f.ready <= t + kEps, b_now = b.ready <= t + kEps;
    const double tw = has_w ? per_.w(rk.pending_w[rk.w_head].first) : 0.0;
    auto fill_fits = [&](double gap) {
      if (!has_w) return false;
      auto fits = [&](double ratio) { return ratio >= 0.0 && gap + kEps >= ratio * tw; };
      const bool own = fits(pol_.fill_ratio);
      narrow(kFill, [&](int i) { return fits(grid_.fills[i]) == own; });
      return own;
    };
    // A forward waits only for memory: free it before anything else (1F1B's B = I + W). Without
    // a ready F or I the rank recycles anyway (below), so only then does the knob decide.
    if (has_w && held <= t + kEps && (f_now || b_now)) {
      narrow_to_own(kRecycle);
      if (pol_.recycle_first) return run_w(r);
    }
    if (f_now && b_now) {
      auto pick_f = [&](ListPolicy::Order o) {
        return o == ListPolicy::Order::kForwardFirst ||
               (o == ListPolicy::Order::kAlternate && rk.last == Kind::I);
      };
      const bool own = pick_f(pol_.order);
      narrow(kOrder, [&](int i) { return pick_f(grid_.orders[i]) == own; });
      return {true, own ? f : b, t};
    }
    if (b_now) return {true, b, t};
    if (f_now) {
      // An F ending after the backward's input lands would delay that backward.
      if (b.ready < t + per_.f(f.stage) - kEps) {
        narrow_to_own(kAvoid);
        if (pol_.avoid_delaying_backward) {
          if (fill_fits(b.ready - t)) return run_w(r);
          return {false, {}, b.ready};
        }
      }
      return {true, f, t};
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

  // When everything `part` needs (producers_of) is on its rank, from the end times in `ends_f`
  // and `ends_i` (this scheduler runs I, never B, so a "B or I" producer reads `ends_i`); data
  // from another rank arrives comm_ later. kNever while some producer has not run.
  double needs_met(const Action& part, const MicrobatchTimes& ends_f,
                   const MicrobatchTimes& ends_i) const {
    double t = 0.0;
    for (const Producer& d : producers_of(part, ns_)) {
      const double e = (d.kind == Kind::F ? ends_f : ends_i).get(d.stage, part.microbatch);
      t = std::max(t, d.data ? arrive(d.stage, e, part.stage) : e);
    }
    return t;
  }

  // When the next F / I of stage s has its inputs (kNever: not known yet, or none left); kept
  // up to date by apply() whenever an end time they read is set.
  double forward_ready(int s) const {
    const int mb = next_f_[s];
    if (mb >= m_) return kNever;
    return needs_met(Action(s, Kind::F, mb), end_f_, end_i_);
  }
  double backward_ready(int s) const {
    const int mb = next_i_[s];
    if (mb >= m_ || mb >= next_f_[s]) return kNever;
    return needs_met(Action(s, Kind::I, mb), end_f_, end_i_);
  }

  // When the simulator would have the inputs of `ch` on its rank.
  double sim_ready(const Choice& ch) const {
    return needs_met(Action(ch.stage, ch.kind, ch.mb), sim_f_, sim_i_);
  }

  void apply(int r, const Choice& ch) {
    RankState& rk = ranks_[r];
    const double duration = cost(ch);
    rk.clock += duration;
    const double start = std::max(rk.sim_clock, std::max(0.0, sim_ready(ch)));
    const double finish = start + duration;
    if (rk.first_start < 0.0) rk.first_start = start;
    rk.sim_clock = finish;
    rk.busy += duration;
    rk.left_work -= duration;
    if (ch.kind != Kind::W) rk.left_fi_work -= duration;
    mark_dirty(r);
    switch (ch.kind) {
      case Kind::F: {
        const int s = ch.stage;
        end_f_.set(s, ch.mb, rk.clock);
        sim_f_.set(s, ch.mb, finish);
        ++next_f_[s];
        f_ready_[s] = forward_ready(s);
        if (next_i_[s] == ch.mb) i_ready_[s] = backward_ready(s);  // its own F was missing
        ++rk.live;
        rk.mem += per_.of(s, Kind::F).added;
        rk.peak_mem = std::max(rk.peak_mem, rk.mem);
        --rk.left_fi;
        rk.last = Kind::F;
        // The consuming stage's rank reads this end time only if it waits for this microbatch.
        const int to = data_consumer(Action(s, Kind::F, ch.mb), ns_);
        if (to >= 0 && next_f_[to] == ch.mb) {
          f_ready_[to] = forward_ready(to);
          mark_dirty(p_.stage_to_rank[to]);
        }
        break;
      }
      case Kind::I: {
        const int s = ch.stage;
        end_i_.set(s, ch.mb, rk.clock);
        sim_i_.set(s, ch.mb, finish);
        ++next_i_[s];
        i_ready_[s] = backward_ready(s);
        rk.backward_started = true;
        rk.mem -= per_.of(s, Kind::I).freed;
        rk.pending_w.emplace_back(s, ch.mb);
        --rk.left_fi;
        rk.last = Kind::I;
        const int to = data_consumer(Action(s, Kind::I, ch.mb), ns_);
        if (to >= 0 && next_i_[to] == ch.mb) {
          i_ready_[to] = backward_ready(to);
          mark_dirty(p_.stage_to_rank[to]);
        }
        break;
      }
      case Kind::W:
        --rk.live;
        rk.mem -= per_.of(ch.stage, Kind::W).freed;
        ++done_w_[ch.stage];
        ++rk.w_head;
        break;
      case Kind::B:  // never chosen: the scheduler splits every backward
      case Kind::SEND_F:
      case Kind::RECV_F:
      case Kind::SEND_B:
      case Kind::RECV_B:
      case Kind::OVERLAP_F_B:
      case Kind::S:  // vocabulary actions come after lowering (insert_vocab)
      case Kind::T:
      case Kind::BCAST_F:
      case Kind::ALLREDUCE_S:
      case Kind::REDUCE_B:
        ZB_CHECK(false, "list scheduler chose '", kind_name(ch.kind), "'");
    }
    order_[r].emplace_back(ch.stage, ch.kind, ch.mb);
  }

  // zbpipe::simulate's summary, from the same per-rank numbers in the same order.
  ListRunResult result() const {
    ListRunResult res;
    res.complete = true;
    double total_busy = 0.0;
    for (const RankState& rk : ranks_) {
      res.makespan = std::max(res.makespan, rk.sim_clock);
      const double span = rk.first_start < 0.0 ? 0.0 : rk.sim_clock - rk.first_start;
      res.max_span = std::max(res.max_span, span);
      total_busy += rk.busy;
      res.peak_memory.push_back(rk.peak_mem);
    }
    res.bubble_rate = res.max_span > 0.0 ? 1.0 - total_busy / (p_.pp * res.max_span) : 0.0;
    return res;
  }

  std::shared_ptr<const ListTables> t_;
  mutable PolicySet cell_;              // the grid points this run stands for (proposals narrow it)
  mutable std::vector<PolicySet> splits_;  // what the proposal being made split off
  const Program& p_;
  const std::vector<double>& cap_;
  const PolicyGrid& grid_;
  PolicyIndex at_{};                    // the policy played: cell_'s first point
  const std::vector<int>* warmup_ = nullptr;
  ListPolicy pol_;
  const int m_, ns_;
  const double comm_;
  const StageTable& per_;               // per-stage costs and memory deltas
  const std::vector<double>& tail_;     // per stage: least time from F start to W end
  const std::vector<double>& to_first_;  // per stage: least time from its I end to W(0) end
  bool one_stage_ = false;              // every rank holds one stage
  MicrobatchTimes end_f_, end_i_;       // scheduler's end time per (stage, mb); kNever = not run
  MicrobatchTimes sim_f_, sim_i_;       // the simulator's end times of the same actions
  std::vector<int> next_f_, next_i_;    // per stage: next microbatch to run F / I on (in order)
  std::vector<int> done_w_;             // per stage: W run so far
  std::vector<double> f_ready_, i_ready_;  // per stage: forward_ready / backward_ready, cached
  std::vector<RankState> ranks_;
  std::vector<Proposal> props_;         // each rank's current proposal
  ProposalTree tree_;                   // the earliest of props_
  std::vector<int> dirty_;              // ranks whose proposal must be recomputed
  std::vector<char> dirty_flag_;
  size_t dirty_at_ = 0;                 // the first of dirty_ not yet proposed afresh
  std::vector<std::vector<Action>> order_;  // each rank's compute order so far
  int left_ = 0;                        // actions not yet run
};

}  // namespace list_run

using list_run::ListScheduler;
using list_run::ListTables;

ListRun::ListRun(const Program& shell, const CostModel& costs, const MemoryModel& memory,
                 const std::vector<double>& cap, const PolicyGrid& grid, const PolicySet& set) {
  ZB_CHECK(static_cast<int>(cap.size()) == shell.pp, "cap needs one value per rank");
  for (int k = 0; k < kNumKnobs; ++k)
    ZB_CHECK(set.bits[k] != 0 && static_cast<uint64_t>(set.bits[k]) >> grid.size(static_cast<Knob>(k)) == 0,
             "policy set out of the grid");
  run_ = std::make_unique<ListScheduler>(
      std::make_shared<const ListTables>(shell, costs, memory, cap, grid), set);
}

ListRun::ListRun(std::unique_ptr<ListScheduler> run) : run_(std::move(run)) {}
ListRun::ListRun(ListRun&&) noexcept = default;
ListRun& ListRun::operator=(ListRun&&) noexcept = default;
ListRun::~ListRun() = default;

ListRunResult ListRun::play(const RunBound& bound, std::vector<ListRun>& forks) {
  return run_->run(bound, forks);
}

const PolicySet& ListRun::set() const { return run_->cell(); }
const PolicyIndex& ListRun::policy() const { return run_->at(); }

void ListRun::take_program(Program& into) {
  ZB_CHECK(static_cast<int>(into.ranks.size()) == into.pp, "program has ", into.ranks.size(),
           " rank lists for pp=", into.pp);
  into.ranks = std::move(run_->order());
}

}  // namespace zbpipe::detail
