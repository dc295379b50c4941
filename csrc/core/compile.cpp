// The compile pipeline: size check -> build (compute only) -> insert_send_recv -> validate.
#include "zbpipe/compile.h"

#include <algorithm>
#include <limits>

#include "zbpipe/error.h"
#include "zbpipe/limits.h"
#include "zbpipe/passes.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

Program lower(const Program& compute_only) {
  ZB_SCHEDULE_CHECK(!compute_only.has_comms(), "lower() expects a compute-only program, but '",
                    compute_only.schedule, "' already has communication actions");
  Program lowered = insert_send_recv(compute_only);
  validate(lowered);
  return lowered;
}

void check_build_size(const std::string& schedule, int64_t pp, int64_t microbatches,
                      int64_t stages_per_rank) {
  const int64_t spr = std::max<int64_t>(stages_per_rank, 1);
  // Saturates instead of overflowing: any such count is refused.
  const int64_t stages = pp <= 0 ? 0
                         : pp > std::numeric_limits<int64_t>::max() / spr
                             ? std::numeric_limits<int64_t>::max()
                             : pp * spr;
  check_program_size(detail::str("schedule '", schedule, "' (pp=", pp, ", microbatches=",
                                 microbatches, stages_per_rank > 0 ? ", stages_per_rank=" : "",
                                 stages_per_rank > 0 ? std::to_string(stages_per_rank) : "", ")"),
                     {pp, stages, microbatches});
}

Program build(const std::string& schedule, const BuildArgs& args) {
  const ScheduleInfo& info = find_schedule(schedule);
  check_build_size(schedule, args.pp, args.microbatches, args.stages_per_rank);
  return info.build(args);
}

Program compile(const std::string& schedule, const BuildArgs& args) {
  check_options(find_schedule(schedule), args);
  if (!args.vocab_parallel) return lower(build(schedule, args));
  Program with_vocab = place_vocab(build(schedule, args), args.costs, args.vocab, args.memory);
  validate(with_vocab);
  return with_vocab;
}

}  // namespace zbpipe
