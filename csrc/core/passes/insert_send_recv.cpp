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

Program insert_send_recv(const Program& in) {
  check_shape(in);
  Program out;
  out.schedule = in.schedule;
  out.pp = in.pp;
  out.num_stages = in.num_stages;
  out.microbatches = in.microbatches;
  out.stage_to_rank = in.stage_to_rank;
  out.ranks.resize(in.pp);
  // Exact sizes up front: each compute whose result crosses ranks adds a SEND on its rank and a
  // RECV on the consumer's. (Growing by doubling would hold up to twice the program.)
  std::vector<size_t> sizes(in.pp);
  for (int r = 0; r < in.pp; ++r) {
    sizes[r] += in.ranks[r].size();
    for (const Action& a : in.ranks[r])
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        const int to = data_consumer(*s, in.num_stages);
        if (to < 0 || to >= in.num_stages || in.rank_of(to) == r) continue;
        ++sizes[r];
        ++sizes[in.rank_of(to)];
      }
  }
  for (int r = 0; r < in.pp; ++r) out.ranks[r].reserve(sizes[r]);
  ActionTable<uint8_t> done(in.num_stages, in.microbatches, 0);

  // The data a compute consumes must exist (its producers_of); what the stage keeps itself (its
  // own F before its backward) is the builder's local order, checked by validate.
  // Returns the first missing producer's table key (F, or B standing for "B or I"), or none.
  struct Missing {
    bool any = false;
    int32_t stage = -1, mb = -1;
    Kind kind = Kind::F;
  };
  auto missing_input = [&](const Action& part) -> Missing {
    for (const Producer& d : producers_of(part, in.num_stages))
      if (d.data && !done.met(d, part.microbatch))
        return {true, d.stage, part.microbatch, d.either_backward() ? Kind::B : Kind::F};
    return {};
  };

  // The lock-step sweeps, replayed in the same order without visiting idle ranks: an attempt
  // is the event (sweep, rank); a rank whose input is missing waits on it (one list per
  // producer) and, once it is placed at (k, r'), retries at (k, rank) if rank > r' (later in
  // that very sweep), else at (k + 1, rank). Time O(actions log pp) instead of O(pp x sweeps).
  using Attempt = std::pair<int64_t, int>;  // (sweep, rank)
  std::priority_queue<Attempt, std::vector<Attempt>, std::greater<Attempt>> attempts;
  ActionTable<int32_t> waiting(in.num_stages, in.microbatches, -1);  // first waiting rank
  std::vector<int32_t> next_waiting(in.pp, -1);                       // the list's next rank
  auto wake = [&](int32_t stage, Kind key, int32_t mb, int64_t sweep, int placed_by) {
    int32_t& head = waiting.at(stage, key, mb);
    for (int32_t w = head; w >= 0; w = next_waiting[w])
      attempts.push({w > placed_by ? sweep : sweep + 1, w});
    head = -1;
  };

  std::vector<size_t> next(in.pp, 0);
  size_t remaining = 0;
  for (int r = 0; r < in.pp; ++r) {
    remaining += in.ranks[r].size();
    if (!in.ranks[r].empty()) attempts.push({0, r});
  }
  while (!attempts.empty()) {
    poll_cancel();
    const auto [sweep, r] = attempts.top();
    attempts.pop();
    const Action& a = in.ranks[r][next[r]];
    ZB_SCHEDULE_CHECK(is_compute(a.kind), "insert_send_recv expects compute-only input, got '",
                      to_string(a), "' on rank ", r);
    ZB_SCHEDULE_CHECK(!is_vocab(a.kind), "insert_send_recv lowers programs without vocabulary actions, got '",
                      to_string(a), "' on rank ", r, " (they are placed after lowering: insert_vocab, "
                      "or compile(..., vocab_parallel=True))");
    Missing missing;
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
      ZB_SCHEDULE_CHECK(done.in_range(s->stage, s->microbatch), "action '", to_string(*s),
                        "' on rank ", r, " is out of range (stages=", in.num_stages,
                        ", microbatches=", in.microbatches, ")");
      if (!missing.any) missing = missing_input(*s);
    }
    if (missing.any) {
      int32_t& head = waiting.at(missing.stage, missing.kind, missing.mb);
      next_waiting[r] = head;
      head = r;
      continue;
    }
    out.ranks[r].push_back(a);
    // Forward parts first: an OVERLAP_F_B unit's SEND_F comes right after it, where the
    // runtime posts it as soon as the F half finishes (see comm_batches).
    for (int forward_pass = 1; forward_pass >= 0; --forward_pass)
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
      if ((s->kind == Kind::F) != (forward_pass == 1)) continue;
      done.at(s->stage, s->kind, s->microbatch) = 1;
      wake(s->stage, s->kind == Kind::F ? Kind::F : Kind::B, s->microbatch, sweep, r);
      const int to = data_consumer(*s, in.num_stages);
      if (to < 0 || in.rank_of(to) == r) continue;
      const bool fwd = s->kind == Kind::F;
      out.ranks[r].emplace_back(s->stage, fwd ? Kind::SEND_F : Kind::SEND_B, s->microbatch);
      out.ranks[in.rank_of(to)].emplace_back(to, fwd ? Kind::RECV_F : Kind::RECV_B, s->microbatch);
    }
    --remaining;
    if (++next[r] < in.ranks[r].size()) attempts.push({sweep + 1, r});
  }
  if (remaining > 0) {
    int r = 0;
    while (next[r] >= in.ranks[r].size()) ++r;
    throw ScheduleError(detail::str(
        "schedule '", in.schedule, "' cannot be lowered: no rank can make progress (rank ", r,
        " waits on the input of '", to_string(in.ranks[r][next[r]]), "')\n",
        format_program(in, r, static_cast<int>(next[r]))));
  }
  return out;
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
