// Program fingerprints, exchanged once per executor through the ranks' inboxes.
#include "runtime/program_agreement.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <thread>

#include "runtime/errors.h"
#include "runtime/failure_watch.h"
#include "zbpipe/cancel.h"

namespace zbpipe::runtime {

namespace {

std::string subject(int rank) { return detail::str("program ", rank); }

// A peer's failure seen while programs are missing: this long for them to come, so that a rank
// whose program differs is named by every rank itself.
constexpr std::chrono::milliseconds kFailedGrace{1000};

}  // namespace

std::string program_fingerprint(const Program& p, bool static_shapes) {
  return detail::str("schedule=", p.schedule, " ", fingerprint(p), " static_shapes=", static_shapes ? 1 : 0);
}

namespace {

using Clock = FailureWatch::Clock;

void agree(FailureWatch& watch, int rank, int size, const std::string& fingerprint, std::chrono::milliseconds timeout,
           const std::function<void()>& check) {
  for (int r = 0; r < size; ++r)
    if (r != rank) watch.send(0, r, subject(rank), fingerprint);
  std::map<int, std::string> theirs;
  struct Asked {  // the pings since the peer last answered or moved (failure_watch.h, liveness)
    Clock::time_point first;
    Clock::time_point last;
    int pings = 0;
    std::string watch;  // the id of the peer's watch they went to
  };
  std::map<int, Asked> asked;  // silent peers
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  auto next_ask = start + kAskAfter;
  std::optional<Clock::time_point> failed_grace;  // a peer failed: the programs still coming
  auto missing = [&] {
    std::string out;
    for (int r = 0; r < size; ++r)
      if (r != rank && !theirs.count(r)) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  };
  while (true) {
    const uint64_t gen = watch.generation();
    for (int r = 0; r < size; ++r)
      if (r != rank && !theirs.count(r))
        if (auto fp = watch.take(0, subject(r))) theirs[r] = std::move(*fp);
    // Every program here: compared even when a peer failed meanwhile (its own comparison, most
    // likely, which may have come before the last program did), so each rank names its own
    // program first.
    if (static_cast<int>(theirs.size()) == size - 1) break;
    if (check) {
      try {
        check();  // Ctrl-C
      } catch (const CommAborted&) {
        if (!watch.seen()) throw;  // a peer's failure: the grace below
      }
    }
    const auto now = Clock::now();
    if (watch.seen()) {
      if (!failed_grace) failed_grace = now + kFailedGrace;
      if (now >= *failed_grace) throw CommAborted("comparing the ranks' programs was aborted (a peer failed)");
    }
    auto wake = std::min({deadline, next_ask, failed_grace.value_or(deadline)});
    for (auto& [r, a] : asked) {  // a peer that answered neither of two pings in a row has died
      if (theirs.count(r) || a.pings == 0) continue;
      if (watch.last_pong(r) >= a.last) {  // it answered: alive
        a = Asked{};
        continue;
      }
      if (a.pings >= 2 && now - a.last >= kAnswerWithin)
        throw PipelineError(detail::str(
            "no program from rank ", r, ": its process stopped (it answered no liveness ping through the store for ",
            std::chrono::duration_cast<std::chrono::milliseconds>(now - a.first).count() / 1000.0,
            " s; it died or was killed) while the ranks compare programs before the first step"));
      if (a.pings >= 2) wake = std::min(wake, a.last + kAnswerWithin);
    }
    if (now >= next_ask) {  // ask the silent peers, only while this wait lasts
      for (int r = 0; r < size; ++r) {
        if (r == rank || theirs.count(r)) continue;
        auto asked_watch = watch.ping(r);
        if (!asked_watch) {  // parked, or never watched: alive a moment ago, or not to be asked
          asked.erase(r);
          continue;
        }
        Asked& a = asked[r];
        if (a.pings > 0 && a.watch != *asked_watch) a = Asked{};  // a new watch since: it moved
        if (a.pings++ == 0) a.first = now;
        a.last = now;
        a.watch = *asked_watch;
      }
      next_ask = now + kPingEvery;
      wake = std::min(wake, next_ask);
    }
    if (now > deadline)
      throw PipelineError(detail::str(
          "no program from rank ", missing(), " within ", timeout.count() / 1000.0,
          " s (the ranks compare programs before the first step; a peer failed before it, or "
          "runs another number of schedules on this process group)"));
    watch.wait(gen, std::min(wake, deadline + std::chrono::milliseconds(1)));
  }
  for (int r = 0; r < size; ++r) {
    if (r == rank || theirs.at(r) == fingerprint) continue;
    throw PipelineError(detail::str("the ranks run different programs: rank ", rank, " runs ", fingerprint,
                                    "; rank ", r, " runs ", theirs.at(r)));
  }
}

}  // namespace

void agree_on_program(FailureWatch& watch, int rank, int size, const std::string& fingerprint,
                      std::chrono::milliseconds timeout, const std::function<void()>& check) {
  try {
    agree(watch, rank, size, fingerprint, timeout, check);
  } catch (const PipelineError&) {
    throw;
  } catch (const Cancelled&) {  // Ctrl-C, through `check`
    throw;
  } catch (const std::exception& e) {
    throw PipelineError(detail::str(
        "comparing the ranks' programs through the process group's store (", describe_store(*watch.channel(0).store),
        ") failed (the process hosting the store may have exited): ", short_what(e)));
  }
}

}  // namespace zbpipe::runtime
