// CustomRun: the registered function, the kinds it replaces, and the parts it ran
// (custom_run.h).
#include "runtime/custom_run.h"

#include "zbpipe/error.h"

namespace zbpipe::runtime {

void CustomRun::set(std::shared_ptr<CustomActions> handler, const std::vector<Kind>& kinds) {
  uint32_t mask = 0;
  for (Kind k : kinds) {
    ZB_CHECK(is_compute(k), "custom functions replace compute actions only, got kind ",
             static_cast<int>(k));
    mask |= 1u << static_cast<int>(k);
  }
  handler_ = mask ? std::move(handler) : nullptr;
  kinds_ = handler_ ? mask : 0;
}

size_t CustomRun::run(const Action& action, const std::vector<Entry>& entries, size_t first) {
  const int index = entries[first].index;
  size_t end = first;
  while (end < entries.size() && !entries[end].is_comm() && entries[end].index == index) ++end;
  part_ = Running{&action, &entries, first, end, std::vector<uint8_t>(end - first, 0)};
  struct Done {  // no part runs outside the handler's call, whatever it throws
    Running& part;
    ~Done() { part = Running{}; }
  } done{part_};
  handler_->run(action);
  for (size_t j = first; j < end; ++j) {
    if (part_.done[j - first]) continue;
    const Entry& e = entries[j];
    throw Error(detail::str("the custom function for '", to_string(action),
                            "' returned without running its part '",
                            to_string(Action(e.stage, e.kind, e.mb)),
                            "' (it must call ctx.run(part) once for every part)"));
  }
  return end - 1;
}

void CustomRun::run_part(const Action& part, const std::function<void(size_t)>& run_entry) {
  ZB_CHECK(part_.end > part_.begin, "run_part('", to_string(part),
           "') called outside a custom function of a running step");
  for (size_t j = part_.begin; j < part_.end; ++j) {
    const Entry& e = (*part_.entries)[j];
    if (e.kind != part.kind || e.stage != part.stage || e.mb != part.microbatch) continue;
    ZB_CHECK(!part_.done[j - part_.begin], "'", to_string(part),
             "' already ran in this custom function");
    run_entry(j);
    part_.done[j - part_.begin] = 1;
    return;
  }
  throw Error(detail::str("'", to_string(part), "' is not a part of the action '", to_string(*part_.action),
                          "' this custom function runs"));
}

}  // namespace zbpipe::runtime
