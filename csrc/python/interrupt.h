// Ctrl-C for long core calls: the binding's side of zbpipe/cancel.h.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>

#include "zbpipe/cancel.h"

namespace zbpipe::python {

// How often a core call without the GIL takes it back to run Python's signal handlers.
inline constexpr std::chrono::milliseconds kSignalPollInterval{50};

// Runs f() with the GIL released. While it runs, the core's polls (poll_cancel) re-acquire the
// GIL at most every kSignalPollInterval and run the pending signal handlers; one that raises
// (SIGINT's default handler raises KeyboardInterrupt) stops f, and this call raises that
// exception. Signals reach only the main thread, so other threads' calls run to the end, as
// Python code would. Call with the GIL held.
template <typename F>
auto interruptible(F&& f) -> decltype(f()) {
  namespace py = pybind11;
  // The poller leaves the handler's exception pending on this thread's Python state and
  // unwinds the core with Cancelled; it is raised again below, once the GIL is back.
  CancelScope scope(
      [] {
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) throw Cancelled();
      },
      kSignalPollInterval);
  try {
    py::gil_scoped_release nogil;
    return f();
  } catch (const Cancelled&) {
    if (!PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
}

}  // namespace zbpipe::python
