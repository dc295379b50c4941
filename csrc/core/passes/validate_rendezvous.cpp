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

void run(const Program& p, bool split_overlap) {
  std::vector<Group> groups;
  std::vector<Op> ops;
  std::vector<std::vector<int>> rank_groups(p.pp);
  ActionTable<int32_t> op_of(p.num_stages, p.microbatches, -1);  // comm action -> op
  for (int r = 0; r < p.pp; ++r) {
    for (const CommBatch& b : comm_batches(p.ranks[r], split_overlap)) {
      const int g = static_cast<int>(groups.size());
      groups.push_back(Group{r, b, false, false, false, {}});
      rank_groups[r].push_back(g);
      for (int i = b.begin; i < b.end; ++i) {
        const Action& a = p.ranks[r][i];
        op_of.at(a.stage, a.kind, a.microbatch) = static_cast<int>(ops.size());
        groups[g].ops.push_back(static_cast<int>(ops.size()));
        ops.push_back(Op{g, -1, i, false});
      }
    }
  }
  // Pair each send with its receive (validate() checked they exist and agree in order).
  for (auto& op : ops) {
    const Action& a = p.ranks[groups[op.group].rank][op.action];
    if (a.kind != Kind::SEND_F && a.kind != Kind::SEND_B) continue;
    const Action recv = matching_recv(a);
    const int other = op_of.at(recv.stage, recv.kind, recv.microbatch);
    ZB_SCHEDULE_CHECK(other >= 0, "validate_rendezvous: '", to_string(a), "' on rank ",
                      groups[op.group].rank, " has no receive (validate the program first)");
    op.partner = other;
    ops[other].partner = static_cast<int>(&op - ops.data());
  }

  std::vector<std::vector<Step>> steps(p.pp);
  for (int r = 0; r < p.pp; ++r) {
    const auto& acts = p.ranks[r];
    size_t next_group = 0;
    for (int i = 0; i < static_cast<int>(acts.size()); ++i) {
      const Action& a = acts[i];
      if (is_comm(a.kind)) {
        while (next_group < rank_groups[r].size() && groups[rank_groups[r][next_group]].batch.begin == i)
          steps[r].push_back(Step{rank_groups[r][next_group++], -1, {}});
        continue;
      }
      Step s{-1, i, {}};
      for (const Action* part = detail::parts_begin(a); part != detail::parts_end(a); ++part) {
        for (const Producer& d : producers_of(*part, p.num_stages)) {
          if (!d.data) continue;
          const Action rv = recv_for(*part, d);
          const int recv = op_of.at(rv.stage, rv.kind, rv.microbatch);  // -1: same rank
          if (recv >= 0) s.waits.push_back(ops[recv].group);
        }
      }
      steps[r].push_back(std::move(s));
    }
  }

  std::vector<size_t> at(p.pp, 0);  // steps the compute stream has passed
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p.pp; ++r) {
      poll_cancel();
      while (at[r] < steps[r].size()) {
        poll_cancel();
        const Step& s = steps[r][at[r]];
        if (s.group >= 0) {
          groups[s.group].posted = true;
        } else {
          bool ready = true;
          for (int g : s.waits) ready = ready && groups[g].done;
          if (!ready) break;
        }
        ++at[r];
        progress = true;
      }
    }
    for (int r = 0; r < p.pp; ++r) {
      for (size_t k = 0; k < rank_groups[r].size(); ++k) {
        poll_cancel();
        Group& g = groups[rank_groups[r][k]];
        if (!g.started && g.posted && (k == 0 || groups[rank_groups[r][k - 1]].done))
          g.started = progress = true;
        if (!g.started || g.done) continue;
        bool all = true;
        for (int o : g.ops) {
          Op& op = ops[o];
          if (!op.done && op.partner >= 0 && groups[ops[op.partner].group].started)
            op.done = ops[op.partner].done = true;
          all = all && op.done;
        }
        if (all) g.done = progress = true;
        else if (k + 1 < rank_groups[r].size()) break;  // later groups wait behind this one
      }
    }
  }

  for (int r = 0; r < p.pp; ++r) {
    if (at[r] == steps[r].size()) continue;
    const Step& s = steps[r][at[r]];
    int g = -1;
    for (int w : s.waits)
      if (!groups[w].done) g = w;
    const Group& blocked = groups[g];
    // What holds a group: the group before it on its stream, or an op whose partner has not
    // started. Follow the first link, which is where the cycle shows.
    auto holder = [&](const Group& h) {
      const auto& mine = rank_groups[h.rank];
      if (!h.started) {
        for (size_t k = 1; k < mine.size(); ++k)
          if (&groups[mine[k]] == &h)
            return detail::str("which waits behind its batch '", batch_name(p, groups[mine[k - 1]]), "'");
        return std::string("which the compute stream has not reached");
      }
      for (int o : h.ops) {
        if (ops[o].done) continue;
        const Group& peer = groups[ops[ops[o].partner].group];
        return detail::str("where '", to_string(p.ranks[h.rank][ops[o].action]), "' waits for rank ",
                           peer.rank, " to start its batch '", batch_name(p, peer), "'");
      }
      return std::string();
    };
    std::string why = holder(blocked);
    if (!blocked.started) {
      const auto& mine = rank_groups[r];
      for (size_t k = 1; k < mine.size(); ++k)
        if (mine[k] == g) why += ", " + holder(groups[mine[k - 1]]);
    }
    throw ScheduleError(detail::str(
        "invalid program '", p.schedule, "' (pp=", p.pp, ", stages=", p.num_stages,
        ", microbatches=", p.microbatches, "): deadlock with rendezvous sends (NCCL: a send completes "
        "only once its receive is posted", split_overlap ? "; OVERLAP_F_B's SEND_F posted on its own" : "",
        "): rank ", r, " waits at '", to_string(p.ranks[r][s.action]), "' for its batch '",
        batch_name(p, blocked), "', ", why, "\n", format_program(p, r, s.action)));
  }
  for (const Group& g : groups)  // the step's end waits for every send
    if (!g.done)
      throw ScheduleError(detail::str(
          "invalid program '", p.schedule, "' (pp=", p.pp, ", stages=", p.num_stages,
          ", microbatches=", p.microbatches, "): deadlock with rendezvous sends (NCCL): rank ", g.rank,
          "'s batch '", batch_name(p, g), "' never completes\n", format_program(p, g.rank, g.batch.begin)));
}

}  // namespace

void validate_rendezvous(const Program& p) {
  ZB_SCHEDULE_CHECK(p.has_comms() || p.pp == 1, "validate_rendezvous expects a lowered program (with "
                    "SEND/RECV); '", p.schedule, "' is compute-only");
  run(p, false);
  run(p, true);
}

}  // namespace zbpipe
