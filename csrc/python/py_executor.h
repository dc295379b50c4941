// The runtime's Python face: building an Executor from Python stages, running a step with its
// data, the custom-action trampoline, and the conversions of what the runtime reports (trace
// records, agreed signatures, the loopback world's call log) into Python values.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <pybind11/pybind11.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "python/arguments.h"
#include "runtime/executor.h"
#include "runtime/loopback.h"

namespace zbpipe::python {

namespace py = pybind11;

// zbpipe._C.ExecutorOptions: what a schedule passes whole to every executor it builds, the
// user's options of the Executor and of its P2P. (The wiring -- this rank's global rank, the
// group's, the data-parallel groups -- is the Executor's own arguments.)
struct PyExecutorOptions {
  runtime::ExecutorOptions executor;
  runtime::P2POptions p2p;
};

// The class zbpipe._C.ExecutorOptions, registered field by field (module.cpp): each option a
// read-write property with its doc and a one-line TypeError for a value of the wrong type, its
// default the C++ struct's, its name listed in the class's `fields`, whence the schedules take
// their keyword parameters and docs (zbpipe/executor_options.py). So an option is written
// twice: in its struct (executor.h or p2p.h) and in one line of module.cpp.
// ExecutorOptions(**fields) sets fields by name (TypeError for a name that is none).
class ExecutorOptionsClass {
 public:
  ExecutorOptionsClass(py::module_& m, const char* doc);
  // A field of runtime::ExecutorOptions or runtime::P2POptions.
  template <class Part, class T>
  ExecutorOptionsClass& field(const char* name, T Part::*member, const char* doc) {
    cls_.def_property(
        name, [member](const PyExecutorOptions& o) { return part<Part>(o).*member; },
        [member, name](PyExecutorOptions& o, const py::handle& v) {
          part<Part>(o).*member = arg<T>(v, "ExecutorOptions", name, takes<T>());
        },
        doc);
    return listed(name);
  }
  // A duration of runtime::ExecutorOptions, in seconds on the Python side.
  ExecutorOptionsClass& seconds(const char* name, std::chrono::milliseconds runtime::ExecutorOptions::*member,
                                const char* doc);

 private:
  template <class Part, class Options>
  static auto& part(Options& o) {
    static_assert(std::is_same_v<Part, runtime::ExecutorOptions> || std::is_same_v<Part, runtime::P2POptions>);
    if constexpr (std::is_same_v<Part, runtime::P2POptions>) return o.p2p;
    else return o.executor;
  }
  template <class T>
  static const char* takes() {
    if constexpr (std::is_same_v<T, bool>) return "a bool";
    else if constexpr (std::is_same_v<T, std::optional<bool>>) return "a bool or None";
    else return "a number";
  }
  ExecutorOptionsClass& listed(const char* name);
  py::class_<PyExecutorOptions> cls_;
};

// Executor(program, process_group, stages, device, *, options=None, global_rank, group_ranks,
// sync_groups, vocab=None, embedding=None, **fields): `stages` maps global stage index -> zbpipe.PipelineStage
// (each wrapped in a PyStage); `options` an ExecutorOptions (None: the defaults), `fields` any
// of its fields by name on top of it; `sync_groups` maps a stage index to the list of its
// data-parallel process groups; `vocab` the schedule's zbpipe.VocabParallelOutput (a PyVocab);
// `embedding` its zbpipe.VocabParallelEmbedding (a PyEmbed); `control_group`, a callable (store,
// rank, size, timeout_s) -> ProcessGroup (zbpipe/control_plane.py), makes the CPU control groups
// (ExecutorOptions::control_group; None: only backends that bring their own).
std::unique_ptr<runtime::Executor> make_executor(
    const Program& program, const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
    const py::dict& stages, const at::Device& device, const std::optional<PyExecutorOptions>& options,
    int global_rank, std::vector<int> group_ranks, const py::dict& sync_groups, const py::object& vocab,
    const py::object& embedding, py::object control_group, const py::kwargs& fields);

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
