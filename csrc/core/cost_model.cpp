// CostModel accessors: one value per stage or one for all.
#include "zbpipe/cost_model.h"

#include "zbpipe/error.h"

namespace zbpipe {

namespace {
double pick(const std::vector<double>& v, int stage) { return v.size() == 1 ? v[0] : v.at(stage); }

void check_vec(const char* name, const std::vector<double>& v, int num_stages, bool may_be_empty) {
  if (v.empty() && may_be_empty) return;
  ZB_SCHEDULE_CHECK(v.size() == 1 || static_cast<int>(v.size()) == num_stages, "cost '", name,
                    "' needs 1 value or one per stage (", num_stages, "), got ", v.size());
  for (double x : v)
    ZB_SCHEDULE_CHECK(x >= 0.0, "cost '", name, "' must be non-negative, got ", x);
}
}  // namespace

double CostModel::forward(int stage) const { return pick(f, stage); }
double CostModel::backward_input(int stage) const { return pick(b, stage); }
double CostModel::backward_weight(int stage) const { return pick(w, stage); }
double CostModel::backward_full(int stage) const {
  return b_full.empty() ? backward_input(stage) + backward_weight(stage) : pick(b_full, stage);
}

void CostModel::check(int num_stages) const {
  check_vec("f", f, num_stages, false);
  check_vec("b", b, num_stages, false);
  check_vec("w", w, num_stages, false);
  check_vec("b_full", b_full, num_stages, true);
  ZB_SCHEDULE_CHECK(comm >= 0.0, "cost 'comm' must be non-negative, got ", comm);
}

}  // namespace zbpipe
