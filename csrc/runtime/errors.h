// Runtime error types: PipelineError (bound to Python as zbpipe.PipelineError, a RuntimeError)
// for anything that failed while running a program, StageError for an exception raised inside
// a stage's own code (its one-line summary apart from the Python traceback), and the
// handshake's report of a stage that rejected its inputs on some rank.
#pragma once

#include <string>
#include <utility>

#include "zbpipe/error.h"

namespace zbpipe::runtime {

// A step failed: the first line names the failing rank, stage and action, then the cause;
// the rank's program follows with that action marked.
class PipelineError : public ::zbpipe::Error {
 public:
  explicit PipelineError(const std::string& what) : ::zbpipe::Error(what) {}
};

// A wait or post refused because this rank's pending communication was aborted (a peer's
// failure was seen through the store, see failure_watch.h).
class CommAborted : public PipelineError {
 public:
  explicit CommAborted(const std::string& what) : PipelineError(what) {}
};

// The stage implementation threw (e.g. a Python exception in the module's forward).
// `summary`: "<ExceptionType>: <message>", what every rank is told; `traceback`: the user's
// traceback, shown once, on the failing rank only.
class StageError : public std::runtime_error {
 public:
  StageError(std::string summary, std::string traceback)
      : std::runtime_error(traceback.empty() ? summary : summary + "\n" + traceback),
        summary_(std::move(summary)), traceback_(std::move(traceback)) {}
  const std::string& summary() const { return summary_; }
  const std::string& traceback() const { return traceback_; }

 private:
  std::string summary_, traceback_;
};

// The pipeline handshake failed because stage `stage` on rank `rank` (a rank of the group)
// rejected its inputs: every rank throws it with the same culprit. `summary` is what the
// culprit said; `traceback` is its traceback on the culprit's own rank, else empty.
class HandshakeFailed : public PipelineError {
 public:
  HandshakeFailed(int rank, int stage, std::string summary, std::string traceback)
      : PipelineError(::zbpipe::detail::str("pipeline handshake failed at stage ", stage, " (rank ", rank,
                                            "): ", summary)),
        rank(rank), stage(stage), summary(std::move(summary)), traceback(std::move(traceback)) {}
  int rank, stage;
  std::string summary, traceback;
};

}  // namespace zbpipe::runtime
