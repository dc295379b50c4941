// validate()'s checks of a program's vocabulary actions (vocab.h): presence, local order and
// one collective order on every rank. The blocking run (validate.cpp) checks that they finish.
#include <string>

#include "vocab_rules.h"
#include "zbpipe/cancel.h"
#include "zbpipe/error.h"

namespace zbpipe::detail {

namespace {

[[noreturn]] void fail(const Program& p, int rank, int index, const std::string& why) {
  throw ScheduleError(detail::str("invalid program '", p.schedule, "' (pp=", p.pp, ", stages=", p.num_stages,
                                  ", microbatches=", p.microbatches, "): ", why, "\n",
                                  format_program(p, rank, index)));
}

// The rank's collectives in program order.
std::vector<Action> collectives_of(const std::vector<Action>& acts) {
  std::vector<Action> out;
  for (const Action& a : acts)
    if (is_collective(a.kind)) out.push_back(a);
  return out;
}

}  // namespace

void check_vocab(const Program& p, const ActionTable<int32_t>& pos, bool forward_only) {
  if (!has_vocab(p)) return;
  ZB_SCHEDULE_CHECK(p.num_stages >= p.pp, "invalid program '", p.schedule, "': vocabulary parallelism needs a "
                    "stage on every rank (pp=", p.pp, ", stages=", p.num_stages, ")");
  const int root = vocab_root(p), last = p.num_stages - 1;
  const Kind always[] = {Kind::BCAST_F, Kind::S, Kind::ALLREDUCE_S};
  const Kind training[] = {Kind::REDUCE_B, Kind::T};
  for (int r = 0; r < p.pp; ++r) {
    for (int mb = 0; mb < p.microbatches; ++mb) {
      poll_cancel();
      auto at = [&](Kind k) { return pos.at(r, k, mb); };
      auto name = [&](Kind k) { return to_string(Action(r, k, mb)); };
      for (Kind k : always)
        if (!at(k)) fail(p, r, -1, detail::str("rank ", r, " never runs '", name(k), "' (vocabulary shard ", r, ")"));
      for (Kind k : training) {
        if (!forward_only && !at(k))
          fail(p, r, -1, detail::str("rank ", r, " never runs '", name(k), "' (vocabulary shard ", r, ")"));
        if (forward_only && at(k))
          fail(p, r, at(k) - 1, detail::str("'", name(k), "' in a program without backward"));
      }
      // Local order: what each action needs on its own rank comes before it.
      auto before = [&](Kind first, Kind then) {
        if (at(first) && at(then) && at(first) > at(then))
          fail(p, r, at(then) - 1, detail::str("'", name(then), "' before '", name(first), "'"));
      };
      before(Kind::BCAST_F, Kind::S);
      before(Kind::S, Kind::ALLREDUCE_S);
      before(Kind::ALLREDUCE_S, Kind::REDUCE_B);
      before(Kind::ALLREDUCE_S, Kind::T);
      if (r != root) continue;
      const int f = pos.at(last, Kind::F, mb);
      if (f && f > at(Kind::BCAST_F))
        fail(p, r, at(Kind::BCAST_F) - 1,
             detail::str("'", name(Kind::BCAST_F), "' broadcasts the output of '", to_string(Action(last, Kind::F, mb)),
                         "', which runs after it"));
      if (forward_only) continue;
      const int bw = pos.at(last, Kind::B, mb) ? pos.at(last, Kind::B, mb) : pos.at(last, Kind::I, mb);
      if (bw && bw < at(Kind::REDUCE_B))
        fail(p, r, bw - 1, detail::str("the backward of stage ", last, " microbatch ", mb,
                                       " starts from the gradient '", name(Kind::REDUCE_B), "' reduces, which comes after it"));
    }
  }
  // One order of collectives on every rank: a process group matches them by their order.
  const std::vector<Action> first = collectives_of(p.ranks[0]);
  for (int r = 1; r < p.pp; ++r) {
    const std::vector<Action> mine = collectives_of(p.ranks[r]);
    for (size_t k = 0; k < first.size() && k < mine.size(); ++k) {
      if (first[k].kind == mine[k].kind && first[k].microbatch == mine[k].microbatch) continue;
      const int index = pos.at(r, mine[k].kind, mine[k].microbatch) - 1;
      fail(p, r, index, detail::str("collective #", k, " of rank ", r, " is '", to_string(mine[k]), "' but rank 0's is '",
                                    to_string(first[k]), "': every rank posts the collectives in the same order"));
    }
  }
}

}  // namespace zbpipe::detail
