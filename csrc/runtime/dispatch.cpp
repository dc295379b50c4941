// The dispatch builder: one walk over a rank's program, routing each compute by the core's
// producer rule (dependencies.h) and batching comms as zbpipe::comm_batches does.
#include "runtime/dispatch.h"

#include <algorithm>

#include "zbpipe/dependencies.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"
#include "zbpipe/vocab.h"

namespace zbpipe::runtime {

int data_tag(int boundary_stage, bool grad, int mb, int microbatches) {
  return ((boundary_stage * 2 + (grad ? 1 : 0)) * microbatches + mb) * kMaxTensorsPerMessage;
}

bool DispatchTable::trains(int local) const {
  return std::any_of(entries.begin(), entries.end(), [local](const Entry& e) {
    return !e.is_comm() && e.local == local && is_backward(e.kind);
  });
}

namespace {

// The walk's state: the program, the rank's batches, and the table it fills.
class Builder {
 public:
  Builder(const Program& p, int rank, bool overlap_f_b)
      : p_(p), rank_(rank), overlap_f_b_(overlap_f_b), vocab_(has_vocab(p)), acts_(p.ranks.at(rank)),
        batches_(comm_batches(acts_, overlap_f_b)), local_of_(p.num_stages, -1) {
    table_.stages = p.stages_of(rank);
    for (size_t i = 0; i < table_.stages.size(); ++i) local_of_[table_.stages[i]] = static_cast<int>(i);
    ZB_CHECK(static_cast<int64_t>(p.num_stages) * 2 * p.microbatches * kMaxTensorsPerMessage < (1 << 29),
             "too many stages x microbatches for the message tags (stages=", p.num_stages,
             ", microbatches=", p.microbatches, ")");
  }

  DispatchTable build() {
    for (size_t i = 0; i < acts_.size();) {
      const Action& a = acts_[i];
      if (is_comm(a.kind)) {
        add_batch(i);
        continue;
      }
      if (is_vocab(a.kind)) {
        add_vocab(i++);
        continue;
      }
      ZB_CHECK(is_compute(a.kind), "unexpected action '", to_string(a), "'");
      if (overlapped(a)) add_overlapped(i);
      else add_in_sequence(i);
    }
    return std::move(table_);
  }

 private:
  int local(const Action& a) const {
    ZB_CHECK(a.stage >= 0 && a.stage < p_.num_stages && local_of_[a.stage] >= 0, "action '",
             to_string(a), "' on rank ", rank_, " names a stage this rank does not hold");
    return local_of_[a.stage];
  }
  void check_microbatch(const Action& a) const {
    ZB_CHECK(a.microbatch >= 0 && a.microbatch < p_.microbatches, "action '", to_string(a),
             "' has microbatch out of range");
  }
  bool same_rank(int stage) const { return p_.rank_of(stage) == rank_; }

  // An OVERLAP_F_B of a forward and a backward of two stages, run with overlap_f_b.
  bool overlapped(const Action& a) const {
    if (!overlap_f_b_ || a.kind != Kind::OVERLAP_F_B || a.sub.size() != 2) return false;
    const Action* f = forward_half(a);
    const Action* b = backward_half(a);
    return f && b && f->stage != b->stage;
  }
  static const Action* forward_half(const Action& unit) {
    for (const auto& part : unit.sub)
      if (part.kind == Kind::F) return &part;
    return nullptr;
  }
  static const Action* backward_half(const Action& unit) {
    const Action* b = nullptr;
    for (const auto& part : unit.sub)
      if (is_backward(part.kind)) b = &part;
    return b;
  }

  // A compute part of the action at `index`: where its input comes from and its result goes.
  Entry& add_compute(const Action& part, int index) {
    Entry e;
    e.kind = part.kind;
    e.index = index;
    e.stage = part.stage;
    e.local = local(part);
    e.mb = part.microbatch;
    check_microbatch(part);
    ZB_CHECK(part.kind == Kind::F || part.kind == Kind::B || part.kind == Kind::I || part.kind == Kind::W,
             "unexpected action '", to_string(part), "'");
    for (const Producer& d : producers_of(part, p_.num_stages))
      if (d.data && !same_rank(d.stage)) e.needs_recv = true;
    const int to = data_consumer(part, p_.num_stages);
    if (to >= 0) {
      if (same_rank(to)) e.handoff = local_of_[to];
      else e.to_send = true;
    }
    if (vocab_) {
      e.to_vocab = part.kind == Kind::F && part.stage == p_.num_stages - 1;
      e.needs_vocab_grad = needs_vocab_grad(p_, part);
    }
    e.label = to_string(part);
    if (acts_[index].kind == Kind::OVERLAP_F_B) e.unit = to_string(acts_[index]);
    table_.entries.push_back(std::move(e));
    return table_.entries.back();
  }

  // A vocabulary action (vocab.h): this rank's shard, run by the executor's VocabRun.
  void add_vocab(size_t index) {
    const Action& a = acts_[index];
    ZB_CHECK(a.stage == rank_, "vocabulary action '", to_string(a), "' on rank ", rank_,
             " names another shard");
    check_microbatch(a);
    Entry e;
    e.kind = a.kind;
    e.index = static_cast<int>(index);
    e.stage = a.stage;
    e.mb = a.microbatch;
    e.label = to_string(a);
    table_.entries.push_back(std::move(e));
  }

  // The backward half on the worker, the forward half here at the same time, then F's SEND
  // (the batch comm_batches split off) while the backward half may still run.
  void add_overlapped(size_t& i) {
    const Action& unit = acts_[i];
    add_compute(*backward_half(unit), static_cast<int>(i)).on_worker = true;
    add_compute(*forward_half(unit), static_cast<int>(i)).concurrent = true;
    ++i;
    if (next_batch_ < batches_.size() && batches_[next_batch_].after_f_half &&
        batches_[next_batch_].begin == static_cast<int>(i)) {
      add_batch(i);
      table_.entries.back().concurrent = true;
    }
  }

  void add_in_sequence(size_t& i) {
    const Action& a = acts_[i];
    if (a.kind == Kind::OVERLAP_F_B) {
      for (const auto& sub : a.sub) add_compute(sub, static_cast<int>(i));
    } else {
      add_compute(a, static_cast<int>(i));
    }
    ++i;
  }

  // The batch starting at `i` (comm_batches defines them; the rendezvous check models the
  // same): one entry, one Comm per action. Leaves `i` past the batch.
  void add_batch(size_t& i) {
    ZB_CHECK(next_batch_ < batches_.size() && batches_[next_batch_].begin == static_cast<int>(i),
             "comm action '", to_string(acts_[i]), "' outside a batch");
    const CommBatch& batch = batches_[next_batch_++];
    Entry e;
    e.kind = acts_[i].kind;
    e.index = static_cast<int>(i);
    e.comm_begin = static_cast<int>(table_.comms.size());
    for (; static_cast<int>(i) < batch.end; ++i) {
      table_.comms.push_back(comm(acts_[i], static_cast<int>(i)));
      e.label += (e.label.empty() ? "" : "+") + to_string(acts_[i]);
    }
    e.comm_end = static_cast<int>(table_.comms.size());
    table_.entries.push_back(std::move(e));
  }

  // Peer and tag from the core's definition: a message is named by the boundary's lower stage
  // and its direction.
  Comm comm(const Action& c, int index) const {
    Comm k;
    k.kind = c.kind;
    k.stage = c.stage;
    k.local = local(c);
    check_microbatch(c);
    k.mb = c.microbatch;
    k.index = index;
    const int peer_stage = comm_peer_stage(c);
    k.peer = p_.rank_of(peer_stage);
    k.tag = data_tag(std::min<int>(c.stage, peer_stage), comm_payload(c).either_backward(), c.microbatch,
                     p_.microbatches);
    const bool send = c.kind == Kind::SEND_F || c.kind == Kind::SEND_B;
    k.desc = detail::str(to_string(c), send ? " to rank " : " from rank ", k.peer);
    return k;
  }

  const Program& p_;
  const int rank_;
  const bool overlap_f_b_;
  const bool vocab_;  // the program has vocabulary actions
  const std::vector<Action>& acts_;
  const std::vector<CommBatch> batches_;
  size_t next_batch_ = 0;
  std::vector<int> local_of_;  // global stage -> local index, -1 elsewhere
  DispatchTable table_;
};

}  // namespace

DispatchTable build_dispatch(const Program& program, int rank, bool overlap_f_b) {
  ZB_CHECK(rank >= 0 && rank < program.pp && program.ranks.size() == static_cast<size_t>(program.pp),
           "rank ", rank, " outside the program's pp=", program.pp);
  return Builder(program, rank, overlap_f_b).build();
}

void mark_gradient_sync(DispatchTable& table, const std::vector<bool>& syncs) {
  std::vector<int> last(table.stages.size(), -1);
  for (size_t i = 0; i < table.entries.size(); ++i) {
    const Entry& e = table.entries[i];
    if (!e.is_comm() && (e.kind == Kind::B || e.kind == Kind::W)) last[e.local] = static_cast<int>(i);
  }
  for (size_t l = 0; l < table.stages.size(); ++l)
    if (l < syncs.size() && syncs[l] && last[l] >= 0) {
      table.entries[last[l]].sync_grads = true;
      table.entries[last[l]].on_worker = false;
    }
}

std::tuple<std::vector<EntryRow>, std::vector<CommRow>> dispatch_rows(const Program& program, int rank,
                                                                      bool overlap_f_b) {
  const DispatchTable t = build_dispatch(program, rank, overlap_f_b);
  std::vector<EntryRow> entries;
  for (const Entry& e : t.entries)
    entries.emplace_back(e.label, e.unit, e.index, e.stage, e.mb, e.needs_recv,
                         e.handoff >= 0 ? t.stages[e.handoff] : -1, e.to_send, e.comm_begin, e.comm_end,
                         e.on_worker, e.concurrent);
  std::vector<CommRow> comms;
  for (const Comm& k : t.comms) comms.emplace_back(to_string(program.ranks[rank][k.index]), k.peer, k.tag);
  return {std::move(entries), std::move(comms)};
}

}  // namespace zbpipe::runtime
