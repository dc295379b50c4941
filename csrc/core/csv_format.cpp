// PyTorch CSV layout import/export.
#include "zbpipe/csv_format.h"

#include <algorithm>
#include <cstdint>

#include "passes/action_table.h"
#include "zbpipe/cancel.h"
#include "zbpipe/compile.h"
#include "zbpipe/error.h"
#include "zbpipe/limits.h"
#include "zbpipe/passes.h"

namespace zbpipe {

namespace {
// PyTorch's lowering also emits FSDP bookkeeping (1UNSHARD, 1RESHARD, 1REDUCE_GRAD). They carry
// no pipeline data or ordering constraint, and zbpipe does not shard, so import drops them.
bool is_fsdp_bookkeeping(std::string_view cell) {
  size_t i = 0;
  while (i < cell.size() && cell[i] >= '0' && cell[i] <= '9') ++i;
  std::string_view rest = cell.substr(i);
  for (std::string_view name : {"UNSHARD", "RESHARD", "REDUCE_GRAD"})
    if (i > 0 && rest.substr(0, name.size()) == name) return true;
  return false;
}

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.back())) s.remove_suffix(1);
  return s;
}

// What from_csv would allocate for, counted in one pass over the text: the rows up to the last
// line with a cell, and the non-blank cells.
struct CsvShape {
  int64_t rows = 0, cells = 0;
};
CsvShape measure_csv(std::string_view text) {
  CsvShape shape;
  int64_t line = 1;
  bool in_cell = false;
  for (char c : text) {
    if (c == '\n' || c == ',') {
      if (c == '\n') ++line;
      in_cell = false;
    } else if (!is_blank(c) && !in_cell) {
      in_cell = true;
      ++shape.cells;
      shape.rows = line;
    }
  }
  return shape;
}
}  // namespace

std::string to_csv(const Program& p) {
  std::string out;
  for (const auto& acts : p.ranks) {
    for (size_t i = 0; i < acts.size(); ++i) {
      if (i) out += ',';
      append_string(out, acts[i]);
    }
    out += "\r\n";  // what Python's csv.writer emits
  }
  return out;
}

Program from_csv(const std::string& text) {
  // Refuse oversized input before allocating in proportion to it (limits.h).
  const CsvShape shape = measure_csv(text);
  check_program_size("CSV schedule", {shape.rows, 0, 0, shape.cells});
  Program p;
  p.schedule = "csv";
  p.ranks.reserve(static_cast<size_t>(shape.rows));
  size_t begin = 0;
  int64_t line_no = 0;
  while (begin < text.size() && line_no < shape.rows) {  // the blank lines after are no ranks
    poll_cancel();
    size_t nl = text.find('\n', begin);
    std::string_view line(text.data() + begin, (nl == std::string::npos ? text.size() : nl) - begin);
    begin = nl == std::string::npos ? text.size() : nl + 1;
    ++line_no;
    std::vector<Action> row;
    size_t cell_begin = 0;
    while (cell_begin <= line.size()) {
      size_t comma = line.find(',', cell_begin);
      std::string_view cell = trim(line.substr(
          cell_begin, comma == std::string_view::npos ? std::string_view::npos : comma - cell_begin));
      if (!cell.empty() && !is_fsdp_bookkeeping(cell)) {
        try {
          row.push_back(parse_action(cell));
        } catch (const ScheduleError& e) {
          throw ScheduleError(detail::str("CSV line ", line_no, ": ", e.what()));
        }
      }
      if (comma == std::string_view::npos) break;
      cell_begin = comma + 1;
    }
    p.ranks.push_back(std::move(row));
  }
  // Trailing empty lines are not ranks.
  while (!p.ranks.empty() && p.ranks.back().empty()) p.ranks.pop_back();
  ZB_SCHEDULE_CHECK(!p.ranks.empty(), "CSV schedule has no rows");
  p.pp = static_cast<int>(p.ranks.size());
  int max_stage = -1, max_mb = -1;
  for (const auto& acts : p.ranks)
    for (const auto& a : acts)
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        max_stage = std::max(max_stage, s->stage);
        max_mb = std::max(max_mb, s->microbatch);
      }
  p.num_stages = max_stage + 1;
  p.microbatches = max_mb + 1;
  check_program_size("CSV schedule", {p.pp, p.num_stages, p.microbatches});
  p.stage_to_rank.assign(p.num_stages, -1);
  for (int r = 0; r < p.pp; ++r)
    for (const auto& a : p.ranks[r])
      for (const Action* s = detail::parts_begin(a); s != detail::parts_end(a); ++s) {
        int& owner = p.stage_to_rank[s->stage];
        ZB_SCHEDULE_CHECK(owner == -1 || owner == r, "CSV schedule: stage ", s->stage,
                          " appears on rank ", owner, " and on rank ", r);
        owner = r;
      }
  for (int s = 0; s < p.num_stages; ++s)
    ZB_SCHEDULE_CHECK(p.stage_to_rank[s] != -1, "CSV schedule: stage ", s, " never appears");
  if (p.has_comms()) {
    validate(p);
    return p;
  }
  return lower(p);
}

}  // namespace zbpipe
