// Vocabulary pass: places every rank's S and T passes and their collectives (vocab.h) into a
// lowered program, by running the program under its costs and deciding, whenever a rank is
// free, what it does next. The base program's actions keep their order; a RECV waits for its
// SEND as in validate()'s blocking run, so the timed run that chose the placement is itself a
// run that finishes.
//
// Whenever a rank is free it first passes the SEND/RECV at the head of its own list (a RECV once
// its SEND went out), then posts the collectives whose turn has come (the order of
// collective_order) and whose input is there, then starts one compute:
//   1. S of its next microbatch, once that microbatch's broadcast completed (S is on the root's
//      critical path: the last stage's backward waits for every rank's S), unless `backlog`
//      microbatches already wait between their S and their T;
//   2. a T, when S waits for the backlog;
//   3. its own next compute, once its inputs (and, for the last stage's backward, the reduced
//      gradient) are there;
//   4. a T, to fill what would be idle time (as W does in the zero-bubble schedules).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <string>
#include <string>
#include <vector>

#include "forward_only.h"
#include "action_table.h"
#include "zbpipe/cancel.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"
#include "zbpipe/compile.h"
#include "zbpipe/passes.h"
#include "zbpipe/simulator.h"
#include "zbpipe/vocab.h"
#include "../stage_values.h"

namespace zbpipe {

using detail::ActionTable;
using detail::StageTable;

namespace {

constexpr double kUnset = -1.0;

class VocabPlacement {
 public:
  // `lookahead`: the forwards a rank may run ahead of its own order while it would otherwise
  // wait (reorder_for_vocab's run, on a compute-only program); 0 keeps the order.
  VocabPlacement(const Program& in, const CostModel& costs, const VocabModel& vocab, int lookahead,
                 const VocabPolicy& policy)
      : in_(in), vocab_(vocab), lookahead_(lookahead), priority_(policy.priority), table_(in.num_stages, costs, {}),
        comm_(costs.comm),
        training_(!detail::is_forward_only(in)), root_(vocab_root(in)), last_(in.num_stages - 1),
        per_mb_(training_ ? 3 : 2), end_(in.num_stages, in.microbatches, kUnset),
        sent_(in.num_stages, in.microbatches, kUnset), next_(in.pp, 0), clock_(in.pp, 0.0),
        next_s_(in.pp, 0), next_t_(in.pp, 0), turn_(in.pp, 0),
        taken_(in.pp), ahead_(in.pp, 0), posts_(static_cast<size_t>(in.microbatches) * per_mb_, 0),
        latest_(static_cast<size_t>(in.microbatches) * per_mb_, 0.0),
        complete_(static_cast<size_t>(in.microbatches) * per_mb_, kUnset) {
    out_ = in;
    for (int r = 0; r < in.pp; ++r) taken_[r].assign(in.ranks[r].size(), 0);
    // The collective order (vocab.h): per microbatch m, BCAST_F m and ALLREDUCE_S m, then
    // (training) REDUCE_B m - lag; the last `lag` reductions at the end.
    turn_index_.assign(static_cast<size_t>(in.microbatches) * 3, 0);
    auto add = [&](Kind k, int mb) {
      turn_index_[static_cast<size_t>(mb) * 3 + slot(k)] = order_.size();
      order_.emplace_back(-1, k, mb);
    };
    const int lag = training_ ? std::min(policy.lag, in.microbatches) : 0;
    for (int mb = 0; mb < in.microbatches; ++mb) {
      add(Kind::BCAST_F, mb);
      add(Kind::ALLREDUCE_S, mb);
      if (training_ && mb >= lag) add(Kind::REDUCE_B, mb - lag);
    }
    for (int mb = in.microbatches - lag; training_ && mb < in.microbatches; ++mb) add(Kind::REDUCE_B, mb);
    for (int r = 0; r < in.pp; ++r) {
      out_.ranks[r].clear();
      // Per microbatch: S, its three collectives and, training, T.
      out_.ranks[r].reserve(in.ranks[r].size() + static_cast<size_t>(in.microbatches) * (per_mb_ + 2));
    }
  }

  Program run() {
    double now = 0.0;
    for (;;) {
      poll_cancel();
      bool progress = false;
      for (int r = 0; r < in_.pp; ++r)
        if (clock_[r] <= now) progress = step_rank(r, now) || progress;
      if (progress) continue;
      if (finished()) break;
      while (!times_.empty() && times_.top() <= now) times_.pop();
      if (times_.empty()) stuck();
      now = times_.top();
    }
    return std::move(out_);
  }

 private:
  int total() const { return in_.microbatches; }
  static size_t slot(Kind k) { return k == Kind::BCAST_F ? 0 : k == Kind::ALLREDUCE_S ? 1 : 2; }
  // The position of a collective in the order every rank posts them (order_).
  size_t turn_of(Kind k, int mb) const { return turn_index_[static_cast<size_t>(mb) * 3 + slot(k)]; }
  const Action& collective_at(size_t turn) const { return order_[turn]; }
  bool completed(Kind k, int mb, double now) const {
    const double t = complete_[turn_of(k, mb)];
    return t != kUnset && t <= now;
  }

  // Whatever rank r can do at `now`; whether it did anything.
  bool step_rank(int r, double now) {
    bool moved = false;
    for (;;) {
      const bool passed = pass_comms(r, now);
      const bool posted = post_collectives(r, now);
      if (!passed && !posted) break;
      moved = true;
    }
    return start_compute(r, now) || moved;
  }

  // The SEND/RECV at the head of rank r's own list: a SEND goes out now, a RECV passes once its
  // SEND went out.
  bool pass_comms(int r, double now) {
    const auto& acts = in_.ranks[r];
    bool changed = false;
    while (next_[r] < acts.size() && is_comm(acts[next_[r]].kind)) {
      const Action& a = acts[next_[r]];
      if (a.kind == Kind::SEND_F || a.kind == Kind::SEND_B) {
        sent_.at(a.stage, a.kind, a.microbatch) = now;
      } else {
        const Action send = matching_send(a);
        const double t = sent_.at(send.stage, send.kind, send.microbatch);
        if (t == kUnset || t > now) break;
      }
      out_.ranks[r].push_back(a);
      ++next_[r];
      changed = true;
    }
    return changed;
  }

  // The collectives whose turn has come on rank r, while their input is there.
  bool post_collectives(int r, double now) {
    bool changed = false;
    while (turn_[r] < posts_.size()) {
      const Action c = collective_at(turn_[r]);
      const int mb = c.microbatch;
      bool ready = false;
      switch (c.kind) {
        case Kind::BCAST_F: {  // the root sends what the last stage's F produced
          const double t = end_.at(last_, Kind::F, mb);
          ready = r != root_ || (t != kUnset && t <= now);
          break;
        }
        case Kind::ALLREDUCE_S: ready = next_s_[r] > mb; break;  // its S ran (the rank is free)
        default: ready = completed(Kind::ALLREDUCE_S, mb, now); break;  // REDUCE_B rescales first
      }
      if (!ready) break;
      out_.ranks[r].emplace_back(r, c.kind, mb);
      const size_t k = turn_[r]++;
      latest_[k] = std::max(latest_[k], now);
      if (++posts_[k] == in_.pp) {
        complete_[k] = latest_[k] + vocab_.collective;
        times_.push(complete_[k]);
      }
      changed = true;
    }
    return changed;
  }

  // When compute `a` of the base program has all it needs on rank r (kUnset: not yet known).
  double ready_time(const Action& a) const {
    double t = 0.0;
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
      for (const Producer& d : producers_of(*s, in_.num_stages)) {
        double e = end_.of(d, s->microbatch);
        if (e == kUnset) return kUnset;
        if (d.data && in_.rank_of(d.stage) != in_.rank_of(s->stage)) e += comm_;
        t = std::max(t, e);
      }
      if (training_ && needs_vocab_grad(in_, *s)) {
        const double g = complete_[turn_of(Kind::REDUCE_B, s->microbatch)];
        if (g == kUnset) return kUnset;
        t = std::max(t, g);
      }
    }
    return t;
  }

  // One compute on rank r at `now`, by the priorities at the top of this file.
  bool start_compute(int r, double now) {
    const auto& acts = in_.ranks[r];
    const int s = next_s_[r], t = next_t_[r];
    const bool s_input = s < total() && completed(Kind::BCAST_F, s, now);
    const bool s_backlogged = training_ && s - t >= vocab_.backlog;
    const bool t_ready = training_ && t < s && completed(Kind::ALLREDUCE_S, t, now);
    bool base_ready = false;
    if (next_[r] < acts.size() && is_compute(acts[next_[r]].kind)) {
      const double ready = ready_time(acts[next_[r]]);
      base_ready = ready != kUnset && ready <= now;
    }
    const bool own_first = base_ready && (priority_ == VocabPriority::kOwnFirst ||
                                          (priority_ == VocabPriority::kBackwardFirst && acts[next_[r]].kind != Kind::F));
    if (own_first) {
      run_base(r, next_[r], now);
    } else if (s_input && !s_backlogged) {
      run_vocab(r, Kind::S, s, vocab_.s_time(r), now);
      ++next_s_[r];
    } else if (t_ready && (s_input || !base_ready)) {
      run_vocab(r, Kind::T, t, vocab_.t_time(r), now);
      ++next_t_[r];
    } else if (base_ready) {
      run_base(r, next_[r], now);
    } else if (const size_t k = forward_ahead(r, now); k < acts.size()) {
      run_base(r, k, now);
    } else {
      return false;
    }
    return true;
  }

  // The rank's first forward after its head that is ready now, while fewer than `lookahead`
  // ran ahead of the order (each holds one more microbatch's activations until its backward);
  // the forwards of one stage stay in order. acts.size(): none.
  size_t forward_ahead(int r, double now) const {
    const auto& acts = in_.ranks[r];
    if (ahead_[r] >= lookahead_) return acts.size();
    std::vector<int> blocked;  // stages with an earlier forward still to run
    for (size_t k = next_[r] + 1; k < acts.size(); ++k) {
      const Action& a = acts[k];
      if (taken_[r][k] || a.kind != Kind::F) continue;
      if (std::find(blocked.begin(), blocked.end(), a.stage) != blocked.end()) continue;
      const double ready = ready_time(a);
      if (ready != kUnset && ready <= now) return k;
      blocked.push_back(a.stage);
    }
    return acts.size();
  }

  void run_vocab(int r, Kind k, int mb, double duration, double now) {
    out_.ranks[r].emplace_back(r, k, mb);
    clock_[r] = now + duration;
    times_.push(clock_[r]);
  }

  // Runs base action `k` of rank r (its head, or a forward ahead of it).
  void run_base(int r, size_t k, double now) {
    const Action& a = in_.ranks[r][k];
    double duration = 0.0;
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
      duration += table_.of(*s).duration;
    const double finish = now + duration;
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
      end_.at(s->stage, s->kind, s->microbatch) = finish;
    out_.ranks[r].push_back(a);
    if (k == next_[r]) {
      ++next_[r];
      while (next_[r] < in_.ranks[r].size() && taken_[r][next_[r]]) {  // the head reaches what ran ahead
        ++next_[r];
        --ahead_[r];
      }
    } else {
      taken_[r][k] = 1;
      ++ahead_[r];
    }
    clock_[r] = finish;
    times_.push(finish);
    times_.push(finish + comm_);
  }

  bool finished() const {
    for (int r = 0; r < in_.pp; ++r)
      if (next_[r] < in_.ranks[r].size() || next_s_[r] < total() || (training_ && next_t_[r] < total()) ||
          turn_[r] < posts_.size())
        return false;
    return true;
  }

  [[noreturn]] void stuck() const {
    int r = 0;
    while (r + 1 < in_.pp && next_[r] >= in_.ranks[r].size()) ++r;
    const std::string head = next_[r] < in_.ranks[r].size() ? to_string(in_.ranks[r][next_[r]]) : "its vocabulary work";
    throw ScheduleError(detail::str(
        "vocabulary placement of '", in_.schedule, "' (pp=", in_.pp, ", microbatches=", in_.microbatches,
        ") found no way on: rank ", r, " waits at '", head, "' with S of microbatch ", next_s_[r],
        " and T of microbatch ", next_t_[r], " next (the placed part below)\n",
        format_program(out_, r, static_cast<int>(out_.ranks[r].size()) - 1)));
  }

  const Program& in_;
  const VocabModel& vocab_;
  const int lookahead_;
  const VocabPriority priority_;
  const StageTable table_;
  const double comm_;
  const bool training_;
  const int root_, last_, per_mb_;
  Program out_;
  ActionTable<double> end_;   // end time of every base compute part
  ActionTable<double> sent_;  // time each SEND went out
  std::vector<size_t> next_;  // next base action per rank
  std::vector<double> clock_;  // when each rank is free
  std::vector<int> next_s_, next_t_;  // next S / T microbatch per rank
  std::vector<std::vector<char>> taken_;  // per rank and base action: it ran ahead of the head
  std::vector<int> ahead_;                // per rank: forwards that ran ahead and the head has not reached
  std::vector<size_t> turn_;  // next collective (collective_at) per rank
  std::vector<Action> order_;        // the collectives in the order every rank posts them
  std::vector<size_t> turn_index_;   // (microbatch, kind) -> its position in order_
  std::vector<int> posts_;    // per collective turn: ranks that posted it
  std::vector<double> latest_, complete_;  // its latest post, its completion (kUnset: not yet)
  std::priority_queue<double, std::vector<double>, std::greater<double>> times_;
};

}  // namespace

Program reorder_for_vocab(const Program& compute_only, const CostModel& costs, const VocabModel& vocab,
                          const VocabPolicy& policy) {
  check_shape(compute_only);
  ZB_SCHEDULE_CHECK(!compute_only.has_comms() && !has_vocab(compute_only), "reorder_for_vocab expects a "
                    "compute-only program without vocabulary actions; '", compute_only.schedule, "' has them");
  costs.check(compute_only.num_stages, compute_only.microbatches, compute_only.pp);
  vocab.check(compute_only.pp);
  if (vocab.lookahead == 0) return compute_only;
  Program placed = VocabPlacement(compute_only, costs, vocab, vocab.lookahead, policy).run();
  for (auto& acts : placed.ranks) {  // the base program's actions in their new order
    std::vector<Action> kept;
    for (Action& a : acts)
      if (!is_vocab(a.kind)) kept.push_back(std::move(a));
    acts = std::move(kept);
  }
  return placed;
}

Program insert_vocab(const Program& lowered, const CostModel& costs, const VocabModel& vocab,
                     const VocabPolicy& policy) {
  check_shape(lowered);
  ZB_SCHEDULE_CHECK(lowered.has_comms() || lowered.pp == 1, "insert_vocab expects a lowered program (with "
                    "SEND/RECV); '", lowered.schedule, "' is compute-only");
  ZB_SCHEDULE_CHECK(!has_vocab(lowered), "'", lowered.schedule, "' already has vocabulary actions");
  costs.check(lowered.num_stages, lowered.microbatches, lowered.pp);
  vocab.check(lowered.pp);
  return VocabPlacement(lowered, costs, vocab, 0, policy).run();
}

Program place_vocab(const Program& compute_only, const CostModel& costs, const VocabModel& vocab,
                    const MemoryModel& memory) {
  // The policies tried, in order (ties go to the first): which pass a rank runs first when both
  // could, how far its forwards may run ahead, and how many broadcasts a reduction may lag.
  const VocabPriority priorities[] = {VocabPriority::kVocabFirst, VocabPriority::kBackwardFirst};
  std::vector<int> lookaheads = {0};
  if (vocab.lookahead > 0) lookaheads.push_back(vocab.lookahead);
  Program best;
  double best_makespan = 0.0;
  bool found = false;
  std::string last_error;
  for (int lag : {0, 1})
    for (int ahead : lookaheads)
      for (VocabPriority priority : priorities) {
        VocabModel model = vocab;
        model.lookahead = ahead;
        const VocabPolicy policy{priority, lag};
        Program placed;
        try {
          placed = insert_vocab(lower(reorder_for_vocab(compute_only, costs, model, policy)), costs, model, policy);
        } catch (const ScheduleError& e) {  // a lag the schedule's order cannot keep
          if (lag == 0) throw;
          last_error = e.what();
          continue;
        }
        const double makespan = simulate(placed, costs, memory, vocab, /*with_timeline=*/false).makespan;
        if (!found || makespan < best_makespan * (1 - 1e-12)) {
          best = std::move(placed);
          best_makespan = makespan;
          found = true;
        }
      }
  return best;
}

}  // namespace zbpipe
