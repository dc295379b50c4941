// Dense per-(stage, microbatch, kind) lookup used by the passes and the simulator: O(1) checks
// without hashing, sized once per program.
#pragma once

#include <vector>

#include "zbpipe/action.h"
#include "zbpipe/dependencies.h"
#include "zbpipe/program.h"

namespace zbpipe::detail {

template <typename T>
class ActionTable {
 public:
  static constexpr int kKinds = kNumKinds;
  ActionTable(int num_stages, int microbatches, T init)
      : stages_(num_stages), mbs_(microbatches), unset_(init),
        data_(static_cast<size_t>(num_stages) * microbatches * kKinds, init) {}
  bool in_range(int stage, int mb) const { return stage >= 0 && stage < stages_ && mb >= 0 && mb < mbs_; }
  T& at(int stage, Kind k, int mb) {
    return data_[(static_cast<size_t>(stage) * mbs_ + mb) * kKinds + static_cast<int>(k)];
  }
  const T& at(int stage, Kind k, int mb) const {
    return data_[(static_cast<size_t>(stage) * mbs_ + mb) * kKinds + static_cast<int>(k)];
  }
  // The entry of what producer `d` names for microbatch `mb` (the initial value while unset):
  // a "B or I" producer reads B's entry, else I's (a stage runs one of the two).
  const T& of(const Producer& d, int mb) const {
    if (!d.either_backward()) return at(d.stage, d.kind, mb);
    const T& b = at(d.stage, Kind::B, mb);
    return b != unset_ ? b : at(d.stage, Kind::I, mb);
  }
  bool met(const Producer& d, int mb) const { return of(d, mb) != unset_; }

 private:
  int stages_, mbs_;
  T unset_;
  std::vector<T> data_;
};

// The compute actions an action stands for: its sub-actions for OVERLAP_F_B, else itself.
inline const Action* parts_begin(const Action& a) { return a.sub.empty() ? &a : a.sub.data(); }
inline const Action* parts_end(const Action& a) { return a.sub.empty() ? &a + 1 : a.sub.data() + a.sub.size(); }

}  // namespace zbpipe::detail
