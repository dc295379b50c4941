// Pass: keep only the forwards of a compute-only program (evaluation with a training schedule).
#include "action_table.h"
#include "zbpipe/error.h"
#include "zbpipe/passes.h"

namespace zbpipe {

Program strip_backward(const Program& compute_only) {
  ZB_SCHEDULE_CHECK(!compute_only.has_comms(), "strip_backward expects a compute-only program, but '",
                    compute_only.schedule, "' has communication actions");
  Program p = compute_only;
  p.schedule += "(forward)";
  for (auto& acts : p.ranks) {
    std::vector<Action> kept;
    kept.reserve(acts.size() / 2);
    for (const auto& a : acts)
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s)
        if (s->kind == Kind::F) kept.push_back(*s);
    acts = std::move(kept);
  }
  return p;
}

}  // namespace zbpipe
