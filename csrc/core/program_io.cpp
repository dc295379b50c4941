// Programs as text: action strings per rank, CSV text and CSV files (see program_io.h).
#include "zbpipe/program_io.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
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

namespace {

// The offset of the first byte of `text` that is not UTF-8, or npos.
size_t first_non_utf8(const std::string& text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > n) return i;
    for (size_t k = 1; k < len; ++k)
      if ((s[i + k] >> 6) != 0x2) return i;
    if ((len == 2 && c < 0xC2) || (len == 3 && c == 0xE0 && s[i + 1] < 0xA0) ||
        (len == 4 && ((c == 0xF0 && s[i + 1] < 0x90) || c > 0xF4 || (c == 0xF4 && s[i + 1] > 0x8F))))
      return i;  // overlong forms and code points above U+10FFFF
    i += len;
  }
  return std::string::npos;
}

}  // namespace

Program read_csv_file(const std::string& path, bool rendezvous) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  ZB_SCHEDULE_CHECK(!ec && fs::exists(st), "cannot open CSV schedule '", path, "': no such file");
  ZB_SCHEDULE_CHECK(!fs::is_directory(st), "cannot read CSV schedule '", path, "': it is a directory");
  ZB_SCHEDULE_CHECK(fs::is_regular_file(st), "cannot read CSV schedule '", path,
                    "': not a regular file (a FIFO, device or socket; zbpipe reads schedules from "
                    "regular files only)");
  const auto size = fs::file_size(path, ec);
  ZB_SCHEDULE_CHECK(!ec && static_cast<int64_t>(size) <= kMaxCsvBytes, "cannot read CSV schedule '", path,
                    "': ", ec ? ec.message() : detail::str(size, " bytes is above zbpipe's limit of ",
                                                           kMaxCsvBytes, " bytes for a CSV schedule"));
  std::ifstream f(path, std::ios::binary);
  ZB_SCHEDULE_CHECK(f.good(), "cannot open CSV schedule '", path, "'");
  // Read to EOF, not to the size stat gave: /proc and other generated files report 0 bytes,
  // and a file may grow or shrink meanwhile. The limit still holds for what is read.
  std::string text;
  text.reserve(static_cast<size_t>(size));
  char chunk[1 << 16];
  while (f.read(chunk, sizeof chunk) || f.gcount() > 0) {
    text.append(chunk, static_cast<size_t>(f.gcount()));
    ZB_SCHEDULE_CHECK(static_cast<int64_t>(text.size()) <= kMaxCsvBytes, "cannot read CSV schedule '",
                      path, "': more than zbpipe's limit of ", kMaxCsvBytes,
                      " bytes for a CSV schedule");
    poll_cancel();
  }
  if (const size_t bad = first_non_utf8(text); bad != std::string::npos) {
    const size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + bad, '\n'));
    char hex[8];
    std::snprintf(hex, sizeof(hex), "0x%02X", static_cast<unsigned char>(text[bad]));
    throw ScheduleError(detail::str("cannot read CSV schedule '", path, "': byte ", hex, " at byte offset ", bad,
                                    " (line ", line, ") is not UTF-8"));
  }
  return program_from_csv_text(text, rendezvous);
}

void write_csv_file(const Program& p, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  ZB_CHECK(f.good(), "cannot open '", path, "' for writing");
  f << to_csv(p);
  ZB_CHECK(f.good(), "writing '", path, "' failed");
}

}  // namespace zbpipe
