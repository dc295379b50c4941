// The vocabulary rule of vocab.h as the passes and the simulator check it: which collectives
// every rank has posted, what a vocabulary action (or the last stage's backward) waits for in a
// run, and validate()'s structural checks of a program's vocabulary actions.
#pragma once

#include <cstdint>
#include <vector>

#include "action_table.h"
#include "zbpipe/program.h"
#include "zbpipe/vocab.h"

namespace zbpipe::detail {

// Posts of every collective (kind, microbatch) during a run: complete once every rank posted.
class CollectivePosts {
 public:
  CollectivePosts(int pp, int microbatches) : pp_(pp), count_(static_cast<size_t>(microbatches) * 3, 0) {}
  // One rank's post; returns whether it completed the collective.
  bool post(Kind k, int mb) { return ++count_[index(k, mb)] == pp_; }
  bool complete(Kind k, int mb) const { return count_[index(k, mb)] == pp_; }

 private:
  static size_t index(Kind k, int mb) {
    return static_cast<size_t>(mb) * 3 + (k == Kind::BCAST_F ? 0 : k == Kind::ALLREDUCE_S ? 1 : 2);
  }
  int pp_;
  std::vector<int> count_;
};

// What the vocabulary rule adds to a run's readiness: the collective an S (BCAST_F), a T or a
// REDUCE_B (ALLREDUCE_S) or the last stage's backward (REDUCE_B) waits for; Kind::F when none.
inline Kind awaited_collective(const Program& p, const Action& part) {
  switch (part.kind) {
    case Kind::S: return Kind::BCAST_F;
    case Kind::T:
    case Kind::REDUCE_B: return Kind::ALLREDUCE_S;
    default: return needs_vocab_grad(p, part) ? Kind::REDUCE_B : Kind::F;
  }
}

// validate()'s checks of the vocabulary actions (vocab.h), given the positions of every action
// (1-based index on its rank, 0 = absent): each rank runs each of its actions once per
// microbatch (S, BCAST_F, ALLREDUCE_S; training also T and REDUCE_B; forward-only neither), in
// the local order of the rule, the root's BCAST_F after the last stage's F and its REDUCE_B
// before that stage's backward, and every rank posts the collectives in the same order.
// Throws ScheduleError with the grid marked.
void check_vocab(const Program& p, const ActionTable<int32_t>& pos, bool forward_only);

}  // namespace zbpipe::detail
