// Validation pass: structure, exactly-once compute, local ordering, SEND/RECV matching and a
// blocking-receive execution. Every failure names the rule and shows the marked grid.
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "forward_only.h"
#include "action_table.h"
#include "vocab_rules.h"
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

// Position (1-based, 0 = absent) of each compute / comm action on its rank.
using Positions = ActionTable<int32_t>;

// 1a. Placement and ranges: every action of rank r is in range, of a stage on r, a comm action
// has a cross-rank peer, and none appears twice. Returns the positions of all of them.
Positions place_actions(const Program& p) {
  Positions pos(p.num_stages, p.microbatches, 0);
  for (int r = 0; r < p.pp; ++r) {
    const auto& acts = p.ranks[r];
    for (int i = 0; i < static_cast<int>(acts.size()); ++i) {
      poll_cancel();
      const Action& a = acts[i];
      if (a.kind == Kind::OVERLAP_F_B && a.sub.empty()) fail(p, r, i, "OVERLAP_F_B without sub-actions");
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        if (!pos.in_range(s->stage, s->microbatch))
          fail(p, r, i, detail::str("'", to_string(*s), "' is out of range"));
        if (is_vocab(s->kind)) {  // its leading number is the shard, the rank that runs it
          if (s->stage != r || a.kind == Kind::OVERLAP_F_B)
            fail(p, r, i, detail::str("'", to_string(*s), "' runs on rank ", r, a.kind == Kind::OVERLAP_F_B
                                      ? " inside an OVERLAP_F_B" : " but names vocabulary shard " + std::to_string(s->stage)));
        } else if (p.rank_of(s->stage) != r)
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
  return pos;
}

// 1b. Exactly once: F for every (stage, mb), and (training) either B or both I and W.
void check_exactly_once(const Program& p, const Positions& pos, bool forward_only) {
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
}

// 2. Local order of one compute (stage s, kind k, mb) at 1-based position c on rank r, from
// producers_of: a producer on the same rank runs before it; one on another rank is received
// before it; a result another rank consumes is sent after it.
void check_compute_order(const Program& p, const Positions& pos, bool comms, int r, int c,
                         const Action& part) {
  const int s = part.stage, mb = part.microbatch;
  const Kind k = part.kind;
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

// 2. Local order on each rank, for every compute the program runs (check_compute_order).
void check_local_order(const Program& p, const Positions& pos, bool forward_only) {
  const bool comms = p.has_comms();
  for (int s = 0; s < p.num_stages; ++s) {
    const int r = p.rank_of(s);
    for (int mb = 0; mb < p.microbatches; ++mb) {
      poll_cancel();
      for (Kind k : {Kind::F, Kind::B, Kind::I, Kind::W}) {
        const int c = pos.at(s, k, mb);
        if (!c || (forward_only && k != Kind::F)) continue;
        check_compute_order(p, pos, comms, r, c, Action(s, k, mb));
      }
    }
  }
}

// 3. Per ordered rank pair, sends and receives carry the same messages in the same order.
// Keyed by (src * pp + dst) in a map: only the pairs that talk get an entry, so memory follows
// the actions, not pp^2. Counts already match one-to-one (check 2), so equal sequences reduce
// to comparing element by element.
void check_message_order(const Program& p) {
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

// Whether `a` may run in a blocking-receive run once the actions marked in `done` have: a RECV
// waits for its SEND, a compute for its inputs, and with vocabulary actions (vocab.h) what
// awaits a collective for every rank's post of it (`posts`).
bool can_run(const Program& p, const VocabParts& parts, const ActionTable<uint8_t>& done,
             const detail::CollectivePosts* posts, const Action& a) {
  if (a.kind == Kind::RECV_F || a.kind == Kind::RECV_B) {
    const Action send = matching_send(a);
    return done.at(send.stage, send.kind, send.microbatch) != 0;
  }
  for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
    for (const Producer& d : producers_of(*s, p.num_stages))
      if (!done.met(d, s->microbatch)) return false;
    if (!posts) continue;
    const Kind awaited = detail::awaited_collective(parts, p, *s);
    if (awaited != Kind::F && !posts->complete(awaited, s->microbatch)) return false;
  }
  return true;
}

// The ranks waiting to run again, each at most once (last in, first out).
class RankQueue {
 public:
  // Every rank, rank 0 first out.
  explicit RankQueue(int pp) : queued_(pp, 1) {
    for (int r = pp - 1; r >= 0; --r) ranks_.push_back(r);
  }
  void wake(int rank) {
    if (!queued_[rank]) {
      queued_[rank] = 1;
      ranks_.push_back(rank);
    }
  }
  bool empty() const { return ranks_.empty(); }
  int pop() {
    const int r = ranks_.back();
    ranks_.pop_back();
    queued_[r] = 0;
    return r;
  }

 private:
  std::vector<int> ranks_;
  std::vector<char> queued_;
};

// 4. Blocking-receive execution (can_run). Ranks run as far as they can; one that stops is run
// again once an action it may wait on ends: a SEND wakes its RECV's rank, a compute the rank
// that consumes its data (what a compute needs on its own rank is behind it in the same list).
// The ranks left unfinished are those of every order (the run is monotone), in O(actions)
// instead of O(pp x rounds).
void check_blocking_run(const Program& p) {
  ActionTable<uint8_t> done(p.num_stages, p.microbatches, 0);
  std::vector<size_t> next(p.pp, 0);
  RankQueue queue(p.pp);
  std::optional<detail::CollectivePosts> posts;
  const VocabParts parts = vocab_parts(p);
  if (parts.head || parts.embedding) posts.emplace(p.pp, p.microbatches);
  while (!queue.empty()) {
    const int r = queue.pop();
    const auto& acts = p.ranks[r];
    while (next[r] < acts.size() && can_run(p, parts, done, posts ? &*posts : nullptr, acts[next[r]])) {
      poll_cancel();
      const Action& a = acts[next[r]];
      if (a.kind == Kind::SEND_F || a.kind == Kind::SEND_B) queue.wake(p.rank_of(comm_peer_stage(a)));
      if (is_collective(a.kind) && posts->post(a.kind, a.microbatch))  // complete: wake every rank
        for (int q = 0; q < p.pp; ++q) queue.wake(q);
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        done.at(s->stage, s->kind, s->microbatch) = 1;
        const int to = data_consumer(*s, p.num_stages);
        if (to >= 0) queue.wake(p.rank_of(to));
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

}  // namespace

// The checks in their numbered order: the first violation found is the one reported.
void validate(const Program& p) {
  check_shape(p);
  const bool forward_only = detail::is_forward_only(p);
  const Positions pos = place_actions(p);          // 1.
  check_exactly_once(p, pos, forward_only);        // 1.
  check_local_order(p, pos, forward_only);         // 2.
  detail::check_vocab(p, pos, forward_only);       // 1., 2. and one collective order (vocab.h)
  if (p.has_comms()) check_message_order(p);       // 3.
  check_blocking_run(p);                           // 4.
}

}  // namespace zbpipe
