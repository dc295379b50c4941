// Partition planning (partition.h): per candidate program, a min-max start, a local search of
// boundary moves scored by the simulator, then, where the space is small enough, every split
// enumerated with the work bound pruning what cannot beat the best found.
#include "zbpipe/partition.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "zbpipe/cancel.h"
#include "zbpipe/cost_model.h"
#include "zbpipe/error.h"
#include "zbpipe/memory_model.h"
#include "zbpipe/passes.h"
#include "zbpipe/simulator.h"

namespace zbpipe {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Prefix sums of every unit field, so a stage's value is one subtraction.
struct Prefix {
  std::vector<double> f, i, w, b, mem_f, mem_w, stat, work;
  explicit Prefix(const UnitProfile& u) {
    const int n = u.size();
    for (auto* v : {&f, &i, &w, &b, &mem_f, &mem_w, &stat, &work}) v->assign(n + 1, 0.0);
    for (int k = 0; k < n; ++k) {
      const double fused = fused_b(u, k);
      f[k + 1] = f[k] + u.f[k];
      i[k + 1] = i[k] + u.i[k];
      w[k + 1] = w[k] + u.w[k];
      b[k + 1] = b[k] + fused;
      mem_f[k + 1] = mem_f[k] + u.mem_f[k];
      mem_w[k + 1] = mem_w[k] + u.mem_w[k];
      stat[k + 1] = stat[k] + u.static_bytes[k];
      // the least time a microbatch can keep a rank busy on this unit: F plus the cheaper backward
      work[k + 1] = work[k] + u.f[k] + std::min(fused, u.i[k] + u.w[k]);
    }
  }
  static double fused_b(const UnitProfile& u, int k) {
    return (k < static_cast<int>(u.b.size()) && u.b[k] > 0.0) ? u.b[k] : u.i[k] + u.w[k];
  }
  static double sum(const std::vector<double>& v, int lo, int hi) { return v[hi] - v[lo]; }
};

// The searches of one program: scoring, the work bound, and the best split seen.
class ProgramSearch {
 public:
  ProgramSearch(const Program& p, const UnitProfile& u, const Prefix& pre, const PartitionOptions& o)
      : p_(p), u_(u), pre_(pre), o_(o) {}

  SplitScore score(const std::vector<int>& bounds) {
    ++simulated_;
    const int S = p_.num_stages;
    CostModel costs;
    MemoryModel memory;
    costs.f.resize(S), costs.b.resize(S), costs.w.resize(S), costs.b_full.resize(S);
    memory.mem_f.resize(S), memory.mem_w.resize(S);
    std::vector<double> stat(p_.pp, 0.0);
    for (int s = 0; s < S; ++s) {
      const int lo = bounds[s], hi = bounds[s + 1];
      costs.f[s] = Prefix::sum(pre_.f, lo, hi);
      costs.b[s] = Prefix::sum(pre_.i, lo, hi);
      costs.w[s] = Prefix::sum(pre_.w, lo, hi);
      costs.b_full[s] = Prefix::sum(pre_.b, lo, hi);
      // the memory model needs mem_f > 0: a stage that saves nothing counts one byte
      memory.mem_f[s] = std::max(Prefix::sum(pre_.mem_f, lo, hi), 1.0);
      memory.mem_w[s] = std::min(Prefix::sum(pre_.mem_w, lo, hi), memory.mem_f[s]);
      stat[p_.rank_of(s)] += Prefix::sum(pre_.stat, lo, hi);
    }
    // [Note: first stage's I] The first stage's input is the microbatch, which needs no
    // gradient: its I computes nothing, and W carries the whole backward, keeping every saved
    // tensor until it ends (the executor's trace: I ~0, W ~ the units' I + W).
    costs.w[0] += costs.b[0];
    costs.b[0] = 0.0;
    memory.mem_w[0] = memory.mem_f[0];
    costs.comm = o_.comm;
    SimResult res;
    if (o_.vocab) {  // the head's passes placed under this split's costs as compile() places them
      if (compute_only_.ranks.empty()) compute_only_ = strip_comms(p_);
      const Program placed = place_vocab(compute_only_, costs, o_.vocab->model, memory);
      res = simulate(placed, costs, memory, o_.vocab->model, /*with_timeline=*/false);
    } else {
      res = simulate(p_, costs, memory, /*with_timeline=*/false);
    }
    SplitScore out;
    out.bounds = bounds;
    out.makespan = res.makespan;
    out.peak_bytes.resize(p_.pp);
    for (int r = 0; r < p_.pp; ++r) {
      out.peak_bytes[r] = res.peak_memory[r] + stat[r] + vocab_static(r);
      if (o_.memory_budget > 0 && !within_cap(out.peak_bytes[r], o_.memory_budget)) out.fits = false;
    }
    note(out);
    return out;
  }

  // What each rank does and holds for the vocabulary head whatever the split (0 without it).
  double vocab_work(int r) const {
    return o_.vocab ? (o_.vocab->model.s_time(r) + o_.vocab->model.t_time(r)) * p_.microbatches : 0.0;
  }
  double vocab_static(int r) const {
    if (!o_.vocab || o_.vocab->static_bytes.empty()) return 0.0;
    const auto& v = o_.vocab->static_bytes;
    return v.size() == 1 ? v[0] : v.at(r);
  }

  // makespan >= the busiest rank's m * (F + cheaper backward) summed over its stages (and its
  // vocabulary work)
  double work_bound(const std::vector<int>& bounds) const {
    std::vector<double> load(p_.pp, 0.0);
    for (int r = 0; r < p_.pp; ++r) load[r] = vocab_work(r);
    for (int s = 0; s < p_.num_stages; ++s) load[p_.rank_of(s)] += Prefix::sum(pre_.work, bounds[s], bounds[s + 1]);
    return *std::max_element(load.begin(), load.end()) * p_.microbatches;
  }

  // The split of least max stage work (the classic linear partition, exact by DP); ties: the
  // later boundaries (a lighter last stage, which also carries the loss).
  std::vector<int> min_max_start() const {
    const int n = u_.size(), S = p_.num_stages;
    std::vector<std::vector<double>> best(S + 1, std::vector<double>(n + 1, kInf));
    std::vector<std::vector<int>> cut(S + 1, std::vector<int>(n + 1, 0));
    best[0][0] = 0.0;
    for (int s = 1; s <= S; ++s)
      for (int k = s; k <= n - (S - s); ++k)
        for (int j = s - 1; j < k; ++j) {
          const double v = std::max(best[s - 1][j], Prefix::sum(pre_.work, j, k));
          if (v <= best[s][k]) best[s][k] = v, cut[s][k] = j;
        }
    std::vector<int> bounds(S + 1, n);
    for (int s = S; s > 0; --s) bounds[s - 1] = cut[s][bounds[s]];
    return bounds;
  }

  // Steepest descent over moves of one boundary by one or two units.
  void local_search(std::vector<int> bounds) {
    SplitScore cur = score(bounds);
    int64_t evals = 0;
    for (bool improved = true; improved && evals < o_.local_search_evals;) {
      improved = false;
      SplitScore step = cur;
      for (int j = 1; j < p_.num_stages; ++j)
        for (int d : {-2, -1, 1, 2}) {
          std::vector<int> nb = cur.bounds;
          nb[j] += d;
          if (nb[j] <= nb[j - 1] || nb[j] >= nb[j + 1]) continue;
          if (step.fits && work_bound(nb) >= step.makespan) continue;
          const SplitScore s = score(nb);
          ++evals;
          if (better(s, step)) step = s, improved = true;
        }
      if (improved) cur = step;
    }
  }

  // Every split, in lexicographic order, pruned by the work bound of the stages placed so far.
  void enumerate() {
    std::vector<int> bounds(p_.num_stages + 1, 0);
    bounds.back() = u_.size();
    std::vector<double> load(p_.pp, 0.0), stat(p_.pp, 0.0);
    for (int r = 0; r < p_.pp; ++r) load[r] = vocab_work(r), stat[r] = vocab_static(r);
    place(0, bounds, load, stat);
  }

  const SplitScore& best() const { return best_; }
  bool found() const { return !best_.bounds.empty(); }
  const SplitScore& least_peak() const { return least_peak_; }
  int64_t simulated() const { return simulated_; }

  static bool better(const SplitScore& a, const SplitScore& b) {
    if (b.bounds.empty()) return true;
    if (a.fits != b.fits) return a.fits;
    if (a.fits) return a.makespan < b.makespan * (1 - 1e-12);
    return max_peak(a) < max_peak(b) * (1 - 1e-12);  // out of budget: lower the peak first
  }
  static double max_peak(const SplitScore& s) { return *std::max_element(s.peak_bytes.begin(), s.peak_bytes.end()); }

 private:
  void note(const SplitScore& s) {
    if (better(s, best_)) best_ = s;
    if (least_peak_.bounds.empty() || max_peak(s) < max_peak(least_peak_) * (1 - 1e-12)) least_peak_ = s;
  }

  void place(int s, std::vector<int>& bounds, std::vector<double>& load, std::vector<double>& stat) {
    const int n = u_.size(), S = p_.num_stages;
    if (s == S - 1) {  // the last stage takes the rest
      const int r = p_.rank_of(s);
      const double add = Prefix::sum(pre_.work, bounds[s], n) * p_.microbatches;
      const double bound = std::max(*std::max_element(load.begin(), load.end()), load[r] + add);
      if (best_.fits && !best_.bounds.empty() && bound >= best_.makespan) return;
      if (o_.memory_budget > 0 && !within_cap(stat[r] + Prefix::sum(pre_.stat, bounds[s], n), o_.memory_budget)) return;
      score(bounds);
      return;
    }
    poll_cancel();
    const int r = p_.rank_of(s);
    for (int k = bounds[s] + 1; k <= n - (S - 1 - s); ++k) {
      const double add = Prefix::sum(pre_.work, bounds[s], k) * p_.microbatches;
      const double st = Prefix::sum(pre_.stat, bounds[s], k);
      // a longer stage only adds work to its rank: once it cannot win, nor can any longer one
      if (best_.fits && !best_.bounds.empty() && load[r] + add >= best_.makespan) break;
      if (o_.memory_budget > 0 && !within_cap(stat[r] + st, o_.memory_budget)) break;
      bounds[s + 1] = k;
      load[r] += add, stat[r] += st;
      place(s + 1, bounds, load, stat);
      load[r] -= add, stat[r] -= st;
    }
    bounds[s + 1] = n;
  }

  const Program& p_;
  Program compute_only_;  // p_ without SEND/RECV (the vocabulary placement's input), made once
  const UnitProfile& u_;
  const Prefix& pre_;
  const PartitionOptions& o_;
  SplitScore best_, least_peak_;
  int64_t simulated_ = 0;
};

// C(n, k), saturating at `cap` + 1.
int64_t splits_up_to(int n, int k, int64_t cap) {
  double c = 1.0;
  for (int j = 1; j <= k; ++j) {
    c = c * (n - k + j) / j;
    if (c > static_cast<double>(cap)) return cap + 1;
  }
  return static_cast<int64_t>(std::llround(c));
}

}  // namespace

void UnitProfile::check() const {
  const size_t n = f.size();
  ZB_SCHEDULE_CHECK(n >= 1, "plan_partition: no units");
  for (const auto* v : {&i, &w, &mem_f, &mem_w, &static_bytes})
    ZB_SCHEDULE_CHECK(v->size() == n, "plan_partition: every unit field needs ", n, " values, one has ", v->size());
  ZB_SCHEDULE_CHECK(b.empty() || b.size() == n, "plan_partition: b needs ", n, " values or none, got ", b.size());
  for (const auto* v : {&f, &i, &w, &b, &mem_f, &mem_w, &static_bytes})
    for (double x : *v) ZB_SCHEDULE_CHECK(std::isfinite(x) && x >= 0, "plan_partition: unit values must be finite and >= 0, got ", x);
}

SplitScore score_split(const Program& program, const UnitProfile& units, const std::vector<int>& bounds,
                       double comm, double memory_budget, const VocabPlan* vocab) {
  units.check();
  ZB_SCHEDULE_CHECK(static_cast<int>(bounds.size()) == program.num_stages + 1, "score_split: ",
                    program.num_stages + 1, " bounds for ", program.num_stages, " stages, got ", bounds.size());
  ZB_SCHEDULE_CHECK(bounds.front() == 0 && bounds.back() == units.size(), "score_split: bounds run from 0 to ",
                    units.size());
  for (size_t s = 1; s < bounds.size(); ++s)
    ZB_SCHEDULE_CHECK(bounds[s] > bounds[s - 1], "score_split: stage ", s - 1, " is empty (bounds must increase)");
  const Prefix pre(units);
  PartitionOptions o;
  o.comm = comm;
  o.memory_budget = memory_budget;
  o.vocab = vocab;
  if (vocab) vocab->model.check(program.pp);
  ProgramSearch search(program, units, pre, o);
  return search.score(bounds);
}

std::vector<int> even_bounds(int units, int num_stages) {
  ZB_SCHEDULE_CHECK(num_stages >= 1 && units >= num_stages, "even_bounds: ", units, " units cannot fill ",
                    num_stages, " stages");
  std::vector<int> bounds(num_stages + 1, 0);
  for (int s = 0; s < num_stages; ++s) bounds[s + 1] = bounds[s] + units / num_stages + (s < units % num_stages ? 1 : 0);
  return bounds;
}

PartitionResult plan_partition(const std::vector<Program>& programs, const UnitProfile& units,
                               const PartitionOptions& options) {
  units.check();
  ZB_SCHEDULE_CHECK(!programs.empty(), "plan_partition: no candidate program");
  if (options.vocab) {
    const auto& v = options.vocab->static_bytes;
    for (const Program& p : programs) {
      options.vocab->model.check(p.pp);
      ZB_SCHEDULE_CHECK(v.size() <= 1 || static_cast<int>(v.size()) == p.pp, "plan_partition: the vocabulary's "
                        "static_bytes need 1 value or one per rank (", p.pp, "), got ", v.size());
    }
  }
  const Prefix pre(units);
  PartitionResult out;
  for (size_t k = 0; k < programs.size(); ++k) {
    const Program& p = programs[k];
    ZB_SCHEDULE_CHECK(p.num_stages <= units.size(), "plan_partition: ", p.schedule, " has ", p.num_stages,
                      " stages but there are only ", units.size(), " units");
    ProgramSearch search(p, units, pre, options);
    search.local_search(search.min_max_start());
    if (splits_up_to(units.size() - 1, p.num_stages - 1, options.exhaustive_limit) <= options.exhaustive_limit) {
      search.local_search(even_bounds(units.size(), p.num_stages));  // a second incumbent to prune with
      search.enumerate();
    } else {
      out.exact = false;
    }
    out.simulated += search.simulated();
    out.per_program.push_back(search.best());
    if (search.best().fits && (out.program < 0 || ProgramSearch::better(search.best(), out.best)))
      out.program = static_cast<int>(k), out.best = search.best();
    if (out.least_peak_program < 0 ||
        ProgramSearch::max_peak(search.least_peak()) < ProgramSearch::max_peak(out.least_peak))
      out.least_peak_program = static_cast<int>(k), out.least_peak = search.least_peak();
  }
  return out;
}

}  // namespace zbpipe
