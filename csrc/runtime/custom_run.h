// register_custom_function's protocol: an action of a registered kind runs through the user's
// function (CustomActions), which must run each of its compute parts exactly once through
// run_part. CustomRun keeps the function, the kinds it replaces and, while an action runs,
// which of its parts ran.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/custom_actions.h"
#include "runtime/dispatch.h"

namespace zbpipe::runtime {

// Not thread-safe: the executor's thread only (the function runs there, and so does run_part).
class CustomRun {
 public:
  // Actions of `kinds` (compute kinds) run through `handler` from now on; an empty list or a
  // null handler restores the built-in computation. Throws zbpipe::Error for a kind that is
  // not a compute kind.
  void set(std::shared_ptr<CustomActions> handler, const std::vector<Kind>& kinds);
  // Whether a program action of `kind` runs through the handler (an OVERLAP_F_B unit's kind
  // decides, not its parts'). Inline: asked once per entry.
  bool runs(Kind kind) const { return handler_ && (kinds_ >> static_cast<int>(kind) & 1u); }
  // Runs `action` through the handler; its parts are the compute entries of its index from
  // entries[first] on. Returns the index of its last entry. Throws zbpipe::Error when the
  // handler returned without running a part; what the handler throws.
  size_t run(const Action& action, const std::vector<Entry>& entries, size_t first);
  // From inside the handler: runs `part` (the running action or one of its sub-actions) by
  // calling `run_entry` with its entry's index. Throws zbpipe::Error outside a running action,
  // for a part not of it, or for one that already ran; what run_entry throws.
  void run_part(const Action& part, const std::function<void(size_t)>& run_entry);

 private:
  // The action running now: its entries [begin, end) and which of them ran.
  struct Running {
    const Action* action = nullptr;
    const std::vector<Entry>* entries = nullptr;
    size_t begin = 0, end = 0;
    std::vector<uint8_t> done;
  };

  std::shared_ptr<CustomActions> handler_;  // register_custom_function's, or null
  uint32_t kinds_ = 0;                      // bit k: Kind k runs through handler_
  Running part_;
};

}  // namespace zbpipe::runtime
