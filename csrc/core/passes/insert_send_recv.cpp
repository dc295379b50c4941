// Lowering pass: adds SEND/RECV pairs to a compute-only program.
//
// Ranks are advanced in lock-step, one compute action per rank per sweep (as PyTorch's
// _add_send_recv does, so CSVs of both libraries agree). A compute is placed once its
// cross-rank input has been produced; placing a producer appends its SEND to its own rank and
// the RECV to the consumer's rank at that moment, so every RECV follows its SEND in one global
// order: a blocking-receive execution cannot deadlock and the per-pair order is FIFO. RECVs land
// as early as possible, which lets the runtime post them ahead of the compute that needs them.
#include "action_table.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"

namespace zbpipe {

using detail::ActionTable;

Program insert_send_recv(const Program& in) {
  Program out;
  out.schedule = in.schedule;
  out.pp = in.pp;
  out.num_stages = in.num_stages;
  out.microbatches = in.microbatches;
  out.stage_to_rank = in.stage_to_rank;
  out.ranks.resize(in.pp);
  for (int r = 0; r < in.pp; ++r) out.ranks[r].reserve(in.ranks[r].size() * 2);
  ActionTable<uint8_t> done(in.num_stages, in.microbatches, 0);

  // The data a compute consumes must exist (its producers_of); what the stage keeps itself (its
  // own F before its backward) is the builder's local order, checked by validate.
  auto input_ready = [&](const Action& part) {
    for (const Producer& d : producers_of(part, in.num_stages))
      if (d.data && !done.met(d, part.microbatch)) return false;
    return true;
  };

  std::vector<size_t> next(in.pp, 0);
  size_t remaining = 0;
  for (const auto& acts : in.ranks) remaining += acts.size();
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < in.pp; ++r) {
      if (next[r] >= in.ranks[r].size()) continue;
      const Action& a = in.ranks[r][next[r]];
      ZB_SCHEDULE_CHECK(is_compute(a.kind), "insert_send_recv expects compute-only input, got '",
                        to_string(a), "' on rank ", r);
      bool ready = true;
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        ZB_SCHEDULE_CHECK(done.in_range(s->stage, s->microbatch), "action '", to_string(*s),
                          "' on rank ", r, " is out of range (stages=", in.num_stages,
                          ", microbatches=", in.microbatches, ")");
        ready = ready && input_ready(*s);
      }
      if (!ready) continue;
      out.ranks[r].push_back(a);
      // Forward parts first: an OVERLAP_F_B unit's SEND_F comes right after it, where the
      // runtime posts it as soon as the F half finishes (see comm_batches).
      for (int forward_pass = 1; forward_pass >= 0; --forward_pass)
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        if ((s->kind == Kind::F) != (forward_pass == 1)) continue;
        done.at(s->stage, s->kind, s->microbatch) = 1;
        const int to = data_consumer(*s, in.num_stages);
        if (to < 0 || in.rank_of(to) == r) continue;
        const bool fwd = s->kind == Kind::F;
        out.ranks[r].emplace_back(s->stage, fwd ? Kind::SEND_F : Kind::SEND_B, s->microbatch);
        out.ranks[in.rank_of(to)].emplace_back(to, fwd ? Kind::RECV_F : Kind::RECV_B, s->microbatch);
      }
      ++next[r];
      --remaining;
      progress = true;
    }
    if (!progress) {
      int r = 0;
      while (next[r] >= in.ranks[r].size()) ++r;
      throw ScheduleError(detail::str(
          "schedule '", in.schedule, "' cannot be lowered: no rank can make progress (rank ", r,
          " waits on the input of '", to_string(in.ranks[r][next[r]]), "')\n",
          format_program(in, r, static_cast<int>(next[r]))));
    }
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
