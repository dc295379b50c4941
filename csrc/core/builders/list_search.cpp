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

// The search's inputs, as search_list_schedules received them.
struct SearchInputs {
  const Program& shell;
  const CostModel& costs;
  const MemoryModel& memory;
  const std::vector<double>& cap;
  const PolicyGrid& grid;
  const SearchMode& mode;
};

// The seeds' scores and whether each fits the cap; those that fit and are no mere candidate
// are the references (every candidate is measured against all of them).
struct ScoredSeeds {
  std::vector<Score> scores;
  std::vector<bool> fits;
  std::vector<Score> refs;
  int primary = -1;  // index into refs
};

ScoredSeeds score_seeds(const SearchInputs& in, const std::vector<Seed>& seeds) {
  ScoredSeeds out;
  for (const Seed& seed : seeds) {
    Score sc;
    bool fits;
    if (seed.timing.complete && !in.mode.exhaustive) {
      const ListRunResult& t = seed.timing;
      sc = make_score(t.makespan, t.max_span, t.bubble_rate, t.peak_memory);
      fits = fits_cap(t.peak_memory, in.cap);
    } else {
      const SimResult res = simulate(seed.program, in.costs, in.memory, false);
      sc = score_of(res);
      fits = fits_cap(res.peak_memory, in.cap);
    }
    ZB_CHECK(fits || !seed.must_fit, "'", seed.program.schedule,
             "' seed breaks the memory cap it is built for");
    out.scores.push_back(sc);
    out.fits.push_back(fits);
    if (!fits) continue;  // a seed that does not fit the cap is no reference
    if (seed.role == Seed::Role::kPrimary) out.primary = static_cast<int>(out.refs.size());
    if (seed.role != Seed::Role::kCandidate) out.refs.push_back(sc);
  }
  return out;
}

// Offers the seeds that fit: they come before every grid point in the serial order.
void offer_seeds(Picker& picker, const std::vector<Seed>& seeds, const ScoredSeeds& scored) {
  const long first = -static_cast<long>(seeds.size());
  for (size_t i = 0; i < seeds.size(); ++i)
    if (scored.fits[i]) picker.offer(scored.scores[i], seeds[i].program, first + static_cast<long>(i));
}

int grid_size(const PolicyGrid& grid) {
  int points = 1;
  for (int k = 0; k < kNumKnobs; ++k) points *= grid.size(static_cast<Knob>(k));
  return points;
}

// The pruning bars: the lowest bounds any worker has reached, starting from the seeds' picks.
// A run stops only when it can no longer reach the best pool-0 objective found so far (or its
// other metric, once that objective is at the floor), which is never below the final pick's.
class Bars {
 public:
  Bars(const Picker& seeds, const SearchMode& mode)
      : objective_(mode.objective), floor_(mode.floor), bar_(seeds.bound()),
        other_bar_(seeds.other_bound(mode.floor)) {}

  // What a run must stay within. A stale bar (relaxed loads) costs only a later stop.
  RunBound bound() const {
    return RunBound{objective_, bar_.load(std::memory_order_relaxed),
                    other_bar_.load(std::memory_order_relaxed)};
  }
  // After each offer: the bars come down to (at least) the worker's own bounds.
  void lower_to(const Picker& mine) {
    lower(bar_, mine.bound());
    lower(other_bar_, mine.other_bound(floor_));
  }

 private:
  const Objective objective_;
  const double floor_;
  std::atomic<double> bar_, other_bar_;
};

// The workers that play the grid's runs (the caller's thread is worker 0), each keeping its
// own picks. Runs wait on one stack (last in, first out: a worker goes on with the forks it
// just made, which keeps few of them waiting); the first holds the whole grid. The pick does
// not depend on which worker plays which run, or when (Bars; equal keys go to the lowest grid
// point, each run's being its set's first). Exhaustive: every grid point is a run of its own,
// played to the end, made when taken.
class GridPool {
 public:
  GridPool(const SearchInputs& in, const ScoredSeeds& seeds, Bars& bars, int workers)
      : in_(in), bars_(bars), points_(grid_size(in.grid)), exhaustive_(in.mode.exhaustive),
        unmade_(exhaustive_ ? 0 : points_),
        picks_(workers, Picker(seeds.refs, seeds.primary, in.mode.objective)),
        errors_(workers), error_at_(workers, points_) {
    if (!exhaustive_)
      stack_.emplace_back(in.shell, in.costs, in.memory, in.cap, in.grid, PolicySet::all(in.grid));
  }

  // Runs worker 0 on this thread and the others on helper threads, as many as can be had.
  void run() {
    std::vector<std::thread> helpers;
    for (int id = 1; id < static_cast<int>(picks_.size()); ++id) {
      try {
        helpers.emplace_back([this, id] { work(id); });
      } catch (const std::system_error&) {
        break;  // no more threads to be had: the workers already started share the grid
      }
    }
    work(0);
    for (std::thread& t : helpers) t.join();
  }

  // Raises what a serial search would have met first: an interrupt wins over the errors it
  // caused in other workers, else the lowest failing grid point's error.
  void choose_error() const {
    if (interrupted_) std::rethrow_exception(interrupted_);
    throw_if_cancelled();
    const auto first_error = std::min_element(error_at_.begin(), error_at_.end());
    if (*first_error < points_) std::rethrow_exception(errors_[first_error - error_at_.begin()]);
  }

  void merge_picks_into(Picker& picker) {
    for (Picker& p : picks_) picker.merge(std::move(p));
  }

 private:
  void work(int id) {
    const auto joined = cancel_.join();
    Program cand = in_.shell;
    std::vector<ListRun> forks;
    for (;;) {
      std::optional<ListRun> run = take(id);
      if (!run) return;
      play(id, *run, cand, forks);
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (ListRun& f : forks) stack_.push_back(std::move(f));
        forks.clear();
        --playing_;
      }
      wake_.notify_all();
    }
  }

  // The next run to play, or none once the search is over or has failed.
  std::optional<ListRun> take(int id) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!wait_for_work(lock, id)) return std::nullopt;
    if (failed_ || (stack_.empty() && unmade_ == points_)) return std::nullopt;
    std::optional<ListRun> run;
    if (stack_.empty()) {
      const PolicyIndex at = grid_point(in_.grid, unmade_++);
      PolicySet one;
      for (int k = 0; k < kNumKnobs; ++k) one.bits[k] = 1u << at[k];
      run.emplace(in_.shell, in_.costs, in_.memory, in_.cap, in_.grid, one);
    } else {
      run.emplace(std::move(stack_.back()));
      stack_.pop_back();
    }
    ++playing_;
    return run;
  }

  // Waits until there is work or the search ends: the stack is empty and no run still playing
  // can fork onto it. The caller's thread (worker 0) runs the poller (cancel.h): while another
  // worker plays a long run it keeps polling, or Ctrl-C would wait for that run to end. False
  // once it was interrupted (the other workers see the scope cancelled).
  bool wait_for_work(std::unique_lock<std::mutex>& lock, int id) {
    auto has_work = [&] { return failed_ || !stack_.empty() || unmade_ < points_ || playing_ == 0; };
    while (!has_work()) {
      if (id != 0) {
        wake_.wait(lock);
      } else if (wake_.wait_for(lock, kWaitPoll) == std::cv_status::timeout) {
        lock.unlock();
        try {
          poll_cancel_now();
        } catch (...) {
          interrupted_ = std::current_exception();
        }
        lock.lock();
        if (interrupted_) {
          failed_ = true;
          wake_.notify_all();
          return false;
        }
      }
    }
    return true;
  }

  // Plays one run and offers its program if it completes; an error is kept for choose_error().
  void play(int id, ListRun& run, Program& cand, std::vector<ListRun>& forks) {
    const int n = grid_number(in_.grid, run.policy());
    try {
      poll_cancel();
      // The bars are already at or below this worker's own bounds: it lowers them after each
      // offer.
      const ListRunResult res = run.play(exhaustive_ ? RunBound{} : bars_.bound(), forks);
      if (!res.complete) return;
      run.take_program(cand);
      ZB_CHECK(fits_cap(res.peak_memory, in_.cap), "list scheduler broke the memory cap on '",
               in_.shell.schedule, "'");
      // The reference scores with the simulator itself.
      picks_[id].offer(exhaustive_ ? score_of(simulate(cand, in_.costs, in_.memory, false))
                                   : make_score(res.makespan, res.max_span, res.bubble_rate,
                                                res.peak_memory),
                       cand, n);
      bars_.lower_to(picks_[id]);
    } catch (...) {
      // The lowest failing grid point's error is raised (the one a serial search meets first).
      if (n < error_at_[id]) {
        errors_[id] = std::current_exception();
        error_at_[id] = n;
      }
      std::lock_guard<std::mutex> lock(mu_);
      failed_ = true;
    }
  }

  const SearchInputs& in_;
  Bars& bars_;
  const int points_;
  const bool exhaustive_;
  std::mutex mu_;  // guards the stack and the counts below
  std::condition_variable wake_;
  std::vector<ListRun> stack_;
  int playing_ = 0;  // runs taken off the stack whose forks are not on it yet
  bool failed_ = false;
  int unmade_;  // exhaustive: the next grid point not yet a run
  std::vector<Picker> picks_;                // per worker
  std::vector<std::exception_ptr> errors_;   // per worker: its lowest failing grid point's
  std::vector<int> error_at_;                // per worker: that grid point (points_: none)
  const CancelShare cancel_;                 // helpers stop with the caller's Ctrl-C (cancel.h)
  std::exception_ptr interrupted_;           // what the poller threw while worker 0 waited
};

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
  const SearchInputs in{shell, costs, memory, cap, grid, mode};
  const ScoredSeeds scored = score_seeds(in, seeds);
  Picker picker(scored.refs, scored.primary, mode.objective);
  offer_seeds(picker, seeds, scored);
  Bars bars(picker, mode);
  const int workers = mode.exhaustive ? 1 : std::min(search_thread_count(mode.threads), grid_size(grid));
  GridPool pool(in, scored, bars, workers);
  pool.run();
  pool.choose_error();
  pool.merge_picks_into(picker);
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
