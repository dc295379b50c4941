// Lowering pass: adds SEND/RECV pairs to a compute-only program.
//
// Ranks are advanced in lock-step, one compute action per rank per sweep (as PyTorch's
// _add_send_recv does, so CSVs of both libraries agree). A compute is placed once its
// cross-rank input has been produced; placing a producer appends its SEND to its own rank and
// the RECV to the consumer's rank at that moment, so every RECV follows its SEND in one global
// order: a blocking-receive execution cannot deadlock and the per-pair order is FIFO. RECVs land
// as early as possible, which lets the runtime post them ahead of the compute that needs them.
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

#include "action_table.h"
#include "zbpipe/cancel.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"

namespace zbpipe {

using detail::ActionTable;

namespace {

// The table key of a compute's first missing producer (F, or B standing for "B or I").
struct Missing {
  bool any = false;
  int32_t stage = -1, mb = -1;
  Kind kind = Kind::F;
};

// One lowering of `in`: the lock-step sweeps, replayed in the same order without visiting idle
// ranks. An attempt is the event (sweep, rank); a rank whose input is missing waits on it (one
// list per producer) and, once it is placed at (k, r'), retries at (k, rank) if rank > r'
// (later in that very sweep), else at (k + 1, rank). Time O(actions log pp) instead of
// O(pp x sweeps).
class Lowering {
 public:
  explicit Lowering(const Program& in)
      : in_(in), done_(in.num_stages, in.microbatches, 0), waiting_(in.num_stages, in.microbatches, -1),
        next_waiting_(in.pp, -1), next_(in.pp, 0) {
    out_.schedule = in.schedule;
    out_.pp = in.pp;
    out_.num_stages = in.num_stages;
    out_.microbatches = in.microbatches;
    out_.stage_to_rank = in.stage_to_rank;
    reserve_exact();
  }

  Program run() {
    size_t remaining = 0;
    for (int r = 0; r < in_.pp; ++r) {
      remaining += in_.ranks[r].size();
      if (!in_.ranks[r].empty()) attempts_.push({0, r});
    }
    while (!attempts_.empty()) {
      poll_cancel();
      const auto [sweep, r] = attempts_.top();
      attempts_.pop();
      const Action& a = in_.ranks[r][next_[r]];
      if (const Missing missing = missing_input(a, r); missing.any) {
        wait_on(missing, r);
        continue;
      }
      place(a, r, sweep);
      --remaining;
      if (++next_[r] < in_.ranks[r].size()) attempts_.push({sweep + 1, r});
    }
    if (remaining > 0) fail_stuck();
    return std::move(out_);
  }

 private:
  using Attempt = std::pair<int64_t, int>;  // (sweep, rank)

  // Exact sizes up front: each compute whose result crosses ranks adds a SEND on its rank and a
  // RECV on the consumer's. (Growing by doubling would hold up to twice the program.)
  void reserve_exact() {
    out_.ranks.resize(in_.pp);
    std::vector<size_t> sizes(in_.pp);
    for (int r = 0; r < in_.pp; ++r) {
      sizes[r] += in_.ranks[r].size();
      for (const Action& a : in_.ranks[r])
        for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
          const int to = data_consumer(*s, in_.num_stages);
          if (to < 0 || to >= in_.num_stages || in_.rank_of(to) == r) continue;
          ++sizes[r];
          ++sizes[in_.rank_of(to)];
        }
    }
    for (int r = 0; r < in_.pp; ++r) out_.ranks[r].reserve(sizes[r]);
  }

  // The data a compute (each of its parts) consumes must exist (its producers_of); what the
  // stage keeps itself (its own F before its backward) is the builder's local order, checked by
  // validate. Also checks that the action is a compute in range.
  Missing missing_input(const Action& a, int r) const {
    ZB_SCHEDULE_CHECK(is_compute(a.kind), "insert_send_recv expects compute-only input, got '",
                      to_string(a), "' on rank ", r);
    ZB_SCHEDULE_CHECK(!is_vocab(a.kind), "insert_send_recv lowers programs without vocabulary actions, got '",
                      to_string(a), "' on rank ", r, " (they are placed after lowering: insert_vocab, "
                      "or compile(..., vocab_parallel=True))");
    Missing missing;
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
      ZB_SCHEDULE_CHECK(done_.in_range(s->stage, s->microbatch), "action '", to_string(*s),
                        "' on rank ", r, " is out of range (stages=", in_.num_stages,
                        ", microbatches=", in_.microbatches, ")");
      if (missing.any) continue;
      for (const Producer& d : producers_of(*s, in_.num_stages))
        if (d.data && !done_.met(d, s->microbatch)) {
          missing = {true, d.stage, s->microbatch, d.either_backward() ? Kind::B : Kind::F};
          break;
        }
    }
    return missing;
  }

  // Rank r waits on the missing producer: the head of its list.
  void wait_on(const Missing& m, int r) {
    int32_t& head = waiting_.at(m.stage, m.kind, m.mb);
    next_waiting_[r] = head;
    head = r;
  }

  // Places compute `a` on rank r, then per part its SEND here and RECV at the consumer's rank.
  // Forward parts first: an OVERLAP_F_B unit's SEND_F comes right after it, where the runtime
  // posts it as soon as the F half finishes (see comm_batches).
  void place(const Action& a, int r, int64_t sweep) {
    out_.ranks[r].push_back(a);
    for (int forward_pass = 1; forward_pass >= 0; --forward_pass)
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        if ((s->kind == Kind::F) != (forward_pass == 1)) continue;
        done_.at(s->stage, s->kind, s->microbatch) = 1;
        wake(s->stage, s->kind == Kind::F ? Kind::F : Kind::B, s->microbatch, sweep, r);
        const int to = data_consumer(*s, in_.num_stages);
        if (to < 0 || in_.rank_of(to) == r) continue;
        const bool fwd = s->kind == Kind::F;
        out_.ranks[r].emplace_back(s->stage, fwd ? Kind::SEND_F : Kind::SEND_B, s->microbatch);
        out_.ranks[in_.rank_of(to)].emplace_back(to, fwd ? Kind::RECV_F : Kind::RECV_B, s->microbatch);
      }
  }

  // The ranks waiting on (stage, key, mb), placed now by rank `placed_by` in `sweep`, retry.
  void wake(int32_t stage, Kind key, int32_t mb, int64_t sweep, int placed_by) {
    int32_t& head = waiting_.at(stage, key, mb);
    for (int32_t w = head; w >= 0; w = next_waiting_[w]) attempts_.push({w > placed_by ? sweep : sweep + 1, w});
    head = -1;
  }

  [[noreturn]] void fail_stuck() const {
    int r = 0;
    while (next_[r] >= in_.ranks[r].size()) ++r;
    throw ScheduleError(detail::str(
        "schedule '", in_.schedule, "' cannot be lowered: no rank can make progress (rank ", r,
        " waits on the input of '", to_string(in_.ranks[r][next_[r]]), "')\n",
        format_program(in_, r, static_cast<int>(next_[r]))));
  }

  const Program& in_;
  Program out_;
  ActionTable<uint8_t> done_;      // computes placed, per (stage, kind, microbatch)
  ActionTable<int32_t> waiting_;   // the first rank waiting on each, -1: none
  std::vector<int32_t> next_waiting_;  // per rank: the next rank of the list it waits in
  std::priority_queue<Attempt, std::vector<Attempt>, std::greater<Attempt>> attempts_;
  std::vector<size_t> next_;       // per rank: its next action to place
};

}  // namespace

Program insert_send_recv(const Program& in) {
  check_shape(in);
  return Lowering(in).run();
}

Program strip_comms(const Program& p) {
  Program out = p;
  for (auto& acts : out.ranks) {
    std::vector<Action> kept;
    kept.reserve(acts.size());
    for (auto& a : acts)
      if (is_compute(a.kind)) kept.push_back(std::move(a));
    acts = std::move(kept);
  }
  return out;
}

}  // namespace zbpipe
