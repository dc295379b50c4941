// The store-facing control plane of one rank without an executor or process groups: its failure
// watch on its pipeline group's and data-parallel group's stores, the program agreement and
// the replicas' meeting through the store, exactly as an executor runs them -- so a benchmark
// (benchmarks/bench_control_plane.py) can run thousands of ranks against one store, many per
// process. What an executor sends over its control groups instead (each step's signature, the
// later meetings) never reaches the store and is not here.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "runtime/failure_watch.h"

namespace c10d {
class Store;
}

namespace zbpipe::runtime {

class ControlPlaneRank {
 public:
  // Global rank `rank`: rank `pp_rank` of a pipeline of `pp` whose group store is `pp_store`,
  // and rank `dp_rank` of `dp` replicas whose group store is `dp_store` (dp 1: none). Takes the
  // executor ids and starts the watch, as an executor's first step does. Throws what the
  // stores throw.
  ControlPlaneRank(c10::intrusive_ptr<c10d::Store> pp_store, int pp_rank, int pp,
                   c10::intrusive_ptr<c10d::Store> dp_store, int dp_rank, int dp, int rank);

  // The program agreement with the pipeline's other ranks (agree_on_program).
  void agree(const std::string& fingerprint, std::chrono::milliseconds timeout);
  // The replicas' meeting through the store (meet_through_store); no-op for dp 1.
  void meet(std::chrono::milliseconds timeout);
  // This rank fails: publishes `message` (FailureWatch::report).
  void fail(const std::string& message);
  // When a watcher first heard of a peer's failure (steady_clock, ns since its epoch), or -1.
  int64_t seen_at_ns() const { return seen_at_ns_.load(); }
  // The peer's failure heard of, described ("rank R failed ..."), or "".
  std::string seen() const;

 private:
  int rank_, pp_rank_, pp_, dp_rank_, dp_;
  int64_t meetings_ = 0;
  std::atomic<int64_t> seen_at_ns_{-1};
  std::unique_ptr<FailureWatch> watch_;
};

}  // namespace zbpipe::runtime
