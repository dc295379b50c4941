// Runtime error types: PipelineError (bound to Python as zbpipe.PipelineError, a RuntimeError)
// for anything that failed while running a program, and StageError for an exception raised
// inside a stage's own code (its text carries the Python traceback).
#pragma once

#include "zbpipe/error.h"

namespace zbpipe::runtime {

// A step failed: the message names the rank, the failing action and shows the rank's program
// with that action marked.
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
class StageError : public std::runtime_error {
 public:
  explicit StageError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace zbpipe::runtime
