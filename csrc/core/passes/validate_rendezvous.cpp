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
};

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
      : p_(p), split_overlap_(split_overlap), rank_groups_(p.pp),
        op_of_(p.num_stages, p.microbatches, -1), steps_(p.pp), at_(p.pp, 0) {}

  void run() {
    make_groups();
    pair_sends();
    make_steps();
    play();
    check_finished();
  }

 private:
  // Each rank's batches (comm_batches) as groups, each comm action as an op.
  void make_groups() {
    for (int r = 0; r < p_.pp; ++r) {
      for (const CommBatch& b : comm_batches(p_.ranks[r], split_overlap_)) {
        const int g = static_cast<int>(groups_.size());
        groups_.push_back(Group{r, b, false, false, false, {}});
        rank_groups_[r].push_back(g);
        for (int i = b.begin; i < b.end; ++i) {
          const Action& a = p_.ranks[r][i];
          op_of_.at(a.stage, a.kind, a.microbatch) = static_cast<int>(ops_.size());
          groups_[g].ops.push_back(static_cast<int>(ops_.size()));
          ops_.push_back(Op{g, -1, i, false});
        }
      }
    }
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

  // Each rank's compute stream: a post where it reaches a batch, else a compute that waits for
  // the groups holding its received inputs.
  void make_steps() {
    for (int r = 0; r < p_.pp; ++r) {
      const auto& acts = p_.ranks[r];
      size_t next_group = 0;
      for (int i = 0; i < static_cast<int>(acts.size()); ++i) {
        const Action& a = acts[i];
        if (is_comm(a.kind)) {
          while (next_group < rank_groups_[r].size() &&
                 groups_[rank_groups_[r][next_group]].batch.begin == i)
            steps_[r].push_back(Step{rank_groups_[r][next_group++], -1, {}});
          continue;
        }
        steps_[r].push_back(compute_step(a, i));
      }
    }
  }

  Step compute_step(const Action& a, int index) const {
    Step s{-1, index, {}};
    for (const Action* part = detail::parts_begin(a); part != detail::parts_end(a); ++part) {
      for (const Producer& d : producers_of(*part, p_.num_stages)) {
        if (!d.data) continue;
        const Action rv = recv_for(*part, d);
        const int recv = op_of_.at(rv.stage, rv.kind, rv.microbatch);  // -1: same rank
        if (recv >= 0) s.waits.push_back(ops_[recv].group);
      }
    }
    return s;
  }

  // Both streams of every rank run as far as they can, until neither moves.
  void play() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < p_.pp; ++r) {
        poll_cancel();
        progress = advance_compute(r) || progress;
      }
      for (int r = 0; r < p_.pp; ++r) progress = advance_comms(r) || progress;
    }
  }

  // Rank r's compute stream: posts batches and runs computes whose groups are done.
  bool advance_compute(int r) {
    bool progress = false;
    while (at_[r] < steps_[r].size()) {
      poll_cancel();
      const Step& s = steps_[r][at_[r]];
      if (s.group >= 0) {
        groups_[s.group].posted = true;
      } else {
        bool ready = true;
        for (int g : s.waits) ready = ready && groups_[g].done;
        if (!ready) break;
      }
      ++at_[r];
      progress = true;
    }
    return progress;
  }

  // Rank r's communication stream: a posted group starts after the one before it is done, and
  // is done once every op has met its partner's started group.
  bool advance_comms(int r) {
    bool progress = false;
    for (size_t k = 0; k < rank_groups_[r].size(); ++k) {
      poll_cancel();
      Group& g = groups_[rank_groups_[r][k]];
      if (!g.started && g.posted && (k == 0 || groups_[rank_groups_[r][k - 1]].done))
        g.started = progress = true;
      if (!g.started || g.done) continue;
      bool all = true;
      for (int o : g.ops) {
        Op& op = ops_[o];
        if (!op.done && op.partner >= 0 && groups_[ops_[op.partner].group].started)
          op.done = ops_[op.partner].done = true;
        all = all && op.done;
      }
      if (all) g.done = progress = true;
      else if (k + 1 < rank_groups_[r].size()) break;  // later groups wait behind this one
    }
    return progress;
  }

  // Throws ScheduleError at the first rank whose compute stream stopped, else at the first
  // group that never completed (the step's end waits for every send).
  void check_finished() const {
    for (int r = 0; r < p_.pp; ++r)
      if (at_[r] != steps_[r].size()) stuck_compute(r);
    for (const Group& g : groups_)
      if (!g.done)
        throw ScheduleError(detail::str(
            "invalid program '", p_.schedule, "' (pp=", p_.pp, ", stages=", p_.num_stages,
            ", microbatches=", p_.microbatches, "): deadlock with rendezvous sends (NCCL): rank ", g.rank,
            "'s batch '", batch_name(p_, g), "' never completes\n", format_program(p_, g.rank, g.batch.begin)));
  }

  [[noreturn]] void stuck_compute(int r) const {
    const Step& s = steps_[r][at_[r]];
    int g = -1;
    for (int w : s.waits)
      if (!groups_[w].done) g = w;
    const Group& blocked = groups_[g];
    std::string why = holder(blocked);
    if (!blocked.started) {
      const auto& mine = rank_groups_[r];
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
    const auto& mine = rank_groups_[h.rank];
    if (!h.started) {
      for (size_t k = 1; k < mine.size(); ++k)
        if (&groups_[mine[k]] == &h)
          return detail::str("which waits behind its batch '", batch_name(p_, groups_[mine[k - 1]]), "'");
      return std::string("which the compute stream has not reached");
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
  std::vector<std::vector<int>> rank_groups_;  // each rank's groups, in stream order
  ActionTable<int32_t> op_of_;                 // comm action -> op
  std::vector<std::vector<Step>> steps_;       // each rank's compute stream
  std::vector<size_t> at_;                     // steps each compute stream has passed
};

}  // namespace

void validate_rendezvous(const Program& p) {
  ZB_SCHEDULE_CHECK(p.has_comms() || p.pp == 1, "validate_rendezvous expects a lowered program (with "
                    "SEND/RECV); '", p.schedule, "' is compute-only");
  ZB_SCHEDULE_CHECK(!has_vocab(p), "validate_rendezvous does not model the vocabulary collectives yet ('",
                    p.schedule, "'): vocabulary-parallel programs run on host-completing backends (Gloo) only");
  RendezvousRun(p, false).run();
  RendezvousRun(p, true).run();
}

}  // namespace zbpipe
