// register_custom_function's protocol: an action of a registered kind runs through the user's
// function, which must run each of its compute parts exactly once through run_part.
#include "runtime/errors.h"
#include "runtime/executor.h"
#include "runtime/trace_scope.h"

namespace zbpipe::runtime {

void Executor::set_custom_actions(std::shared_ptr<CustomActions> handler, const std::vector<Kind>& kinds) {
  uint32_t mask = 0;
  for (Kind k : kinds) {
    ZB_CHECK(is_compute(k), "custom functions replace compute actions only, got kind ",
             static_cast<int>(k));
    mask |= 1u << static_cast<int>(k);
  }
  custom_ = mask ? std::move(handler) : nullptr;
  custom_kinds_ = custom_ ? mask : 0;
}

size_t Executor::run_custom(size_t first) {
  const auto& entries = table_.entries;
  const int index = entries[first].index;
  size_t end = first;
  while (end < entries.size() && !entries[end].is_comm() && entries[end].index == index) ++end;
  const Action& action = program_.ranks[rank_][index];
  part_ = CustomRun{first, end, std::vector<uint8_t>(end - first, 0)};
  or_fail_step(index, [&] {
    custom_->run(action);
    for (size_t j = first; j < end; ++j) {
      if (part_.done[j - first]) continue;
      const Entry& e = entries[j];
      throw Error(detail::str("the custom function for '", to_string(action),
                              "' returned without running its part '",
                              to_string(Action(e.stage, e.kind, e.mb)),
                              "' (it must call ctx.run(part) once for every part)"));
    }
  });
  part_ = CustomRun{};
  return end - 1;
}

void Executor::run_part(const Action& part) {
  ZB_CHECK(part_.end > part_.begin, "run_part('", to_string(part),
           "') called outside a custom function of a running step");
  for (size_t j = part_.begin; j < part_.end; ++j) {
    const Entry& e = table_.entries[j];
    if (e.kind != part.kind || e.stage != part.stage || e.mb != part.microbatch) continue;
    ZB_CHECK(!part_.done[j - part_.begin], "'", to_string(part),
             "' already ran in this custom function");
    TraceRecord& rec = trace_[j];
    rec.wait_ns = 0;
    {
      TraceScope timed(rec, *timer_, j);
      run_synced(e, rec);  // a stage's last backward syncs its gradients here too
    }
    part_.done[j - part_.begin] = 1;
    return;
  }
  throw Error(detail::str("'", to_string(part), "' is not a part of the action '",
                          to_string(program_.ranks[rank_][table_.entries[part_.begin].index]),
                          "' this custom function runs"));
}

}  // namespace zbpipe::runtime
