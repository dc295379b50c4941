// The dispatch table: what the executor does for one rank's lowered program, worked out once
// from the program alone -- one entry per compute part (an OVERLAP_F_B gives one per part) and
// one per communication batch (zbpipe::comm_batches), with where each compute reads its input
// and where its result goes. Pure: no torch, no c10d, no process group (tests build it through
// _C._dispatch_table and check it against the program).
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "zbpipe/program.h"

namespace zbpipe::runtime {

// One step of the executor's loop, in program order.
struct Entry {
  // A compute: F, B, I or W (the part, never OVERLAP_F_B). A comm batch: its first action's
  // kind (SEND_* or RECV_*), its actions being comms[comm_begin, comm_end).
  Kind kind = Kind::F;
  int index = -1;    // the action's index in the rank's program (a batch: its first action's)
  int stage = -1;    // compute: the global stage
  int local = -1;    // compute: index of the stage among the rank's (DispatchTable::stages)
  int mb = -1;       // compute: the microbatch
  bool needs_recv = false;  // its input comes from another rank: wait for the receive first
  int handoff = -1;         // local index of the same-rank stage its result goes to, or -1
  bool to_send = false;     // its result goes to another rank, by a later SEND
  int comm_begin = 0, comm_end = 0;  // comm batch: range in DispatchTable::comms
  bool on_worker = false;   // the backward half of an overlapped OVERLAP_F_B: runs on the worker
  bool concurrent = false;  // runs while the worker may be busy (that unit's forward half, its SEND)
  bool sync_grads = false;  // the stage's last B or W of a step, wrapped in gradient sync
                            // (mark_gradient_sync: it depends on the stages, not the program)
  // Vocabulary parallelism (vocab.h): an F of the last stage whose output is the head's input,
  // a backward of the last stage that starts from the head's reduced gradient. A vocabulary
  // action itself has `stage` = its shard (this rank) and `local` = -1.
  bool to_vocab = false;
  bool needs_vocab_grad = false;
  std::string label;        // the trace's name: the part, or a batch's actions joined by '+'
  std::string unit;         // a part of an OVERLAP_F_B: that unit's action string, else ""

  bool is_comm() const { return ::zbpipe::is_comm(kind); }
  bool is_vocab() const { return ::zbpipe::is_vocab(kind); }
};

// One communication action of a batch.
struct Comm {
  Kind kind = Kind::SEND_F;  // SEND_F / RECV_F / SEND_B / RECV_B
  int stage = -1, local = -1, mb = -1;
  int peer = -1;   // the rank at the other end
  int tag = 0;     // data_tag of the message (its tensor i travels with tag + i)
  int index = -1;  // the action's index in the rank's program
  std::string desc;  // "1RECV_F0 from rank 0", for error messages
};

struct DispatchTable {
  std::vector<int> stages;     // local index -> global stage (the rank's, ascending)
  std::vector<Entry> entries;  // in program order
  std::vector<Comm> comms;     // every comm action, in program order

  // Whether local stage `local` has a B or I (its forwards keep a graph for them).
  bool trains(int local) const;
};

// Builds `rank`'s table. `overlap_f_b`: an OVERLAP_F_B of two stages runs its backward half on
// the worker while its forward half runs (ExecutorOptions::overlap_f_b); false runs its parts
// in sequence. Throws zbpipe::Error for an action the rank cannot run (a stage it does not
// hold, a microbatch out of range, a comm outside the batches) or tags out of range.
DispatchTable build_dispatch(const Program& program, int rank, bool overlap_f_b);

// Sets Entry::sync_grads on the last B or W of each local stage with syncs[local], and keeps
// that entry off the worker (the sync hooks, Python DDP/FSDP, run on the executor's thread).
void mark_gradient_sync(DispatchTable& table, const std::vector<bool>& syncs);

// Tag of a data message: the boundary (lower stage of the edge), direction and microbatch,
// times the per-message tensor capacity; tensor i of the message adds i.
int data_tag(int boundary_stage, bool grad, int mb, int microbatches);
constexpr int kMaxTensorsPerMessage = 64;

// The table as tuples, for tests (_C._dispatch_table): (entries, comms) with entries
// (label, unit, index, stage, mb, needs_recv, handoff stage or -1, to_send, comm_begin,
// comm_end, on_worker, concurrent) and comms (label, peer, tag).
using EntryRow = std::tuple<std::string, std::string, int, int, int, bool, int, bool, int, int, bool, bool>;
using CommRow = std::tuple<std::string, int, int>;
std::tuple<std::vector<EntryRow>, std::vector<CommRow>> dispatch_rows(const Program& program, int rank,
                                                                      bool overlap_f_b);

}  // namespace zbpipe::runtime
