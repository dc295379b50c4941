// Dense per-(stage, microbatch, kind) lookup used by the passes and the simulator: O(1) checks
// without hashing, sized once per program.
#pragma once

#include <vector>

#include "zbpipe/action.h"
#include "zbpipe/program.h"

namespace zbpipe::detail {

template <typename T>
class ActionTable {
 public:
  static constexpr int kKinds = 9;
  ActionTable(int num_stages, int microbatches, T init)
      : stages_(num_stages), mbs_(microbatches),
        data_(static_cast<size_t>(num_stages) * microbatches * kKinds, init) {}
  bool in_range(int stage, int mb) const { return stage >= 0 && stage < stages_ && mb >= 0 && mb < mbs_; }
  T& at(int stage, Kind k, int mb) {
    return data_[(static_cast<size_t>(stage) * mbs_ + mb) * kKinds + static_cast<int>(k)];
  }
  const T& at(int stage, Kind k, int mb) const {
    return data_[(static_cast<size_t>(stage) * mbs_ + mb) * kKinds + static_cast<int>(k)];
  }

 private:
  int stages_, mbs_;
  std::vector<T> data_;
};

// The compute actions an action stands for: its sub-actions for OVERLAP_F_B, else itself.
inline const Action* parts_begin(const Action& a) { return a.sub.empty() ? &a : a.sub.data(); }
inline const Action* parts_end(const Action& a) { return a.sub.empty() ? &a + 1 : a.sub.data() + a.sub.size(); }

// Does this compute's result cross ranks (and so need a SEND/RECV pair)?
inline bool output_crosses(const Program& p, const Action& a) {
  if (a.kind == Kind::F)
    return a.stage + 1 < p.num_stages && p.rank_of(a.stage + 1) != p.rank_of(a.stage);
  if (is_backward(a.kind)) return a.stage > 0 && p.rank_of(a.stage - 1) != p.rank_of(a.stage);
  return false;
}

}  // namespace zbpipe::detail
