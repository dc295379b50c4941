// PyStage and the opaque-value holders (see py_stage.h).
#include "python/py_stage.h"

#include <torch/csrc/Exceptions.h>

#include "zbpipe/error.h"

namespace zbpipe::python {

const py::object& step_object(const runtime::StepData& step) {
  const auto* held = dynamic_cast<const PyStepData*>(&step);
  ZB_CHECK(held, "a Python stage was called with a step not made by Executor.run");
  return held->object();
}

py::list specs_to_py(const std::vector<runtime::TensorSpec>& specs) {
  py::list out;
  for (const auto& s : specs) out.append(py::make_tuple(py::tuple(py::cast(s.shape)), s.dtype));
  return out;
}

std::vector<runtime::TensorSpec> specs_from_py(const py::handle& obj) {
  std::vector<runtime::TensorSpec> out;
  for (auto item : obj) {
    auto pair = item.cast<py::tuple>();
    out.push_back(runtime::TensorSpec{pair[0].cast<std::vector<int64_t>>(), pair[1].cast<at::ScalarType>()});
  }
  return out;
}

runtime::Signature signature_from_py(const py::handle& obj) {
  if (obj.is_none()) return {};
  auto pair = obj.cast<py::tuple>();
  return runtime::Signature{specs_from_py(pair[0]), pair[1].cast<std::string>()};
}

runtime::StageError stage_error(py::error_already_set& e) {
  try {
    return stage_error(e.type(), e.value(), e.trace());
  } catch (...) {
    return runtime::StageError(e.what(), "");
  }
}

runtime::StageError stage_error(py::handle type, py::handle value, py::handle trace_obj) {
  {
    auto tb = py::module_::import("traceback");
    std::string summary = py::str("").attr("join")(tb.attr("format_exception_only")(type, value))
                              .cast<std::string>();
    while (!summary.empty() && summary.back() == '\n') summary.pop_back();
    std::string trace = trace_obj.is_none() ? std::string()
                        : py::str("").attr("join")(tb.attr("format_exception")(type, value, trace_obj))
                              .cast<std::string>();
    // The traceback ends with the summary, which the report's first line already says: once.
    while (!trace.empty() && trace.back() == '\n') trace.pop_back();
    if (trace.size() > summary.size() && trace.compare(trace.size() - summary.size(), summary.size(), summary) == 0)
      trace.resize(trace.size() - summary.size());
    return runtime::StageError(std::move(summary), std::move(trace));
  }
}

PyStage::PyStage(py::object stage)
    : stage_(std::move(stage)),
      forward_(stage_.attr("_zb_forward")),
      weight_work_(stage_.attr("_zb_weight_work")),
      weight_queued_(stage_.attr("_zb_weight_work_queued")),
      infer_(stage_.attr("_zb_infer_outputs")),
      queues_weight_(stage_.attr("_zb_queues_weight_work").cast<bool>()),
      syncs_grads_(stage_.attr("_zb_syncs_gradients").cast<bool>()) {}

PyStage::~PyStage() {
  py::gil_scoped_acquire gil;
  stage_ = forward_ = weight_work_ = weight_queued_ = infer_ = py::object();
}

runtime::ForwardResult PyStage::forward(const runtime::StepData& step, int mb,
                                        const std::vector<at::Tensor>& inputs) {
  py::gil_scoped_acquire gil;
  return guarded([&] {
    // _zb_forward returns (flat tensors, detached loss or None, kept output or None).
    py::tuple res = forward_(step_object(step), mb, inputs);
    runtime::ForwardResult out;
    out.tensors = res[0].cast<std::vector<at::Tensor>>();
    if (!res[1].is_none()) out.loss = res[1].cast<at::Tensor>();
    if (!res[2].is_none()) out.output = std::make_shared<PyStageOutput>(res[2]);
    return out;
  });
}

void PyStage::run_weight_work(const runtime::StepData& step, int mb) {
  py::gil_scoped_acquire gil;
  guarded([&] { weight_work_(step_object(step), mb); });
}

void PyStage::weight_work_queued(const runtime::StepData& step, int mb) {
  py::gil_scoped_acquire gil;
  guarded([&] { weight_queued_(step_object(step), mb); });
}

void PyStage::backward_input_done(const runtime::StepData& step, int mb) {
  py::gil_scoped_acquire gil;
  guarded([&] { stage_.attr("_zb_backward_input_done")(step_object(step), mb); });
}

void PyStage::begin_gradient_sync(const std::vector<at::Tensor>& roots) {
  py::gil_scoped_acquire gil;
  guarded([&] { stage_.attr("_zb_grad_sync_begin")(roots); });
}

void PyStage::end_gradient_sync() {
  py::gil_scoped_acquire gil;
  guarded([&] { stage_.attr("_zb_grad_sync_end")(); });
}

void PyStage::use_inputs(const runtime::Signature& inputs) {
  py::gil_scoped_acquire gil;
  guarded([&] { stage_.attr("_zb_use_inputs")(inputs.structure); });
}

void PyStage::before_backward_on_worker(const runtime::StepData& step, int mb) {
  py::gil_scoped_acquire gil;
  guarded([&] { stage_.attr("_zb_before_backward_on_worker")(step_object(step), mb); });
}

void PyStage::split_fell_back(const std::string& reason) {
  py::gil_scoped_acquire gil;
  guarded([&] { stage_.attr("_zb_split_fell_back")(reason); });
}

std::exception_ptr PyStage::describe_backward_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const python_error& e) {
    py::gil_scoped_acquire gil;
    // torch's PythonEngine::execute restores the error into this thread's interpreter state
    // before it rethrows (for a Python caller to raise): it is the one described here, and
    // left set it would fail this thread's next call into Python.
    PyErr_Clear();
    if (!e.type) return error;  // not fetched from the interpreter: its message is all there is
    // torch fetched it unnormalized (the value may still be the exception's arguments).
    PyObject *type = e.type, *value = e.value, *trace = e.traceback;
    Py_XINCREF(type);
    Py_XINCREF(value);
    Py_XINCREF(trace);
    PyErr_NormalizeException(&type, &value, &trace);
    auto t = py::reinterpret_steal<py::object>(type), v = py::reinterpret_steal<py::object>(value);
    auto tb = py::reinterpret_steal<py::object>(trace);
    if (PyErr_GivenExceptionMatches(t.ptr(), PyExc_KeyboardInterrupt)) return std::make_exception_ptr(Cancelled());
    try {
      return std::make_exception_ptr(stage_error(t, v ? v : py::none(), tb ? tb : py::none()));
    } catch (py::error_already_set&) {
      return error;  // formatting failed: the message as torch built it
    }
  } catch (...) {
    return error;
  }
}

runtime::Signature PyStage::infer_outputs(const runtime::StepData& step, const runtime::Signature& inputs) {
  py::gil_scoped_acquire gil;
  return guarded([&] { return signature_from_py(infer_(step_object(step), specs_to_py(inputs.specs), inputs.structure)); });
}

}  // namespace zbpipe::python
