// Program queries and the per-rank grid used in every error message.
#include "zbpipe/program.h"

#include <algorithm>

namespace zbpipe {

std::vector<int> Program::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < static_cast<int>(stage_to_rank.size()); ++s)
    if (stage_to_rank[s] == rank) out.push_back(s);
  return out;
}

bool Program::has_comms() const {
  for (const auto& acts : ranks)
    for (const auto& a : acts)
      if (is_comm(a.kind)) return true;
  return false;
}

std::string format_program(const Program& p, int mark_rank, int mark_index) {
  size_t rows = 0;
  for (const auto& acts : p.ranks) rows = std::max(rows, acts.size());
  std::vector<std::vector<std::string>> cells(p.ranks.size());
  size_t width = 6;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    for (size_t i = 0; i < p.ranks[r].size(); ++i) {
      std::string c = to_string(p.ranks[r][i]);
      if (static_cast<int>(r) == mark_rank && static_cast<int>(i) == mark_index) c = ">>" + c + "<<";
      width = std::max(width, c.size());
      cells[r].push_back(std::move(c));
    }
  }
  width += 1;
  auto pad = [&](std::string s) {
    s.resize(std::max(s.size(), width), ' ');
    return s;
  };
  std::string out = pad("step");
  for (size_t r = 0; r < p.ranks.size(); ++r) out += pad("rank " + std::to_string(r));
  out += '\n';
  for (size_t i = 0; i < rows; ++i) {
    std::string line = pad(std::to_string(i));
    for (size_t r = 0; r < p.ranks.size(); ++r) line += pad(i < cells[r].size() ? cells[r][i] : "");
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  }
  return out;
}

}  // namespace zbpipe
