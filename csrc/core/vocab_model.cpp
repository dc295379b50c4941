// VocabModel: the vocabulary head's per-rank costs and memory (see vocab.h).
#include <cmath>

#include "zbpipe/error.h"
#include "zbpipe/vocab.h"

namespace zbpipe {

namespace {
double pick(const std::vector<double>& v, int rank) { return v.size() == 1 ? v[0] : v.at(rank); }

void check_vec(const char* name, const std::vector<double>& v, int pp, bool may_be_empty) {
  if (v.empty() && may_be_empty) return;
  ZB_SCHEDULE_CHECK(v.size() == 1 || static_cast<int>(v.size()) == pp, "vocabulary '", name,
                    "' needs 1 value or one per rank (", pp, "), got ", v.size());
  for (double x : v)
    ZB_SCHEDULE_CHECK(std::isfinite(x) && x >= 0.0, "vocabulary '", name,
                      "' must be finite and non-negative, got ", x);
}
}  // namespace

double VocabModel::s_time(int rank) const { return pick(s, rank); }
double VocabModel::t_time(int rank) const { return pick(t, rank); }
double VocabModel::memory(int rank) const { return mem_s.empty() ? 0.0 : pick(mem_s, rank); }

void VocabModel::check(int pp) const {
  check_vec("s", s, pp, false);
  check_vec("t", t, pp, false);
  check_vec("mem_s", mem_s, pp, true);
  ZB_SCHEDULE_CHECK(std::isfinite(collective) && collective >= 0.0,
                    "vocabulary 'collective' must be finite and non-negative, got ", collective);
  ZB_SCHEDULE_CHECK(backlog >= 1, "vocabulary 'backlog' must be >= 1, got ", backlog);
  ZB_SCHEDULE_CHECK(lookahead >= 0, "vocabulary 'lookahead' must be >= 0, got ", lookahead);
}

bool has_vocab(const Program& p) {
  for (const auto& acts : p.ranks)
    for (const Action& a : acts)
      if (is_vocab(a.kind)) return true;
  return false;
}

}  // namespace zbpipe
