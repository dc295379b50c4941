// CostModel accessors: one value per stage or one for all.
#include "zbpipe/cost_model.h"

#include <algorithm>
#include <cmath>

#include "zbpipe/error.h"

namespace zbpipe {

namespace {
double pick(const std::vector<double>& v, int stage) { return v.size() == 1 ? v[0] : v.at(stage); }

// inf or nan would make every time inf or nan: the list scheduler could not order anything,
// and the simulator's bubble rate would be nan.
void check_value(const char* name, double x) {
  ZB_SCHEDULE_CHECK(std::isfinite(x) && x >= 0.0, "cost '", name,
                    "' must be finite and non-negative, got ", x);
}

void check_vec(const char* name, const std::vector<double>& v, int num_stages, bool may_be_empty) {
  if (v.empty() && may_be_empty) return;
  ZB_SCHEDULE_CHECK(v.size() == 1 || static_cast<int>(v.size()) == num_stages, "cost '", name,
                    "' needs 1 value or one per stage (", num_stages, "), got ", v.size());
  for (double x : v) check_value(name, x);
}
}  // namespace

double CostModel::forward(int stage) const { return pick(f, stage); }
double CostModel::backward_input(int stage) const { return pick(b, stage); }
double CostModel::backward_weight(int stage) const { return pick(w, stage); }
double CostModel::backward_full(int stage) const {
  return b_full.empty() ? backward_input(stage) + backward_weight(stage) : pick(b_full, stage);
}

void CostModel::check(int num_stages, int microbatches, int pp) const {
  check_vec("f", f, num_stages, false);
  check_vec("b", b, num_stages, false);
  check_vec("w", w, num_stages, false);
  check_vec("b_full", b_full, num_stages, true);
  check_value("comm", comm);
  // Finite costs can still sum to inf (f=1e308, b=1e308): every time would then be inf and
  // every bubble rate nan, and the list scheduler could order nothing.
  double per_microbatch = 0.0;
  for (int s = 0; s < num_stages; ++s)
    per_microbatch += forward(s) + std::max(backward_input(s) + backward_weight(s), backward_full(s)) +
                      2 * comm;
  const double total = per_microbatch * std::max(microbatches, 1) * std::max(pp, 1);
  ZB_SCHEDULE_CHECK(total <= kMaxTotalTime, "costs overflow the simulation: the total work ",
                    "(microbatches x the sum over stages of f + b + w + 2 comm) times pp is ", total,
                    ", above ", kMaxTotalTime, " (f=", f[0], f.size() > 1 ? ",..." : "", " b=", b[0],
                    b.size() > 1 ? ",..." : "", " w=", w[0], w.size() > 1 ? ",..." : "",
                    " comm=", comm, ", ", num_stages, " stages, ", microbatches, " microbatches, pp=",
                    pp, ")");
}

}  // namespace zbpipe
