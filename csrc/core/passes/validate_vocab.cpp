// validate()'s checks of a program's vocabulary actions (vocab.h): presence, local order and
// one collective order on every rank. The blocking run (validate.cpp) checks that they finish.
#include <initializer_list>
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

// Each rank runs each vocabulary action of `always` (and, training, of `training`) once per
// microbatch, none of `training` in a forward-only program.
void check_present(const Program& p, const ActionTable<int32_t>& pos, bool forward_only,
                   std::initializer_list<Kind> always, std::initializer_list<Kind> training) {
  for (int r = 0; r < p.pp; ++r)
    for (int mb = 0; mb < p.microbatches; ++mb) {
      poll_cancel();
      for (Kind k : always)
        if (!pos.at(r, k, mb))
          fail(p, r, -1, detail::str("rank ", r, " never runs '", to_string(Action(r, k, mb)), "' (vocabulary shard ", r, ")"));
      for (Kind k : training) {
        const int at = pos.at(r, k, mb);
        if (!forward_only && !at)
          fail(p, r, -1, detail::str("rank ", r, " never runs '", to_string(Action(r, k, mb)), "' (vocabulary shard ", r, ")"));
        if (forward_only && at)
          fail(p, r, at - 1, detail::str("'", to_string(Action(r, k, mb)), "' in a program without backward"));
      }
    }
}

// On rank r, `first` of mb (when both are there) comes before `then`.
void check_before(const Program& p, const ActionTable<int32_t>& pos, int r, int mb, Kind first, Kind then) {
  const int a = pos.at(r, first, mb), b = pos.at(r, then, mb);
  if (a && b && a > b)
    fail(p, r, b - 1, detail::str("'", to_string(Action(r, then, mb)), "' before '", to_string(Action(r, first, mb)), "'"));
}

void check_head(const Program& p, const ActionTable<int32_t>& pos, bool forward_only) {
  const int root = vocab_root(p), last = p.num_stages - 1;
  check_present(p, pos, forward_only, {Kind::BCAST_F, Kind::S, Kind::ALLREDUCE_S}, {Kind::REDUCE_B, Kind::T});
  for (int r = 0; r < p.pp; ++r) {
    for (int mb = 0; mb < p.microbatches; ++mb) {
      poll_cancel();
      auto at = [&](Kind k) { return pos.at(r, k, mb); };
      auto name = [&](Kind k) { return to_string(Action(r, k, mb)); };
      // Local order: what each action needs on its own rank comes before it.
      check_before(p, pos, r, mb, Kind::BCAST_F, Kind::S);
      check_before(p, pos, r, mb, Kind::S, Kind::ALLREDUCE_S);
      check_before(p, pos, r, mb, Kind::ALLREDUCE_S, Kind::REDUCE_B);
      check_before(p, pos, r, mb, Kind::ALLREDUCE_S, Kind::T);
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
}

void check_embedding(const Program& p, const ActionTable<int32_t>& pos, bool forward_only) {
  const int root = embedding_root(p);
  check_present(p, pos, forward_only, {Kind::E, Kind::REDUCE_E}, {Kind::BCAST_E, Kind::EW});
  for (int r = 0; r < p.pp; ++r) {
    for (int mb = 0; mb < p.microbatches; ++mb) {
      poll_cancel();
      auto at = [&](Kind k) { return pos.at(r, k, mb); };
      auto name = [&](Kind k) { return to_string(Action(r, k, mb)); };
      check_before(p, pos, r, mb, Kind::E, Kind::REDUCE_E);
      check_before(p, pos, r, mb, Kind::BCAST_E, Kind::EW);
      if (r != root) continue;
      const int f = pos.at(0, Kind::F, mb);
      if (f && f < at(Kind::REDUCE_E))
        fail(p, r, f - 1, detail::str("'", to_string(Action(0, Kind::F, mb)), "' takes the embedding output '",
                                      name(Kind::REDUCE_E), "' reduces, which comes after it"));
      if (forward_only) continue;
      const int bw = pos.at(0, Kind::B, mb) ? pos.at(0, Kind::B, mb) : pos.at(0, Kind::I, mb);
      if (bw && bw > at(Kind::BCAST_E))
        fail(p, r, at(Kind::BCAST_E) - 1,
             detail::str("'", name(Kind::BCAST_E), "' broadcasts the input gradient of stage 0 microbatch ", mb,
                         ", whose backward runs after it"));
    }
  }
}

}  // namespace

void check_vocab(const Program& p, const ActionTable<int32_t>& pos, bool forward_only) {
  const VocabParts parts = vocab_parts(p);
  if (!parts.head && !parts.embedding) return;
  ZB_SCHEDULE_CHECK(p.num_stages >= p.pp, "invalid program '", p.schedule, "': vocabulary parallelism needs a "
                    "stage on every rank (pp=", p.pp, ", stages=", p.num_stages, ")");
  if (parts.head) check_head(p, pos, forward_only);
  if (parts.embedding) check_embedding(p, pos, forward_only);
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
