// Validation pass: structure, exactly-once compute, local ordering, SEND/RECV matching and a
// blocking-receive execution. Every failure names the rule and shows the marked grid.
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "action_table.h"
#include "zbpipe/cancel.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"

namespace zbpipe {

using detail::ActionTable;

namespace {

[[noreturn]] void fail(const Program& p, int rank, int index, const std::string& why) {
  throw ScheduleError(detail::str("invalid program '", p.schedule, "' (pp=", p.pp, ", stages=",
                                  p.num_stages, ", microbatches=", p.microbatches, "): ", why,
                                  "\n", format_program(p, rank, index)));
}

}  // namespace

void check_shape(const Program& p) {
  ZB_SCHEDULE_CHECK(p.pp >= 1 && p.num_stages >= 1 && p.microbatches >= 1, "invalid program '",
                    p.schedule, "': pp=", p.pp, ", stages=", p.num_stages,
                    ", microbatches=", p.microbatches, " must all be >= 1");
  ZB_SCHEDULE_CHECK(static_cast<int>(p.ranks.size()) == p.pp, "invalid program '", p.schedule,
                    "': ", p.ranks.size(), " rank action lists for pp=", p.pp);
  ZB_SCHEDULE_CHECK(static_cast<int>(p.stage_to_rank.size()) == p.num_stages, "invalid program '",
                    p.schedule, "': stage_to_rank has ", p.stage_to_rank.size(),
                    " entries for ", p.num_stages, " stages");
  for (int s = 0; s < p.num_stages; ++s)
    ZB_SCHEDULE_CHECK(p.stage_to_rank[s] >= 0 && p.stage_to_rank[s] < p.pp, "invalid program '",
                      p.schedule, "': stage ", s, " maps to rank ", p.stage_to_rank[s],
                      " outside [0, ", p.pp, ")");
}

namespace {

// Whether the comm action has a neighbour stage that exists and lives on another rank.
bool comm_is_legal(const Program& p, const Action& a) {
  const int other = comm_peer_stage(a);
  return other >= 0 && other < p.num_stages && p.rank_of(other) != p.rank_of(a.stage);
}

// The message a comm action carries, named by its sender: (sender stage, is_grad, mb).
struct Message {
  int stage, grad, mb;
  bool operator==(const Message& o) const { return stage == o.stage && grad == o.grad && mb == o.mb; }
};
Message message_of(const Action& a) {
  const Producer d = comm_payload(a);
  return {d.stage, d.either_backward() ? 1 : 0, a.microbatch};
}

// How messages name a compute and what it needs.
const char* role_name(Kind k) { return k == Kind::F ? "F" : k == Kind::W ? "W" : "backward"; }
std::string producer_name(const Producer& d) {
  if (!d.data) return detail::str("its ", kind_name(d.kind));
  return d.either_backward() ? detail::str("the backward of stage ", d.stage)
                             : detail::str(kind_name(d.kind), " of stage ", d.stage);
}

}  // namespace

void validate(const Program& p) {
  check_shape(p);
  // Position (1-based, 0 = absent) of each compute / comm action on its rank.
  ActionTable<int32_t> pos(p.num_stages, p.microbatches, 0);
  const bool comms = p.has_comms();
  // A program with no backward action at all is an inference program: F once per (stage, mb).
  bool forward_only = true;
  for (const auto& acts : p.ranks)
    for (const Action& a : acts)
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
        if (s->kind == Kind::B || s->kind == Kind::I || s->kind == Kind::W) forward_only = false;

  // 1. Placement, ranges, exactly-once.
  for (int r = 0; r < p.pp; ++r) {
    const auto& acts = p.ranks[r];
    for (int i = 0; i < static_cast<int>(acts.size()); ++i) {
      poll_cancel();
      const Action& a = acts[i];
      if (a.kind == Kind::OVERLAP_F_B && a.sub.empty()) fail(p, r, i, "OVERLAP_F_B without sub-actions");
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        if (!pos.in_range(s->stage, s->microbatch))
          fail(p, r, i, detail::str("'", to_string(*s), "' is out of range"));
        if (p.rank_of(s->stage) != r)
          fail(p, r, i, detail::str("'", to_string(*s), "' runs on rank ", r, " but stage ",
                                    s->stage, " lives on rank ", p.rank_of(s->stage)));
        if (is_comm(s->kind) && !comm_is_legal(p, *s))
          fail(p, r, i, detail::str("'", to_string(*s),
                                    "' has no cross-rank peer (no communication is needed there)"));
        int32_t& slot = pos.at(s->stage, s->kind, s->microbatch);
        if (slot != 0) fail(p, r, i, detail::str("'", to_string(*s), "' appears twice"));
        slot = i + 1;
      }
    }
  }
  for (int s = 0; s < p.num_stages; ++s) {
    const int r = p.rank_of(s);
    for (int mb = 0; mb < p.microbatches; ++mb) {
      poll_cancel();
      auto id = [&] { return detail::str("stage ", s, " microbatch ", mb); };
      if (!pos.at(s, Kind::F, mb)) fail(p, r, -1, id() + " never runs F");
      bool full = pos.at(s, Kind::B, mb), in = pos.at(s, Kind::I, mb), wt = pos.at(s, Kind::W, mb);
      if (forward_only) continue;
      if (full && (in || wt)) fail(p, r, -1, id() + " runs both B and I/W");
      if (!full && !(in && wt))
        fail(p, r, -1, id() + " needs B, or I and W (has I=" + std::to_string(in) + ", W=" +
                           std::to_string(wt) + ")");
    }
  }

  // 2. Local order on each rank, from producers_of: a producer on the same rank runs before its
  // consumer; one on another rank is received before it; a result another rank consumes is
  // sent after it.
  for (int s = 0; s < p.num_stages; ++s) {
    const int r = p.rank_of(s);
    for (int mb = 0; mb < p.microbatches; ++mb) {
      poll_cancel();
      for (Kind k : {Kind::F, Kind::B, Kind::I, Kind::W}) {
        const int c = pos.at(s, k, mb);
        if (!c || (forward_only && k != Kind::F)) continue;
        const Action part(s, k, mb);
        const bool fwd = k == Kind::F;
        for (const Producer& d : producers_of(part, p.num_stages)) {
          if (p.rank_of(d.stage) == r) {
            if (pos.of(d, mb) >= c)
              fail(p, r, c - 1, detail::str(role_name(k), " of stage ", s, " mb ", mb, " before ",
                                            producer_name(d)));
          } else if (comms) {
            const int rv = pos.at(s, fwd ? Kind::RECV_F : Kind::RECV_B, mb);
            if (!rv || rv > c)
              fail(p, r, c - 1, detail::str(role_name(k), " of stage ", s, " mb ", mb, " has no ",
                                            fwd ? "RECV_F" : "RECV_B", " before it"));
          }
        }
        const int to = data_consumer(part, p.num_stages);
        if (comms && to >= 0 && p.rank_of(to) != r) {
          const int sd = pos.at(s, fwd ? Kind::SEND_F : Kind::SEND_B, mb);
          if (!sd || sd < c)
            fail(p, r, c - 1, detail::str(role_name(k), " of stage ", s, " mb ", mb, " has no ",
                                          fwd ? "SEND_F" : "SEND_B", " after it"));
        }
      }
    }
  }
  if (comms) {
    // 3. Per ordered rank pair, sends and receives carry the same messages in the same order.
    // Keyed by (src * pp + dst) in a map: only the pairs that talk get an entry, so memory
    // follows the actions, not pp^2. Counts already match one-to-one (step 2), so equal
    // sequences reduce to comparing element by element.
    struct PairQueue {
      std::vector<Message> sends;
      size_t matched = 0;
    };
    std::unordered_map<uint64_t, PairQueue> pairs;
    auto pair_key = [&](int src, int dst) { return static_cast<uint64_t>(src) * p.pp + dst; };
    for (int r = 0; r < p.pp; ++r)
      for (const Action& a : p.ranks[r])
        if (a.kind == Kind::SEND_F || a.kind == Kind::SEND_B)
          pairs[pair_key(r, p.rank_of(comm_peer_stage(a)))].sends.push_back(message_of(a));
    for (int r = 0; r < p.pp; ++r) {
      const auto& acts = p.ranks[r];
      for (int i = 0; i < static_cast<int>(acts.size()); ++i) {
        const Action& a = acts[i];
        poll_cancel();
        if (a.kind != Kind::RECV_F && a.kind != Kind::RECV_B) continue;
        const int src = p.rank_of(comm_peer_stage(a));
        PairQueue& q = pairs[pair_key(src, r)];
        size_t& k = q.matched;
        if (k >= q.sends.size() || !(q.sends[k] == message_of(a)))
          fail(p, r, i, detail::str("receive #", k, " on rank ", r, " from rank ", src,
                                    " does not match the send in that order"));
        ++k;
      }
    }
  }

  // 4. Blocking-receive execution: a RECV waits for its SEND, a compute for its inputs.
  ActionTable<uint8_t> done(p.num_stages, p.microbatches, 0);
  auto ready = [&](const Action& a) {
    if (a.kind == Kind::RECV_F || a.kind == Kind::RECV_B) {
      const Action send = matching_send(a);
      return done.at(send.stage, send.kind, send.microbatch) != 0;
    }
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
      for (const Producer& d : producers_of(*s, p.num_stages))
        if (!done.met(d, s->microbatch)) return false;
    return true;
  };
  // Ranks run as far as they can; one that stops is run again once an action it may wait on
  // ends: a SEND wakes its RECV's rank, a compute the rank that consumes its data (what a
  // compute needs on its own rank is behind it in the same list). The ranks left unfinished
  // are those of every order (the run is monotone), in O(actions) instead of O(pp x rounds).
  std::vector<size_t> next(p.pp, 0);
  std::vector<int> queue;
  std::vector<char> queued(p.pp, 1);
  for (int r = p.pp - 1; r >= 0; --r) queue.push_back(r);
  auto wake = [&](int rank) {
    if (!queued[rank]) {
      queued[rank] = 1;
      queue.push_back(rank);
    }
  };
  while (!queue.empty()) {
    const int r = queue.back();
    queue.pop_back();
    queued[r] = 0;
    const auto& acts = p.ranks[r];
    while (next[r] < acts.size() && ready(acts[next[r]])) {
      poll_cancel();
      const Action& a = acts[next[r]];
      if (a.kind == Kind::SEND_F || a.kind == Kind::SEND_B) wake(p.rank_of(comm_peer_stage(a)));
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        done.at(s->stage, s->kind, s->microbatch) = 1;
        const int to = data_consumer(*s, p.num_stages);
        if (to >= 0) wake(p.rank_of(to));
      }
      ++next[r];
    }
  }
  for (int r = 0; r < p.pp; ++r)
    if (next[r] < p.ranks[r].size())
      fail(p, r, static_cast<int>(next[r]),
           detail::str("deadlock: rank ", r, " blocks forever on '", to_string(p.ranks[r][next[r]]),
                       "' in a blocking-receive run"));
}

}  // namespace zbpipe
