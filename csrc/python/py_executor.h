// The runtime's Python face: building an Executor from Python stages, running a step with its
// data, the custom-action trampoline, and the conversions of what the runtime reports (trace
// records, agreed signatures, the loopback world's call log) into Python values.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/executor.h"
#include "runtime/loopback.h"

namespace zbpipe::python {

namespace py = pybind11;

// Executor(program, process_group, stages, device, *, timeout_s, ...): `stages` maps global
// stage index -> zbpipe.PipelineStage (each wrapped in a PyStage); the keywords are
// ExecutorOptions' and P2POptions' fields, timeout in seconds; `sync_groups` maps a stage
// index to the list of its data-parallel process groups; `control_group`, a callable
// (store, rank, size, timeout_s) -> ProcessGroup (zbpipe/control_plane.py), makes the CPU
// control groups (ExecutorOptions::control_group; None: only backends that bring their own).
std::unique_ptr<runtime::Executor> make_executor(
    const Program& program, const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
    const py::dict& stages, const at::Device& device, double timeout_s, bool device_timing,
    std::optional<bool> prepost_receives, bool static_shapes, std::optional<bool> stream_ordered,
    bool overlap_f_b, int global_rank, std::vector<int> group_ranks, const py::dict& sync_groups,
    py::object control_group);

// A Python callable (store, rank, size, timeout_s) -> ProcessGroup as a ControlGroupFactory:
// called with the GIL taken; the callable is released with the GIL too. None: an empty one.
runtime::ControlGroupFactory control_group_factory(py::object fn);

// _C._store_polled(group): whether `group`'s store lacks blocking waits (FileStore, custom
// stores), so the control plane polls it (store_inbox.h). Asks the store once.
bool store_polled(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// Executor.run(step, first_inputs, loss_scale): runs one step on `step` (the Python step data
// every stage call receives) with the GIL released; `first_inputs` is the (specs, structure)
// signature of the step's microbatch inputs on stage 0's rank, else None. Returns (outputs,
// losses): per microbatch on the last stage's rank (None where none was kept), else empty.
// Ctrl-C during the step (on the main thread) ends it within a poll interval: raises the
// SIGINT handler's exception (KeyboardInterrupt) after telling the peers (step_interrupt.h).
py::tuple run_step(runtime::Executor& executor, py::object step, py::object first_inputs,
                   double loss_scale);

// Executor.set_custom_actions(fn, kinds): fn(action) runs the actions of `kinds` (None: none).
void set_custom_actions(runtime::Executor& executor, py::object fn, const std::vector<Kind>& kinds);
void set_timeout(runtime::Executor& executor, double timeout_s);
// Executor.report_setup_failure(process_group, sync_groups, global_rank, what): through the
// groups' stores only, so it works whatever the device that failed.
void report_setup_failure(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group, const py::list& sync_groups,
                          int global_rank, const std::string& what);

// ((input specs, structure), (output specs, structure)) of a local stage.
py::tuple signatures_to_py(const runtime::Executor& executor, int stage);
// The last step's trace: one dict per record (TraceRecord's fields).
py::list trace_to_py(const runtime::Executor& executor);
std::string chrome_trace(const runtime::Executor& executor);
void export_chrome_trace(const runtime::Executor& executor, const std::string& path);

// Recorded calls of `rank`: (type, work, coalesced, ops) with type 'post', 'wait' or 'sync'
// and ops [("send"|"recv", peer, wire tag, bytes)] on posts.
py::list loopback_events(const runtime::LoopbackWorld& world, int rank);

}  // namespace zbpipe::python
