// Embedding pass: places every rank's E and EW passes of the vocabulary-parallel input embedding
// and their two collectives (vocab.h) into a lowered program. The collective order is set on
// the embedding root (stage 0's rank), where the reduction must precede stage 0's forward and
// the broadcast follow its backward; every other rank posts early in that order, which costs it
// nothing (a post does not block). Only EW waits for something another rank does, so it is the
// one action placed by a timed run.
#include <algorithm>
#include <string>
#include <vector>

#include "forward_only.h"
#include "vocab_rules.h"
#include "zbpipe/compile.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"
#include "zbpipe/simulator.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

namespace {

// How many stage-0 forwards ahead of its need a reduction is posted: it then overlaps them.
constexpr int kReduceAhead = 2;

// A collective of the one order every rank posts, with the time it is due: for the head's, its
// last post in the base program's run; REDUCE_E m: the root's start of F of stage 0 for
// m - kReduceAhead (0 for the first); BCAST_E m: the end of the root's backward of stage 0 for m.
struct Due {
  Action collective;
  double at;
};

// When each action of each rank starts in `sim` (a post: when it is posted; a SEND/RECV: the
// end of the rank's compute before it), in list order.
std::vector<std::vector<double>> action_times(const Program& p, const SimResult& sim) {
  std::vector<std::vector<double>> starts(p.pp), ends(p.pp), posts(p.pp);
  for (const TimelineEvent& ev : sim.timeline) {
    starts[ev.rank].push_back(ev.start);
    ends[ev.rank].push_back(ev.end);
  }
  for (const TimelineEvent& ev : sim.collectives) posts[ev.rank].push_back(ev.start);  // by (rank, start)
  std::vector<std::vector<double>> out(p.pp);
  for (int r = 0; r < p.pp; ++r) {
    size_t c = 0, k = 0;
    double clock = 0.0;
    for (const Action& a : p.ranks[r]) {
      if (is_collective(a.kind)) {
        out[r].push_back(posts[r].at(k++));
      } else if (is_compute(a.kind)) {
        out[r].push_back(starts[r].at(c));
        clock = ends[r].at(c++);
      } else {
        out[r].push_back(clock);
      }
    }
  }
  return out;
}

// The one collective order: the head's (as every rank posts them) merged with the embedding's
// by the time each is due (an embedding collective first on a tie).
std::vector<Due> collective_order(const Program& p, const SimResult& sim, bool training) {
  const int root = embedding_root(p);
  std::vector<Due> head, embedding;
  for (const Action& a : p.ranks[0])
    if (is_collective(a.kind)) head.push_back({Action(-1, a.kind, a.microbatch), 0.0});
  for (Due& d : head)
    for (const TimelineEvent& ev : sim.collectives)
      if (ev.action.kind == d.collective.kind && ev.action.microbatch == d.collective.microbatch)
        d.at = std::max(d.at, ev.start);
  std::vector<double> forward(static_cast<size_t>(p.microbatches), 0.0), backward = forward;
  for (const TimelineEvent& ev : sim.timeline) {
    if (ev.rank != root) continue;
    for (const Action* s = detail::parts_begin(ev.action); s != detail::parts_end(ev.action); ++s) {
      if (needs_embedding(*s)) forward[static_cast<size_t>(s->microbatch)] = ev.start;
      if (feeds_embedding(*s)) backward[static_cast<size_t>(s->microbatch)] = ev.end;
    }
  }
  for (int mb = 0; mb < p.microbatches; ++mb)
    embedding.push_back({Action(-1, Kind::REDUCE_E, mb), mb < kReduceAhead ? 0.0 : forward[mb - kReduceAhead]});
  if (training)
    for (int mb = 0; mb < p.microbatches; ++mb) embedding.push_back({Action(-1, Kind::BCAST_E, mb), backward[mb]});
  std::stable_sort(embedding.begin(), embedding.end(), [](const Due& a, const Due& b) { return a.at < b.at; });
  std::vector<Due> order;
  size_t h = 0, e = 0;
  while (h < head.size() || e < embedding.size()) {
    if (e < embedding.size() && (h == head.size() || embedding[e].at <= head[h].at)) order.push_back(embedding[e++]);
    else order.push_back(head[h++]);
  }
  return order;
}

// Rank r's list with the embedding's actions (E before each REDUCE_E): each embedding collective
// is posted once it is due, or earlier where a later collective of the order comes first; on the
// root, a BCAST_E waits for its backward, and the head's posts that follow it in the order wait
// with it (they are due no earlier, so nothing before them in the run waited on them).
std::vector<Action> follow_order(const Program& p, int r, const std::vector<Due>& order,
                                 const std::vector<double>& times, bool training) {
  const bool root = r == embedding_root(p);
  const auto& acts = p.ranks[r];
  std::vector<char> backward_done(static_cast<size_t>(p.microbatches), 0);
  std::vector<Action> out, held;  // held: the head's posts waiting for an embedding one before them
  size_t k = 0, i = 0;
  for (;;) {
    // The embedding's collectives at the head of the order, as far as they are due and allowed.
    while (k < order.size() && is_embedding(order[k].collective.kind)) {
      const Action& x = order[k].collective;
      if (root && x.kind == Kind::BCAST_E && !backward_done[x.microbatch]) break;
      // Due: its time came, or what comes next must not go first: a collective later in the
      // order, or a RECV (which blocks: a post behind it could wait on what waits on the post).
      const bool due = !held.empty() || i == acts.size() || is_collective(acts[i].kind) ||
                       acts[i].kind == Kind::RECV_F || acts[i].kind == Kind::RECV_B || times[i] >= order[k].at;
      if (!due) break;
      if (x.kind == Kind::REDUCE_E) out.emplace_back(r, Kind::E, x.microbatch);
      out.emplace_back(r, x.kind, x.microbatch);
      ++k;
    }
    if (!held.empty() && k < order.size() && order[k].collective.kind == held.front().kind &&
        order[k].collective.microbatch == held.front().microbatch) {
      out.push_back(held.front());
      held.erase(held.begin());
      ++k;
      continue;
    }
    if (i == acts.size()) break;
    const Action& a = acts[i++];
    if (is_collective(a.kind)) {
      const bool its_turn = held.empty() && k < order.size() && order[k].collective.kind == a.kind &&
                            order[k].collective.microbatch == a.microbatch;
      if (!its_turn) {
        held.push_back(a);
        continue;
      }
      ++k;
    }
    out.push_back(a);
    for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
      if (training && feeds_embedding(*s)) backward_done[s->microbatch] = 1;
  }
  ZB_SCHEDULE_CHECK(held.empty() && k == order.size(), "insert_embedding: rank ", r, " of '", p.schedule,
                    "' cannot post the collectives in the order of the embedding root (",
                    k, " of ", order.size(), " placed)");
  return out;
}

// Moves each rank's EW m (all at the end of its list) before the first compute that `sim`
// starts once BCAST_E m completed and after its BCAST_E m post.
void place_weight_passes(Program& p, const SimResult& sim) {
  std::vector<double> complete(static_cast<size_t>(p.microbatches), 0.0);
  for (const TimelineEvent& ev : sim.collectives)
    if (ev.action.kind == Kind::BCAST_E) complete[static_cast<size_t>(ev.action.microbatch)] = ev.end;
  std::vector<std::vector<double>> starts(p.pp);  // per rank: its computes' starts, in list order
  for (const TimelineEvent& ev : sim.timeline) starts[ev.rank].push_back(ev.start);
  for (int r = 0; r < p.pp; ++r) {
    std::vector<Action> out;
    std::vector<int> pending;  // EW microbatches whose BCAST_E this rank posted, not yet placed
    size_t compute = 0;
    for (const Action& a : p.ranks[r]) {
      if (a.kind == Kind::EW) continue;
      if (is_compute(a.kind)) {
        const double start = starts[r].at(compute++);
        for (auto it = pending.begin(); it != pending.end();) {
          if (complete[static_cast<size_t>(*it)] > start) {
            ++it;
            continue;
          }
          out.emplace_back(r, Kind::EW, *it);
          it = pending.erase(it);
        }
      }
      out.push_back(a);
      if (a.kind == Kind::BCAST_E) pending.push_back(a.microbatch);
    }
    for (int mb : pending) out.emplace_back(r, Kind::EW, mb);
    p.ranks[r] = std::move(out);
  }
}

}  // namespace

Program insert_embedding(const Program& lowered, const CostModel& costs, const VocabModel& vocab,
                         const MemoryModel& memory) {
  check_shape(lowered);
  ZB_SCHEDULE_CHECK(lowered.has_comms() || lowered.pp == 1, "insert_embedding expects a lowered program (with "
                    "SEND/RECV); '", lowered.schedule, "' is compute-only");
  ZB_SCHEDULE_CHECK(!vocab_parts(lowered).embedding, "'", lowered.schedule, "' already has embedding actions");
  ZB_SCHEDULE_CHECK(lowered.num_stages >= lowered.pp, "the vocabulary-parallel embedding needs a stage on every "
                    "rank ('", lowered.schedule, "': pp=", lowered.pp, ", stages=", lowered.num_stages, ")");
  vocab.check(lowered.pp);
  const bool training = !detail::is_forward_only(lowered);
  const SimResult base = simulate(lowered, costs, memory, vocab, /*with_timeline=*/true);
  const std::vector<Due> order = collective_order(lowered, base, training);
  const std::vector<std::vector<double>> times = action_times(lowered, base);
  Program out = lowered;
  for (int r = 0; r < lowered.pp; ++r) out.ranks[r] = follow_order(lowered, r, order, times[r], training);
  if (!training) return out;
  for (int r = 0; r < out.pp; ++r)
    for (int mb = 0; mb < out.microbatches; ++mb) out.ranks[r].emplace_back(r, Kind::EW, mb);
  // The simulator passes a RECV at once where a blocking run waits for its SEND, so a placement
  // it times may still deadlock there: then every EW stays at its rank's end, which cannot
  // (each EW waits only for broadcasts every rank posted before it).
  Program placed = out;
  place_weight_passes(placed, simulate(out, costs, memory, vocab, /*with_timeline=*/true));
  try {
    validate(placed);
    return placed;
  } catch (const ScheduleError&) {
    return out;
  }
}

}  // namespace zbpipe
