// Program fingerprints, exchanged once per executor through the store.
#include "runtime/program_agreement.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <thread>

#include "runtime/errors.h"
#include "runtime/failure_watch.h"
#include "zbpipe/cancel.h"

namespace zbpipe::runtime {

std::string program_fingerprint(const Program& p, bool static_shapes) {
  return detail::str("schedule=", p.schedule, " ", fingerprint(p), " static_shapes=", static_shapes ? 1 : 0);
}

namespace {

void agree(c10d::Store& store, const std::string& key_prefix, int rank, int size,
           const std::string& fingerprint, std::chrono::milliseconds timeout, FailureWatch& watch,
           const std::function<void()>& check) {
  auto key = [&](int r) { return detail::str(key_prefix, "program/rank", r); };
  store.set(key(rank), std::vector<uint8_t>(fingerprint.begin(), fingerprint.end()));
  std::vector<std::string> peers;
  for (int r = 0; r < size; ++r)
    if (r != rank) peers.push_back(key(r));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  HeartbeatWatch hearts(store);  // a peer whose process died never comes: its heartbeat stops
  while (!store.check(peers)) {
    if (check) check();  // Ctrl-C
    if (auto f = watch.poll_now())
      throw CommAborted("comparing the ranks' programs was aborted (a peer failed)");
    if (hearts.due()) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r)
        if (r != rank && !store.check({key(r)})) missing.push_back(r);
      if (auto dead = hearts.look(missing))
        throw PipelineError(detail::str(
            "no program from rank ", *dead, ": its process stopped (its heartbeat in the store has "
            "not changed for ", kSilentAfter.count() / 1000.0, " s; it died or was killed) while "
            "the ranks compare programs before the first step"));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::string missing;
      for (int r = 0; r < size; ++r)
        if (r != rank && !store.check({key(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      throw PipelineError(detail::str(
          "no program from rank ", missing, " within ", timeout.count() / 1000.0,
          " s (the ranks compare programs before the first step; a peer failed before it, or "
          "runs another number of schedules on this process group)"));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    auto v = store.get(key(r));
    std::string theirs(v.begin(), v.end());
    if (theirs != fingerprint)
      throw PipelineError(detail::str("the ranks run different programs: rank ", rank, " runs ",
                                      fingerprint, "; rank ", r, " runs ", theirs));
  }
}

}  // namespace

void agree_on_program(c10d::Store& store, const std::string& key_prefix, int rank, int size,
                      const std::string& fingerprint, std::chrono::milliseconds timeout,
                      FailureWatch& watch, const std::function<void()>& check) {
  try {
    agree(store, key_prefix, rank, size, fingerprint, timeout, watch, check);
  } catch (const PipelineError&) {
    throw;
  } catch (const Cancelled&) {  // Ctrl-C, through `check`
    throw;
  } catch (const std::exception& e) {
    throw PipelineError(detail::str(
        "comparing the ranks' programs through the process group's store failed (the rank "
        "hosting the store may have exited): ", e.what()));
  }
}

}  // namespace zbpipe::runtime
