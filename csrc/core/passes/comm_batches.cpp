// The runtime's batching rule: adjacent communication actions go out as one batch.
#include "zbpipe/passes.h"

namespace zbpipe {

std::vector<CommBatch> comm_batches(const std::vector<Action>& acts, bool split_overlap) {
  std::vector<CommBatch> out;
  const int n = static_cast<int>(acts.size());
  for (int i = 0; i < n;) {
    if (!is_comm(acts[i].kind)) {
      ++i;
      continue;
    }
    int end = i;
    while (end < n && is_comm(acts[end].kind)) ++end;
    if (split_overlap && i > 0 && acts[i - 1].kind == Kind::OVERLAP_F_B) {
      const Action& unit = acts[i - 1];
      const Action& first = acts[i];
      for (const Action& part : unit.sub)
        if (part.kind == Kind::F && first.kind == Kind::SEND_F && first.stage == part.stage &&
            first.microbatch == part.microbatch) {
          out.push_back({i, i + 1, true});
          ++i;
          break;
        }
    }
    if (i < end) out.push_back({i, end, false});
    i = end;
  }
  return out;
}

}  // namespace zbpipe
