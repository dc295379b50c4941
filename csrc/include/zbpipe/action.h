// The action IR: one value per thing a rank does, with PyTorch's canonical string form.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace zbpipe {

enum class Kind : uint8_t {
  F,            // forward
  B,            // full backward (input and weight gradients together)
  I,            // backward-input only (zero-bubble split)
  W,            // backward-weight only
  SEND_F,       // send this stage's forward output to stage+1
  RECV_F,       // receive this stage's forward input from stage-1
  SEND_B,       // send this stage's input gradient to stage-1
  RECV_B,       // receive this stage's output gradient from stage+1
  OVERLAP_F_B,  // sub-actions (an F and a backward) run as one overlapped unit (DualPipeV)
  // Vocabulary parallelism (vocab.h): the LM head split by vocabulary rows over every rank.
  // Their leading number is the vocabulary shard, which is the rank that runs them.
  S,            // the shard's logits, softmax statistics and input-gradient part
  T,            // the shard's weight gradient
  BCAST_F,      // collective: the last stage's output broadcast to every rank
  ALLREDUCE_S,  // collective: every shard's softmax statistics to every rank
  REDUCE_B,     // collective: the input gradient summed onto the last stage's rank
  kLast = REDUCE_B,  // the closed list ends here: a new kind goes before, and kLast follows
};
// Tables indexed by kind are sized from the enum (action.cpp checks the name table against it).
inline constexpr int kNumKinds = static_cast<int>(Kind::kLast) + 1;

const char* kind_name(Kind kind);
// Each kind is exactly one of these; both are written out kind by kind (no default), so a new
// kind does not compile (-Werror=switch) until it is classified.
bool is_compute(Kind kind);  // F, B, I, W, OVERLAP_F_B, S, T
bool is_comm(Kind kind);     // SEND_*, RECV_* (point to point; not the collectives)
bool is_backward(Kind kind); // B or I: the action that consumes the output gradient
bool is_collective(Kind kind);  // BCAST_F, ALLREDUCE_S, REDUCE_B
bool is_vocab(Kind kind);       // S, T and the collectives

// A value: {stage, kind, microbatch}; OVERLAP_F_B carries its sub-actions instead
// (its own stage and microbatch are -1, as in PyTorch).
struct Action {
  int32_t stage = -1;
  Kind kind = Kind::F;
  int32_t microbatch = -1;
  std::vector<Action> sub;

  Action() = default;
  Action(int32_t s, Kind k, int32_t mb) : stage(s), kind(k), microbatch(mb) {}
  static Action overlap(std::vector<Action> parts);

  bool operator==(const Action& o) const {
    return stage == o.stage && kind == o.kind && microbatch == o.microbatch && sub == o.sub;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

// Canonical strings: "2F0", "1I3", "3SEND_F1", "(1F1;2B0)OVERLAP_F_B", "1S0", "0BCAST_F2".
std::string to_string(const Action& a);
void append_string(std::string& out, const Action& a);
// Exact inverse of to_string; throws ScheduleError on anything else.
Action parse_action(std::string_view text);

}  // namespace zbpipe
