// The runtime's Python face (see py_executor.h).
#include "python/py_executor.h"

#include <chrono>
#include <map>

#include "python/py_stage.h"
#include "python/py_embed.h"
#include "python/py_vocab.h"
#include "python/step_interrupt.h"
#include "runtime/replica_barrier.h"
#include "runtime/p2p.h"
#include "runtime/store_inbox.h"
#include "runtime/trace.h"

namespace zbpipe::python {

namespace {

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// register_custom_function's handler: a Python callable fn(action), called with the GIL.
class PyCustomActions final : public runtime::CustomActions {
 public:
  explicit PyCustomActions(py::object fn) : fn_(std::move(fn)) {}
  ~PyCustomActions() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  void run(const Action& action) override {
    py::gil_scoped_acquire gil;
    guarded([&] { fn_(action); }, "the custom function");
  }

 private:
  py::object fn_;
};

py::dict trace_record_to_py(const runtime::TraceRecord& r) {
  py::dict d;
  d["action"] = r.action;
  d["rank"] = r.rank;
  d["index"] = r.index;
  d["entry"] = r.entry;
  d["unit"] = r.unit;
  d["host_start_ns"] = r.host_start_ns;
  d["host_end_ns"] = r.host_end_ns;
  d["wait_ns"] = r.wait_ns;
  d["cpu_ns"] = r.cpu_ns;
  d["worker"] = r.worker;
  d["device_start_us"] = r.device_start_us;
  d["device_end_us"] = r.device_end_us;
  return d;
}

std::map<int, std::vector<std::shared_ptr<c10d::ProcessGroup>>> sync_groups_from_py(const py::dict& groups) {
  std::map<int, std::vector<std::shared_ptr<c10d::ProcessGroup>>> out;
  for (auto [stage, list] : groups)
    for (auto g : list) out[stage.cast<int>()].push_back(runtime::share_group(g.cast<c10::intrusive_ptr<c10d::ProcessGroup>>()));
  return out;
}

py::tuple signature_to_py(const runtime::Signature& s) {
  return py::make_tuple(specs_to_py(s.specs), s.structure);
}

// `base` with `fields` (name -> value) set through the class's properties: TypeError for a
// name that is no field, or a value of the wrong type.
PyExecutorOptions with_fields(PyExecutorOptions base, const py::dict& fields) {
  if (fields.empty()) return base;
  py::object options = py::cast(std::move(base));
  const py::object known = py::type::handle_of(options).attr("fields");
  for (auto [name, value] : fields) {
    if (!known.contains(name))
      throw py::type_error(detail::str("ExecutorOptions has no field '", py::str(name).cast<std::string>(),
                                       "' (its fields: ", py::str(", ").attr("join")(known).cast<std::string>(), ")"));
    py::setattr(options, name, value);
  }
  return options.cast<PyExecutorOptions>();
}

}  // namespace

ExecutorOptionsClass::ExecutorOptionsClass(py::module_& m, const char* doc) : cls_(m, "ExecutorOptions", doc) {
  cls_.attr("fields") = py::tuple();
  cls_.def(py::init([](const py::kwargs& fields) { return with_fields(PyExecutorOptions{}, fields); }));
  cls_.def("__repr__", [](const py::object& self) {
    std::string out = "ExecutorOptions(";
    const char* sep = "";
    for (auto name : py::type::handle_of(self).attr("fields")) {
      out += sep + name.cast<std::string>() + "=" + py::repr(self.attr(name)).cast<std::string>();
      sep = ", ";
    }
    return out + ")";
  });
}

ExecutorOptionsClass& ExecutorOptionsClass::seconds(
    const char* name, std::chrono::milliseconds runtime::ExecutorOptions::*member, const char* doc) {
  cls_.def_property(
      name, [member](const PyExecutorOptions& o) { return (o.executor.*member).count() / 1000.0; },
      [member, name](PyExecutorOptions& o, const py::handle& v) {
        o.executor.*member = to_ms(arg<double>(v, "ExecutorOptions", name, "a number of seconds"));
      },
      doc);
  return listed(name);
}

ExecutorOptionsClass& ExecutorOptionsClass::listed(const char* name) {
  py::list names(cls_.attr("fields"));
  names.append(name);
  cls_.attr("fields") = py::tuple(names);
  return *this;
}

std::unique_ptr<runtime::Executor> make_executor(
    const Program& program, const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
    const py::dict& stages, const at::Device& device, const std::optional<PyExecutorOptions>& options,
    int global_rank, std::vector<int> group_ranks, const py::dict& sync_groups, const py::object& vocab,
    const py::object& embedding, py::object control_group, const py::kwargs& fields) {
  std::map<int, std::shared_ptr<runtime::StageHandle>> handles;
  for (auto [index, stage] : stages)
    handles[index.cast<int>()] = std::make_shared<PyStage>(py::reinterpret_borrow<py::object>(stage));
  const PyExecutorOptions chosen = with_fields(options.value_or(PyExecutorOptions{}), fields);
  runtime::ExecutorOptions executor_options = chosen.executor;
  executor_options.global_rank = global_rank;
  executor_options.group_ranks = std::move(group_ranks);
  executor_options.sync_groups = sync_groups_from_py(sync_groups);
  if (!vocab.is_none()) executor_options.vocab = std::make_shared<PyVocab>(vocab);
  if (!embedding.is_none()) executor_options.embedding = std::make_shared<PyEmbed>(embedding);
  executor_options.control_group = control_group_factory(std::move(control_group));
  return std::make_unique<runtime::Executor>(
      program, std::make_unique<runtime::P2P>(process_group, device, chosen.p2p), std::move(handles),
      std::move(executor_options));
}

py::tuple run_step(runtime::Executor& executor, py::object step, py::object first_inputs,
                   double loss_scale) {
  const PyStepData data(std::move(step));
  const runtime::Signature inputs = signature_from_py(first_inputs);
  runtime::StepResult result;
  {
    StepInterrupt sigint([&executor] { executor.interrupt(); });
    try {
      py::gil_scoped_release nogil;  // stage calls take it back (PyStage)
      result = executor.run(data, inputs, loss_scale);
    } catch (const Cancelled&) {  // Ctrl-C: the handler's exception, else KeyboardInterrupt
      if (PyErr_CheckSignals() == 0 && !PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
      throw py::error_already_set();
    }
  }
  py::list outputs, losses;
  for (const auto& out : result.outputs)
    outputs.append(out ? static_cast<const PyStageOutput&>(*out).object() : py::none());
  for (const auto& loss : result.losses)
    losses.append(loss.defined() ? py::cast(loss) : py::none());
  return py::make_tuple(outputs, losses);
}

runtime::ControlGroupFactory control_group_factory(py::object fn) {
  if (fn.is_none()) return {};
  // The executor may drop its options on any thread: the callable goes with the GIL taken.
  std::shared_ptr<py::object> held(new py::object(std::move(fn)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
  return [held](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
    py::gil_scoped_acquire gil;
    py::object group = (*held)(store, rank, size, timeout.count() / 1000.0);
    return group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  };
}

bool store_polled(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  ZB_CHECK(group && group->getStore(), "a process group with a store is required");
  py::gil_scoped_release nogil;  // one request to the store
  return runtime::store_waits(*group->getStore()) == runtime::StoreWaits::Polled;
}

void set_custom_actions(runtime::Executor& executor, py::object fn, const std::vector<Kind>& kinds) {
  executor.set_custom_actions(fn.is_none() ? nullptr : std::make_shared<PyCustomActions>(std::move(fn)), kinds);
}

void set_timeout(runtime::Executor& executor, double timeout_s) { executor.set_timeout(to_ms(timeout_s)); }

void report_setup_failure(const c10::intrusive_ptr<c10d::ProcessGroup>& process_group, const py::list& sync_groups,
                          int global_rank, const std::string& what) {
  std::vector<std::shared_ptr<c10d::ProcessGroup>> groups;
  for (auto g : sync_groups) groups.push_back(runtime::share_group(g.cast<c10::intrusive_ptr<c10d::ProcessGroup>>()));
  py::gil_scoped_release nogil;  // the stores only
  runtime::StepFailures::report_setup_failure(process_group, groups, global_rank, what);
}

py::tuple signatures_to_py(const runtime::Executor& executor, int stage) {
  const auto& s = executor.signatures(stage);
  return py::make_tuple(signature_to_py(s.inputs), signature_to_py(s.outputs));
}

py::list trace_to_py(const runtime::Executor& executor) {
  py::list out;
  for (const auto& r : executor.trace()) out.append(trace_record_to_py(r));
  return out;
}

std::string chrome_trace(const runtime::Executor& executor) {
  return runtime::chrome_trace_json(executor.trace());
}

void export_chrome_trace(const runtime::Executor& executor, const std::string& path) {
  runtime::write_chrome_trace(path, executor.trace());
}

py::list loopback_events(const runtime::LoopbackWorld& world, int rank) {
  py::list out;
  for (const auto& e : world.events(rank)) {
    const char* type = e.type == runtime::LoopbackEvent::Type::Post   ? "post"
                       : e.type == runtime::LoopbackEvent::Type::Wait ? "wait"
                                                                      : "sync";
    py::list ops;
    for (const auto& o : e.ops) ops.append(py::make_tuple(o.is_send ? "send" : "recv", o.peer, o.tag, o.bytes));
    out.append(py::make_tuple(type, e.work, e.coalesced, ops));
  }
  return out;
}

}  // namespace zbpipe::python
