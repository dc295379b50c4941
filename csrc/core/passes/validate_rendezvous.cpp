// Rendezvous pass: a lowered program run as on a stream-ordered backend (NCCL). validate()
// lets a send complete at once (a buffered transport); here it completes only once its
// receive is posted and running, which some valid programs never allow.
//
// Per rank: one compute stream running the compute actions in order, and one communication
// stream running the batches (comm_batches) in program order, each as one group: a group
// starts once the previous one has completed and the compute before it is done; it completes
// once every op in it has met its partner's running group. A compute needing a received
// tensor waits for the whole group holding that receive. (One communicator: the runtime
// coalesces every batch on such backends; see csrc/runtime/p2p.h.)
//
// The vocabulary collectives (vocab.h) are groups of their own, posted in program order among
// the batches onto a second stream: a communicator of their own, as the executor runs them on
// stream-ordered backends (vocab_run.h; on the messages' communicator every vocabulary program
// deadlocks: a rank's early broadcast post holds back the sends its root waits for). A
// collective completes once every rank has started its own. Their waits are
// the executor's (vocab_run.h): S waits for its broadcast off the root, REDUCE_B's post and T
// for the statistics' all-reduce, the root's backward of the last stage for the reduction.
#include <algorithm>
#include <array>
#include <map>
#include <string>

#include "action_table.h"
#include "zbpipe/cancel.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

using detail::ActionTable;

namespace {

struct Group {
  int rank = 0;
  CommBatch batch;
  bool posted = false, started = false, done = false;
  std::vector<int> ops;
  int collective = -1;  // a vocabulary collective: its index in RendezvousRun::collectives_
};

struct Op {
  int group = -1;
  int partner = -1;
  int action = -1;  // index on its rank
  bool done = false;
};

struct Step {
  int group = -1;   // a post (the compute stream reached the batch)
  int action = -1;  // else a compute action, waiting for `waits`
  std::vector<int> waits;
  int pos = 0;         // its action's index in the rank's program
  bool after_stages = false;  // the head's lane: only once the stages' lane has passed `pos`
};

// A vocabulary collective's key: its kind and microbatch (every rank posts each once).
int64_t collective_key(const Action& a) { return static_cast<int64_t>(a.kind) * (int64_t{1} << 32) + a.microbatch; }

std::string batch_name(const Program& p, const Group& g) {
  std::string out;
  for (int i = g.batch.begin; i < g.batch.end; ++i)
    out += (out.empty() ? "" : "+") + to_string(p.ranks[g.rank][i]);
  return out;
}

// One run of a program with rendezvous sends, one method per phase: the groups and their ops,
// each send paired with its receive, each rank's compute stream as steps, the run to a fixed
// point, and the deadlock (if any) named.
class RendezvousRun {
 public:
  RendezvousRun(const Program& p, bool split_overlap)
      : p_(p), split_overlap_(split_overlap), rank_groups_(p.pp), streams_(p.pp),
        op_of_(p.num_stages, p.microbatches, -1), steps_(2 * p.pp), at_(2 * p.pp, 0) {}

  void run() {
    make_groups();
    pair_sends();
    make_steps();
    play();
    check_finished();
  }

 private:
  // Each rank's batches (comm_batches) as groups, each comm action as an op; each vocabulary
  // collective a group of its own, in program order among them.
  void make_groups() {
    for (int r = 0; r < p_.pp; ++r) {
      std::vector<CommBatch> batches = comm_batches(p_.ranks[r], split_overlap_);
      for (int i = 0; i < static_cast<int>(p_.ranks[r].size()); ++i)
        if (is_collective(p_.ranks[r][i].kind)) batches.push_back(CommBatch{i, i + 1, false});
      std::stable_sort(batches.begin(), batches.end(),
                       [](const CommBatch& x, const CommBatch& y) { return x.begin < y.begin; });
      for (const CommBatch& b : batches) {
        const int g = static_cast<int>(groups_.size());
        groups_.push_back(Group{r, b, false, false, false, {}, -1});
        rank_groups_[r].push_back(g);
        const Action& first = p_.ranks[r][b.begin];
        streams_[r][is_collective(first.kind) ? 1 : 0].push_back(g);
        if (is_collective(first.kind)) {
          auto [it, fresh] = collective_index_.try_emplace(collective_key(first), static_cast<int>(collectives_.size()));
          if (fresh) collectives_.emplace_back();
          collectives_[it->second].push_back(g);
          groups_[g].collective = it->second;
          continue;
        }
        for (int i = b.begin; i < b.end; ++i) {
          const Action& a = p_.ranks[r][i];
          op_of_.at(a.stage, a.kind, a.microbatch) = static_cast<int>(ops_.size());
          groups_[g].ops.push_back(static_cast<int>(ops_.size()));
          ops_.push_back(Op{g, -1, i, false});
        }
      }
    }
  }

  // Rank r's group of the collective `kind` of microbatch `mb` (validate() checked that every
  // rank posts it once).
  int collective_group(int r, Kind kind, int mb) const {
    const auto it = collective_index_.find(collective_key(Action(r, kind, mb)));
    ZB_SCHEDULE_CHECK(it != collective_index_.end(), "validate_rendezvous: no '", to_string(Action(r, kind, mb)),
                      "' (validate the program first)");
    for (int g : collectives_[it->second])
      if (groups_[g].rank == r) return g;
    throw ScheduleError(detail::str("validate_rendezvous: rank ", r, " posts no '", to_string(Action(r, kind, mb)),
                                    "' (validate the program first)"));
  }

  // Pairs each send with its receive (validate() checked they exist and agree in order).
  void pair_sends() {
    for (auto& op : ops_) {
      const Action& a = p_.ranks[groups_[op.group].rank][op.action];
      if (a.kind != Kind::SEND_F && a.kind != Kind::SEND_B) continue;
      const Action recv = matching_recv(a);
      const int other = op_of_.at(recv.stage, recv.kind, recv.microbatch);
      ZB_SCHEDULE_CHECK(other >= 0, "validate_rendezvous: '", to_string(a), "' on rank ",
                        groups_[op.group].rank, " has no receive (validate the program first)");
      op.partner = other;
      ops_[other].partner = static_cast<int>(&op - ops_.data());
    }
  }

  // Each rank's compute lanes (2r: the stages', 2r + 1: the vocabulary head's, a stream of its
  // own on a device, a thread of its own on the CPU: vocab_run.h): a post where it reaches a
  // batch, else a compute that waits for the groups holding its received inputs. Every
  // vocabulary action (passes, collective posts, REDUCE_B's rescale) runs on the head's lane,
  // so a pass waiting for a collective never holds back the stages' posts; the root's
  // broadcast only once the stages' lane has passed it (it reads the last stage's output).
  void make_steps() {
    for (int r = 0; r < p_.pp; ++r) {
      const auto& acts = p_.ranks[r];
      size_t next_group = 0;
      for (int i = 0; i < static_cast<int>(acts.size()); ++i) {
        const Action& a = acts[i];
        const bool head = is_vocab(a.kind);
        std::vector<Step>& lane = steps_[2 * r + (head ? 1 : 0)];
        // The root's broadcast reads the last stage's output: posted once the stages' lane has
        // run everything before it.
        const bool after = a.kind == Kind::BCAST_F && r == vocab_root(p_);
        if (is_comm(a.kind) || is_collective(a.kind)) {
          // REDUCE_B's post rescales by the global statistics: it waits for their all-reduce.
          if (a.kind == Kind::REDUCE_B)
            lane.push_back(Step{-1, i, {collective_group(r, Kind::ALLREDUCE_S, a.microbatch)}, i, false});
          while (next_group < rank_groups_[r].size() &&
                 groups_[rank_groups_[r][next_group]].batch.begin == i)
            lane.push_back(Step{rank_groups_[r][next_group++], -1, {}, i, after});
          // The root's head lane waits for its reduction's completion right after posting it (a
          // CPU lane, a thread, completes it there for the backward; a device's stages'
          // stream waits for it instead, which holds back less).
          if (a.kind == Kind::REDUCE_B && r == vocab_root(p_))
            lane.push_back(Step{-1, i, {collective_group(r, Kind::REDUCE_B, a.microbatch)}, i, false});
          continue;
        }
        Step s = compute_step(r, a, i);
        s.pos = i;
        lane.push_back(std::move(s));
      }
    }
  }

  Step compute_step(int r, const Action& a, int index) const {
    Step s{-1, index, {}};
    if (a.kind == Kind::S) {  // S reads the broadcast (the root too: it orders the two streams)
      s.waits.push_back(collective_group(r, Kind::BCAST_F, a.microbatch));
      return s;
    }
    if (a.kind == Kind::T) {
      s.waits.push_back(collective_group(r, Kind::ALLREDUCE_S, a.microbatch));
      return s;
    }
    for (const Action* part = detail::parts_begin(a); part != detail::parts_end(a); ++part) {
      for (const Producer& d : producers_of(*part, p_.num_stages)) {
        if (!d.data) continue;
        const Action rv = recv_for(*part, d);
        const int recv = op_of_.at(rv.stage, rv.kind, rv.microbatch);  // -1: same rank
        if (recv >= 0) s.waits.push_back(ops_[recv].group);
      }
      // The last stage's backward starts from the head's reduced gradient.
      if (has_vocab_ && needs_vocab_grad(p_, *part))
        s.waits.push_back(collective_group(r, Kind::REDUCE_B, part->microbatch));
    }
    return s;
  }

  // Both streams of every rank run as far as they can, until neither moves.
  void play() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int lane = 0; lane < 2 * p_.pp; ++lane) {
        poll_cancel();
        progress = advance_compute(lane) || progress;
      }
      for (int r = 0; r < p_.pp; ++r) progress = advance_comms(r) || progress;
    }
  }

  // A compute stream (`lane`): posts batches and runs computes whose groups are done.
  bool advance_compute(int lane) {
    bool progress = false;
    while (at_[lane] < steps_[lane].size()) {
      poll_cancel();
      const Step& s = steps_[lane][at_[lane]];
      if (s.after_stages) {  // the stages' lane (2r) must have passed s.pos
        const auto& stages = steps_[lane - 1];
        const size_t k = at_[lane - 1];
        if (k < stages.size() && stages[k].pos < s.pos) break;
      }
      if (s.group >= 0) {
        groups_[s.group].posted = true;
      } else {
        bool ready = true;
        for (int g : s.waits) ready = ready && groups_[g].done;
        if (!ready) break;
      }
      ++at_[lane];
      progress = true;
    }
    return progress;
  }

  // Rank r's communication streams: a posted group starts after the one before it on its
  // stream is done, and is done once every op has met its partner's started group (a
  // collective: once every rank has started its own).
  bool advance_comms(int r) {
    bool progress = false;
    for (const std::vector<int>& stream : streams_[r]) progress = advance_stream(stream) || progress;
    return progress;
  }

  bool advance_stream(const std::vector<int>& stream) {
    bool progress = false;
    for (size_t k = 0; k < stream.size(); ++k) {
      poll_cancel();
      Group& g = groups_[stream[k]];
      if (!g.started && g.posted && (k == 0 || groups_[stream[k - 1]].done))
        g.started = progress = true;
      if (!g.started || g.done) continue;
      if (g.collective >= 0) {  // complete once every rank has started its own
        bool all = true;
        for (int other : collectives_[g.collective]) all = all && groups_[other].started;
        if (all) {
          g.done = progress = true;
          continue;
        }
        break;  // later groups wait behind this one
      }
      bool all = true;
      for (int o : g.ops) {
        Op& op = ops_[o];
        if (!op.done && op.partner >= 0 && groups_[ops_[op.partner].group].started)
          op.done = ops_[op.partner].done = true;
        all = all && op.done;
      }
      if (all) g.done = progress = true;
      else break;  // later groups wait behind this one
    }
    return progress;
  }

  // Throws ScheduleError at the first rank whose compute stream stopped, else at the first
  // group that never completed (the step's end waits for every send).
  void check_finished() const {
    for (int lane = 0; lane < 2 * p_.pp; ++lane)
      if (at_[lane] != steps_[lane].size()) stuck_compute(lane);
    for (const Group& g : groups_)
      if (!g.done)
        throw ScheduleError(detail::str(
            "invalid program '", p_.schedule, "' (pp=", p_.pp, ", stages=", p_.num_stages,
            ", microbatches=", p_.microbatches, "): deadlock with rendezvous sends (NCCL): rank ", g.rank,
            "'s batch '", batch_name(p_, g), "' never completes\n", format_program(p_, g.rank, g.batch.begin)));
  }

  [[noreturn]] void stuck_compute(int lane) const {
    const int r = lane / 2;
    const Step& s = steps_[lane][at_[lane]];
    int g = -1;
    for (int w : s.waits)
      if (!groups_[w].done) g = w;
    if (g < 0) {  // the root's broadcast, waiting for the stages' lane
      const Step& stages = steps_[lane - 1][at_[lane - 1]];
      throw ScheduleError(detail::str(
          "invalid program '", p_.schedule, "' (pp=", p_.pp, ", stages=", p_.num_stages, ", microbatches=",
          p_.microbatches, "): deadlock with rendezvous sends (NCCL): rank ", r, "'s vocabulary head waits at '",
          to_string(p_.ranks[r][s.pos]), "' for its stages, which wait at '", to_string(p_.ranks[r][stages.pos]),
          "'\n", format_program(p_, r, s.pos)));
    }
    const Group& blocked = groups_[g];
    std::string why = holder(blocked);
    if (!blocked.started) {
      const auto& mine = stream_of(blocked);
      for (size_t k = 1; k < mine.size(); ++k)
        if (mine[k] == g) why += ", " + holder(groups_[mine[k - 1]]);
    }
    throw ScheduleError(detail::str(
        "invalid program '", p_.schedule, "' (pp=", p_.pp, ", stages=", p_.num_stages,
        ", microbatches=", p_.microbatches, "): deadlock with rendezvous sends (NCCL: a send completes "
        "only once its receive is posted", split_overlap_ ? "; OVERLAP_F_B's SEND_F posted on its own" : "",
        "): rank ", r, " waits at '", to_string(p_.ranks[r][s.action]), "' for its batch '",
        batch_name(p_, blocked), "', ", why, "\n", format_program(p_, r, s.action)));
  }

  // What holds a group: the group before it on its stream, or an op whose partner has not
  // started. Follows the first link, which is where the cycle shows.
  std::string holder(const Group& h) const {
    const auto& mine = stream_of(h);
    if (!h.started) {
      for (size_t k = 1; k < mine.size(); ++k)
        if (&groups_[mine[k]] == &h)
          return detail::str("which waits behind its batch '", batch_name(p_, groups_[mine[k - 1]]), "'");
      return std::string("which the compute stream has not reached");
    }
    if (h.collective >= 0) {
      for (int other : collectives_[h.collective])
        if (!groups_[other].started)
          return detail::str("where the collective waits for rank ", groups_[other].rank, " to start its '",
                             batch_name(p_, groups_[other]), "'");
    }
    for (int o : h.ops) {
      if (ops_[o].done) continue;
      const Group& peer = groups_[ops_[ops_[o].partner].group];
      return detail::str("where '", to_string(p_.ranks[h.rank][ops_[o].action]), "' waits for rank ",
                         peer.rank, " to start its batch '", batch_name(p_, peer), "'");
    }
    return std::string();
  }

  const Program& p_;
  const bool split_overlap_;
  std::vector<Group> groups_;
  std::vector<Op> ops_;
  std::vector<std::vector<int>> rank_groups_;  // each rank's groups, in program order
  // Each rank's streams (the messages', the collectives'), each its groups in order.
  std::vector<std::array<std::vector<int>, 2>> streams_;
  const std::vector<int>& stream_of(const Group& g) const {
    return streams_[g.rank][g.collective >= 0 ? 1 : 0];
  }
  ActionTable<int32_t> op_of_;                 // comm action -> op
  std::vector<std::vector<Step>> steps_;       // each rank's compute streams (lanes 2r, 2r + 1)
  std::vector<size_t> at_;                     // steps each compute stream has passed
  const bool has_vocab_ = has_vocab(p_);
  std::vector<std::vector<int>> collectives_;      // per vocabulary collective: its group on each rank
  std::map<int64_t, int> collective_index_;        // collective_key -> index in collectives_
};

}  // namespace

void validate_rendezvous(const Program& p) {
  ZB_SCHEDULE_CHECK(p.has_comms() || p.pp == 1, "validate_rendezvous expects a lowered program (with "
                    "SEND/RECV); '", p.schedule, "' is compute-only");
  ZB_SCHEDULE_CHECK(!vocab_parts(p).embedding, "validate_rendezvous does not model the embedding's collectives "
                    "('", p.schedule, "'): vocabulary-parallel embeddings run on host-completing backends (Gloo) only");
  RendezvousRun(p, false).run();
  RendezvousRun(p, true).run();
}

}  // namespace zbpipe
