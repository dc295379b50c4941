// The policy-grid search behind zb_auto / v_half / v_min (search_list_schedules, see
// list_scheduler.h): the same pick as scoring every grid point, with three savings.
//   - Grid points that no knob check of a run tells apart build the same program: each run
//     narrows a set of grid points to those that decide as it did, and all of them are done.
//   - Once a candidate matches every reference it is the bar: a run stops as soon as one rank's
//     lower bound of its last end (clock plus remaining work, or its drain) exceeds that
//     candidate's makespan (it could only
//     lose), and all grid points still in its set stop with it.
//   - Candidates are scored from the scheduler's own simulated timing, and only the best one
//     is copied out.
#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "list_scheduler.h"
#include "zbpipe/error.h"
#include "zbpipe/simulator.h"

namespace zbpipe::detail {

namespace {

// Bubble rate is monotone in the longest span (total work is fixed), so spans are compared;
// rounding keeps float noise from choosing between equal schedules.
struct Score {
  double makespan, max_span, bubble;
  long memory;  // sum of per-rank peaks
};

double round9(double x) { return std::round(x * 1e9) / 1e9; }

Score make_score(double makespan, double max_span, double bubble, const std::vector<int>& peaks) {
  long mem = 0;
  for (int peak : peaks) mem += peak;
  return {round9(makespan), round9(max_span), round9(bubble), mem};
}

Score score_of(const SimResult& res) {
  return make_score(res.makespan, *std::max_element(res.span.begin(), res.span.end()),
                    res.bubble_rate, res.peak_activations);
}

// How much worse than `ref` a candidate is on its worse metric (1 = no worse on either).
double regret(const Score& c, const Score& ref) {
  auto ratio = [](double x, double y) {
    return y > 0.0 ? x / y : (x > 0.0 ? std::numeric_limits<double>::infinity() : 1.0);
  };
  return std::max(ratio(c.makespan, ref.makespan), ratio(c.max_span, ref.max_span));
}

bool fits_cap(const std::vector<int>& peaks, const std::vector<int>& cap) {
  for (size_t r = 0; r < peaks.size(); ++r)
    if (peaks[r] > cap[r]) return false;
  return true;
}

// Keeps the best candidate of each pool (see search_list_schedules): 0 = no worse than every
// reference, 1 = no worse than the primary, 2 = any. Once pool 0 has one, the others can no
// longer be picked and are not kept.
class Picker {
 public:
  Picker(std::vector<Score> refs, int primary) : refs_(std::move(refs)), primary_(primary) {}

  void offer(const Score& c, const Program& program) {
    double worst = 1.0;
    for (const Score& ref : refs_) worst = std::max(worst, round9(regret(c, ref)));
    const Key key{worst, c.makespan, c.bubble, c.memory};
    const bool pool[3] = {worst <= 1.0, primary_ >= 0 && regret(c, refs_[primary_]) <= 1.0, true};
    for (int t = 0; t < 3; ++t) {
      if (!pool[t] || (t > 0 && best_[0].set)) continue;
      if (!best_[t].set || key < best_[t].key) {
        best_[t].set = true;
        best_[t].key = key;
        best_[t].program = program;
      }
    }
  }

  // The makespan a run must stay within to still be picked (infinite while pool 0 is empty).
  double bound() const {
    if (!best_[0].set) return std::numeric_limits<double>::infinity();
    const double makespan = std::get<1>(best_[0].key);
    // Far above float noise in a run's running bound, far below any real difference.
    return makespan + 1e-6 * (1.0 + makespan);
  }

  Program take() {
    for (auto& b : best_)
      if (b.set) return std::move(b.program);
    ZB_CHECK(false, "search found no candidate schedule");
    return {};
  }

 private:
  using Key = std::tuple<double, double, double, long>;  // worst ratio, makespan, bubble, memory
  struct Best {
    bool set = false;
    Key key;
    Program program;
  };
  std::vector<Score> refs_;
  int primary_;
  Best best_[3];
};

// Grid point number `n` in the order the knobs nest (warm-up outermost, depth-first innermost).
PolicyIndex grid_point(const PolicyGrid& g, int n) {
  PolicyIndex at{};
  for (int k = kNumKnobs - 1; k >= 0; --k) {
    const int size = g.size(static_cast<Knob>(k));
    at[k] = n % size;
    n /= size;
  }
  return at;
}

}  // namespace

PolicyGrid PolicyGrid::standard(std::vector<std::vector<int>> warmups,
                                bool several_stages_per_rank) {
  using Order = ListPolicy::Order;
  PolicyGrid g;
  g.warmups = std::move(warmups);
  g.orders = {Order::kBackwardFirst, Order::kForwardFirst, Order::kAlternate};
  g.fills = {0.0, 0.5, 1.0, -1.0};
  g.avoids = {false, true};
  g.recycles = {false, true};
  // The knob only matters with several stages per rank.
  g.deeps = several_stages_per_rank ? std::vector<bool>{true, false} : std::vector<bool>{true};
  return g;
}

Program search_list_schedules(const Program& shell, const CostModel& costs,
                              const std::vector<int>& cap, const PolicyGrid& grid,
                              const std::vector<Seed>& seeds, bool exhaustive) {
  costs.check(shell.num_stages);
  // Seeds: the references first (every candidate is measured against all of them).
  std::vector<Score> seed_scores;
  std::vector<bool> seed_fits;
  std::vector<Score> refs;
  int primary = -1;  // index into refs
  for (const Seed& seed : seeds) {
    const SimResult res = simulate(seed.program, costs);
    const bool fits = fits_cap(res.peak_activations, cap);
    ZB_CHECK(fits || !seed.must_fit, "'", seed.program.schedule,
             "' seed breaks the memory cap it is built for");
    const Score sc = score_of(res);
    seed_scores.push_back(sc);
    seed_fits.push_back(fits);
    if (!fits) continue;  // a seed that does not fit the cap is no reference
    if (seed.role == Seed::Role::kPrimary) primary = static_cast<int>(refs.size());
    if (seed.role != Seed::Role::kCandidate) refs.push_back(sc);
  }
  Picker picker(std::move(refs), primary);
  for (size_t i = 0; i < seeds.size(); ++i)
    if (seed_fits[i]) picker.offer(seed_scores[i], seeds[i].program);

  int points = 1;
  for (int k = 0; k < kNumKnobs; ++k) points *= grid.size(static_cast<Knob>(k));
  std::vector<char> done(points, 0);
  Program cand = shell;
  for (int n = 0; n < points; ++n) {
    if (done[n]) continue;
    const PolicyIndex at = grid_point(grid, n);
    PolicySet cell = PolicySet::all(grid);
    const ListRunResult run =
        exhaustive ? run_list_schedule(cand, costs, cap, grid, at, nullptr)
                   : run_list_schedule(cand, costs, cap, grid, at, &cell, picker.bound());
    if (!exhaustive)
      for (int j = n; j < points; ++j)
        if (!done[j] && cell.contains(grid_point(grid, j))) done[j] = 1;
    if (!run.complete) continue;
    ZB_CHECK(fits_cap(run.peak_activations, cap), "list scheduler broke the memory cap on '",
             shell.schedule, "'");
    // The reference scores with the simulator itself.
    picker.offer(exhaustive ? score_of(simulate(cand, costs))
                            : make_score(run.makespan, run.max_span, run.bubble_rate,
                                         run.peak_activations),
                 cand);
  }
  return picker.take();
}

}  // namespace zbpipe::detail
