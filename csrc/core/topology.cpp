// Stage -> rank mappings shared by the builders and by CSV import.
#include "zbpipe/topology.h"

#include "zbpipe/error.h"

namespace zbpipe {

std::vector<int> make_topology(const std::string& style, int pp, int num_stages) {
  ZB_SCHEDULE_CHECK(pp >= 1, "pp must be >= 1, got pp=", pp);
  ZB_SCHEDULE_CHECK(num_stages % pp == 0, "num_stages must be a multiple of pp, got num_stages=",
                    num_stages, ", pp=", pp);
  std::vector<int> map(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    int pass = s / pp, within = s % pp;
    if (style == "loop") {
      map[s] = within;
    } else if (style == "v") {
      // Even passes go down the ranks, odd passes come back up: the V shape.
      map[s] = (pass % 2 == 0) ? within : pp - 1 - within;
    } else {
      throw ScheduleError(detail::str("unknown topology '", style, "' (valid: loop, v)"));
    }
  }
  return map;
}

}  // namespace zbpipe
