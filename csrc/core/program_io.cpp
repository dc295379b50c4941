// Programs as text: action strings per rank, CSV text and CSV files (see program_io.h).
#include "zbpipe/program_io.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>

#include "zbpipe/cancel.h"
#include "zbpipe/compile.h"
#include "zbpipe/csv_format.h"
#include "zbpipe/error.h"
#include "zbpipe/limits.h"
#include "zbpipe/passes.h"

namespace zbpipe {

namespace {
Program checked(Program p, bool rendezvous) {
  if (rendezvous) validate_rendezvous(p);
  return p;
}
}  // namespace

const std::vector<Action>& rank_actions(const Program& p, int rank) {
  ZB_SCHEDULE_CHECK(rank >= 0 && rank < p.pp, "rank must be in [0, ", p.pp, "), got rank=", rank);
  return p.ranks[rank];
}

std::vector<std::string> action_strings(const Program& p, int rank, bool compute_only) {
  const auto& acts = rank_actions(p, rank);
  std::vector<std::string> out;
  out.reserve(acts.size());
  for (const auto& a : acts)
    if (!compute_only || is_compute(a.kind)) out.push_back(to_string(a));
  return out;
}

Program program_from_actions(const std::vector<std::vector<std::string>>& ranks,
                             const std::vector<int>& stage_to_rank, int64_t microbatches,
                             const std::string& name, bool rendezvous) {
  int64_t actions = 0;
  for (const auto& row : ranks) actions += static_cast<int64_t>(row.size());
  check_program_size(detail::str("Program.from_actions('", name, "')"),
                     {static_cast<int64_t>(ranks.size()), static_cast<int64_t>(stage_to_rank.size()),
                      microbatches, actions});
  Program p;
  p.schedule = name;
  p.pp = static_cast<int>(ranks.size());
  p.stage_to_rank = stage_to_rank;
  p.num_stages = static_cast<int>(stage_to_rank.size());
  // At most the limit here; a negative one stays negative for validate() to name.
  p.microbatches = static_cast<int>(std::max<int64_t>(microbatches, INT32_MIN));
  for (const auto& row : ranks) {
    std::vector<Action> acts;
    acts.reserve(row.size());
    for (const auto& s : row) {
      poll_cancel();
      acts.push_back(parse_action(s));
    }
    p.ranks.push_back(std::move(acts));
  }
  if (p.has_comms()) validate(p);
  else p = lower(p);
  return checked(std::move(p), rendezvous);
}

Program program_from_csv_text(const std::string& text, bool rendezvous) {
  return checked(from_csv(text), rendezvous);
}

Program read_csv_file(const std::string& path, bool rendezvous) {
  std::ifstream f(path, std::ios::binary);
  ZB_SCHEDULE_CHECK(f.good(), "cannot open CSV schedule '", path, "'");
  std::stringstream text;
  text << f.rdbuf();
  return program_from_csv_text(text.str(), rendezvous);
}

void write_csv_file(const Program& p, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  ZB_CHECK(f.good(), "cannot open '", path, "' for writing");
  f << to_csv(p);
  ZB_CHECK(f.good(), "writing '", path, "' failed");
}

}  // namespace zbpipe
