// The policy-grid search behind zb_auto / v_half / v_min (search_list_schedules, see
// list_scheduler.h): the same pick as scoring every grid point, with three savings.
//   - Grid points that no knob check of a run tells apart build the same program, and grid
//     points play their common prefix once: one run plays the whole grid and forks where a
//     knob check splits it (ListRun), each fork resuming from that moment with the points that
//     decided otherwise.
//   - Once a candidate matches every reference it is the bar: a run stops as soon as one rank's
//     lower bound of its last end (clock plus remaining work, or its drain; less its first
//     start when the objective is the span) exceeds that candidate's objective (it could only
//     lose), and all grid points still in its set stop with it.
//   - Candidates are scored from the scheduler's own simulated timing, and only the best one
//     is copied out.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#ifdef __linux__
#include <sched.h>
#endif

#include "list_scheduler.h"
#include "zbpipe/builders.h"
#include "zbpipe/cancel.h"
#include "zbpipe/error.h"
#include "zbpipe/simulator.h"

namespace zbpipe::detail {

namespace {

// How long the caller's thread waits for work between polls (cancel.h throttles the poller).
constexpr std::chrono::milliseconds kWaitPoll{20};

// Bubble rate is monotone in the longest span (total work is fixed), so spans are compared;
// rounding keeps float noise from choosing between equal schedules.
struct Score {
  double makespan, max_span, bubble;
  double memory;  // sum of per-rank peaks
};

double round9(double x) { return std::round(x * 1e9) / 1e9; }

Score make_score(double makespan, double max_span, double bubble,
                 const std::vector<double>& peaks) {
  double mem = 0.0;
  for (double peak : peaks) mem += peak;
  return {round9(makespan), round9(max_span), round9(bubble), round9(mem)};
}

Score score_of(const SimResult& res) {
  return make_score(res.makespan, *std::max_element(res.span.begin(), res.span.end()),
                    res.bubble_rate, res.peak_memory);
}

// How much worse than `ref` a candidate is on its worse metric (1 = no worse on either).
// Under Objective::kSpan only the span counts (the paper's own heuristic may end a step later
// than ZB-H2 yet keep every rank's span shorter, and that is its point).
double regret(const Score& c, const Score& ref, Objective objective) {
  auto ratio = [](double x, double y) {
    return y > 0.0 ? x / y : (x > 0.0 ? std::numeric_limits<double>::infinity() : 1.0);
  };
  const double span = ratio(c.max_span, ref.max_span);
  return objective == Objective::kSpan ? span : std::max(ratio(c.makespan, ref.makespan), span);
}

bool fits_cap(const std::vector<double>& peaks, const std::vector<double>& cap) {
  for (size_t r = 0; r < peaks.size(); ++r)
    if (!within_cap(peaks[r], cap[r])) return false;
  return true;
}

// Keeps the best candidate of each pool (see search_list_schedules): 0 = no worse than every
// reference, 1 = no worse than the primary, 2 = any. Once pool 0 has one, the others can no
// longer be picked and are not kept.
class Picker {
 public:
  Picker(std::vector<Score> refs, int primary, Objective objective)
      : refs_(std::move(refs)), primary_(primary), objective_(objective) {}

  // `order` is the offer's place in the serial search (seeds first, then grid points in grid
  // order): among equal keys the lowest wins, whatever order the workers offered them in.
  void offer(const Score& c, const Program& program, long order) {
    double worst = 1.0;
    for (const Score& ref : refs_) worst = std::max(worst, round9(regret(c, ref, objective_)));
    const bool span = objective_ == Objective::kSpan;
    const Key key{worst, span ? c.max_span : c.makespan, span ? c.makespan : c.max_span,
                  c.bubble, c.memory};
    const bool pool[3] = {worst <= 1.0, primary_ >= 0 && regret(c, refs_[primary_], objective_) <= 1.0, true};
    for (int t = 0; t < 3; ++t) {
      if (!pool[t] || (t > 0 && best_[0].set)) continue;
      if (better(key, order, best_[t])) best_[t] = {true, key, order, program};
    }
  }

  // Takes in another worker's picks (same references).
  void merge(Picker&& other) {
    for (int t = 0; t < 3; ++t) {
      Best& b = other.best_[t];
      if (b.set && better(b.key, b.order, best_[t])) best_[t] = std::move(b);
    }
  }

  // The objective a run must stay within to still be picked (infinite while pool 0 is empty).
  double bound() const { return best_[0].set ? with_margin(std::get<1>(best_[0].key)) : kNone; }
  // The other metric a run must stay within, once the best objective sits at `floor` (a lower
  // bound of every program's): a run can then only tie on the objective (infinite otherwise).
  double other_bound(double floor) const {
    if (!best_[0].set || std::get<1>(best_[0].key) > floor + 1e-9 * (1.0 + floor)) return kNone;
    return with_margin(std::get<2>(best_[0].key));
  }

  Program take() {
    for (auto& b : best_)
      if (b.set) return std::move(b.program);
    ZB_CHECK(false, "search found no candidate schedule");
    return {};
  }

 private:
  // Worst ratio, objective, the other metric, bubble, memory.
  using Key = std::tuple<double, double, double, double, double>;
  struct Best {
    bool set = false;
    Key key;
    long order = 0;
    Program program;
  };
  static constexpr double kNone = std::numeric_limits<double>::infinity();
  // Far above float noise in a run's running bound, far below any real difference.
  static double with_margin(double x) { return x + 1e-6 * (1.0 + x); }
  static bool better(const Key& key, long order, const Best& than) {
    return !than.set || key < than.key || (key == than.key && order < than.order);
  }
  std::vector<Score> refs_;
  int primary_;
  Objective objective_;
  Best best_[3];
};

// Lowers `bar` to `to` unless another worker has gone lower already.
void lower(std::atomic<double>& bar, double to) {
  for (double b = bar.load(); to < b && !bar.compare_exchange_weak(b, to);) {
  }
}

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

// The number of grid point `at` (grid_point's inverse).
int grid_number(const PolicyGrid& g, const PolicyIndex& at) {
  int n = 0;
  for (int k = 0; k < kNumKnobs; ++k) n = n * g.size(static_cast<Knob>(k)) + at[k];
  return n;
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
                              const MemoryModel& memory, const std::vector<double>& cap,
                              const PolicyGrid& grid, const std::vector<Seed>& seeds,
                              const SearchMode& mode) {
  costs.check(shell.num_stages, shell.microbatches, shell.pp);
  memory.check(shell.num_stages);
  ZB_SCHEDULE_CHECK(mode.threads >= 0, shell.schedule,
                    ": search_threads must be >= 0 (0 = one per CPU), got ", mode.threads);
  // Seeds: the references first (every candidate is measured against all of them).
  std::vector<Score> seed_scores;
  std::vector<bool> seed_fits;
  std::vector<Score> refs;
  int primary = -1;  // index into refs
  for (const Seed& seed : seeds) {
    Score sc;
    bool fits;
    if (seed.timing.complete && !mode.exhaustive) {
      const ListRunResult& t = seed.timing;
      sc = make_score(t.makespan, t.max_span, t.bubble_rate, t.peak_memory);
      fits = fits_cap(t.peak_memory, cap);
    } else {
      const SimResult res = simulate(seed.program, costs, memory, false);
      sc = score_of(res);
      fits = fits_cap(res.peak_memory, cap);
    }
    ZB_CHECK(fits || !seed.must_fit, "'", seed.program.schedule,
             "' seed breaks the memory cap it is built for");
    seed_scores.push_back(sc);
    seed_fits.push_back(fits);
    if (!fits) continue;  // a seed that does not fit the cap is no reference
    if (seed.role == Seed::Role::kPrimary) primary = static_cast<int>(refs.size());
    if (seed.role != Seed::Role::kCandidate) refs.push_back(sc);
  }
  Picker picker(refs, primary, mode.objective);
  const long first = -static_cast<long>(seeds.size());  // seeds come before every grid point
  for (size_t i = 0; i < seeds.size(); ++i)
    if (seed_fits[i]) picker.offer(seed_scores[i], seeds[i].program, first + static_cast<long>(i));

  int points = 1;
  for (int k = 0; k < kNumKnobs; ++k) points *= grid.size(static_cast<Knob>(k));
  const bool exhaustive = mode.exhaustive;
  // Runs wait on one stack (last in, first out: a worker goes on with the forks it just made,
  // which keeps few of them waiting); the first holds the whole grid. The pick does not depend
  // on which worker plays which run, or when: a run stops only when it can no longer reach the
  // best pool-0 objective found so far (or its other metric, once that objective is at the
  // floor), which is never below the final pick's, and equal keys go to the lowest grid point,
  // each run's being its set's first. A stale bar (relaxed loads) costs only a later stop.
  // Exhaustive: every grid point is a run of its own, played to the end, made when taken.
  const int workers = exhaustive ? 1 : std::min(search_thread_count(mode.threads), points);
  std::mutex mu;
  std::condition_variable wake;
  std::vector<ListRun> stack;
  int playing = 0;  // runs taken off the stack whose forks are not on it yet
  bool failed = false;
  int unmade = exhaustive ? 0 : points;  // exhaustive: the next grid point not yet a run
  if (!exhaustive) stack.emplace_back(shell, costs, memory, cap, grid, PolicySet::all(grid));
  // The lowest bounds any worker has reached.
  std::atomic<double> bar{picker.bound()}, other_bar{picker.other_bound(mode.floor)};
  std::vector<Picker> picks(workers, Picker(refs, primary, mode.objective));
  std::vector<std::exception_ptr> errors(workers);
  std::vector<int> error_at(workers, points);
  const CancelShare cancel;  // helpers stop with the caller's Ctrl-C (cancel.h)
  std::exception_ptr interrupted;  // what the poller threw while worker 0 waited
  auto work = [&](int id) {
    const auto joined = cancel.join();
    Picker& mine = picks[id];
    Program cand = shell;
    std::vector<ListRun> forks;
    for (;;) {
      std::optional<ListRun> run;
      {
        std::unique_lock<std::mutex> lock(mu);
        // Ends: the stack is empty and no run still playing can fork onto it.
        auto has_work = [&] { return failed || !stack.empty() || unmade < points || playing == 0; };
        // The caller's thread (worker 0) runs the poller (cancel.h): while another worker
        // plays a long run it keeps polling, or Ctrl-C would wait for that run to end.
        while (!has_work()) {
          if (id != 0) {
            wake.wait(lock);
          } else if (wake.wait_for(lock, kWaitPoll) == std::cv_status::timeout) {
            lock.unlock();
            try {
              poll_cancel_now();
            } catch (...) {
              interrupted = std::current_exception();  // the other workers see the scope cancelled
            }
            lock.lock();
            if (interrupted) {
              failed = true;
              wake.notify_all();
              return;
            }
          }
        }
        if (failed || (stack.empty() && unmade == points)) return;
        if (stack.empty()) {
          const PolicyIndex at = grid_point(grid, unmade++);
          PolicySet one;
          for (int k = 0; k < kNumKnobs; ++k) one.bits[k] = 1u << at[k];
          run.emplace(shell, costs, memory, cap, grid, one);
        } else {
          run.emplace(std::move(stack.back()));
          stack.pop_back();
        }
        ++playing;
      }
      const int n = grid_number(grid, run->policy());
      try {
        poll_cancel();
        // The bars are already at or below this worker's own bounds: it lowers them after
        // each offer.
        const RunBound bound{mode.objective, bar.load(std::memory_order_relaxed),
                             other_bar.load(std::memory_order_relaxed)};
        const ListRunResult res = run->play(exhaustive ? RunBound{} : bound, forks);
        if (res.complete) {
          run->take_program(cand);
          ZB_CHECK(fits_cap(res.peak_memory, cap), "list scheduler broke the memory cap on '",
                   shell.schedule, "'");
          // The reference scores with the simulator itself.
          mine.offer(exhaustive ? score_of(simulate(cand, costs, memory, false))
                                : make_score(res.makespan, res.max_span, res.bubble_rate,
                                             res.peak_memory),
                     cand, n);
          lower(bar, mine.bound());
          lower(other_bar, mine.other_bound(mode.floor));
        }
      } catch (...) {
        // The lowest failing grid point's error is raised (the one a serial search meets first).
        if (n < error_at[id]) {
          errors[id] = std::current_exception();
          error_at[id] = n;
        }
        std::lock_guard<std::mutex> lock(mu);
        failed = true;
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        for (ListRun& f : forks) stack.push_back(std::move(f));
        forks.clear();
        --playing;
      }
      wake.notify_all();
    }
  };
  std::vector<std::thread> helpers;
  for (int id = 1; id < workers; ++id) {
    try {
      helpers.emplace_back(work, id);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the workers already started share the grid
    }
  }
  work(0);
  for (std::thread& t : helpers) t.join();
  if (interrupted) std::rethrow_exception(interrupted);
  throw_if_cancelled();  // an interrupt wins over the errors it caused in other workers
  const auto first_error = std::min_element(error_at.begin(), error_at.end());
  if (*first_error < points) std::rethrow_exception(errors[first_error - error_at.begin()]);
  for (Picker& p : picks) picker.merge(std::move(p));
  return picker.take();
}

}  // namespace zbpipe::detail

namespace zbpipe {

int search_thread_count(int requested) {
  if (requested > 0) return requested;
  int cpus = static_cast<int>(std::thread::hardware_concurrency());  // 0 when unknown
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
#endif
  return std::min(std::max(cpus, 1), kMaxSearchThreads);
}

}  // namespace zbpipe
