// Program queries and the per-rank grid used in every error message.
#include "zbpipe/program.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "zbpipe/error.h"

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

namespace {
uint64_t fnv1a(uint64_t h, const std::string& s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}
}  // namespace

std::string fingerprint(const Program& p) {
  uint64_t h = 1469598103934665603ull;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    h = fnv1a(h, "|rank" + std::to_string(r));
    for (const auto& a : p.ranks[r]) h = fnv1a(h, " " + to_string(a));
  }
  std::string placement;
  for (size_t s = 0; s < p.stage_to_rank.size(); ++s)
    placement += (s ? "," : "") + std::to_string(p.stage_to_rank[s]);
  char hash[20];
  std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(h));
  return detail::str("pp=", p.pp, " stages=", p.num_stages, " microbatches=", p.microbatches,
                     " stage_to_rank=[", placement, "] actions=#", hash);
}

bool same_program(const Program& a, const Program& b) {
  return a.pp == b.pp && a.num_stages == b.num_stages && a.microbatches == b.microbatches &&
         a.stage_to_rank == b.stage_to_rank && a.ranks == b.ranks;
}

namespace {
// The window of [0, n) of at most `most` entries that centres `mark` (starts at 0 without one).
std::pair<size_t, size_t> window(size_t n, size_t most, int mark) {
  if (n <= most) return {0, n};
  size_t begin = mark < 0 ? 0 : static_cast<size_t>(mark) >= most / 2 ? mark - most / 2 : 0;
  begin = std::min(begin, n - most);
  return {begin, begin + most};
}
}  // namespace

std::string format_program(const Program& p, int mark_rank, int mark_index) {
  size_t rows = 0;
  for (const auto& acts : p.ranks) rows = std::max(rows, acts.size());
  // Only a window of a large program: every error message carries this grid, and the whole of
  // it grows as ranks x the longest rank (quadratic in the actions).
  const auto [r0, r1] = window(p.ranks.size(), kGridRanks, mark_rank);
  const auto [i0, i1] = window(rows, kGridSteps, mark_index);
  std::vector<std::vector<std::string>> cells(r1 - r0);
  // Wide enough for every shown cell and header ("rank 16383"), so columns never touch.
  size_t width = std::max<size_t>(6, r1 > 0 ? 5 + std::to_string(r1 - 1).size() : 0);
  for (size_t r = r0; r < r1; ++r) {
    for (size_t i = i0; i < std::min(i1, p.ranks[r].size()); ++i) {
      std::string c = to_string(p.ranks[r][i]);
      if (static_cast<int>(r) == mark_rank && static_cast<int>(i) == mark_index) c = ">>" + c + "<<";
      width = std::max(width, c.size());
      cells[r - r0].push_back(std::move(c));
    }
  }
  width += 1;
  auto pad = [&](std::string s) {
    s.resize(std::max(s.size(), width), ' ');
    return s;
  };
  std::string out;
  if (r1 - r0 < p.ranks.size())
    out += detail::str("(ranks ", r0, " to ", r1 - 1, " of ", p.ranks.size(), " shown)\n");
  out += pad("step");
  for (size_t r = r0; r < r1; ++r) out += pad("rank " + std::to_string(r));
  out += '\n';
  if (i0 > 0) out += detail::str("(", i0, " steps before not shown)\n");
  for (size_t i = i0; i < i1; ++i) {
    std::string line = pad(std::to_string(i));
    for (size_t r = r0; r < r1; ++r) {
      const auto& mine = cells[r - r0];
      line += pad(i - i0 < mine.size() ? mine[i - i0] : "");
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  }
  if (i1 < rows) out += detail::str("(", rows - i1, " steps after not shown)\n");
  return out;
}

}  // namespace zbpipe
