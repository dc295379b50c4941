// The Python side of the runtime's interfaces: PyStage, the trampoline through which the C++
// executor calls a Python zbpipe.PipelineStage (its _zb_* methods), and the holders through
// which a step's data and a stage's kept output cross the runtime as opaque values.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "runtime/errors.h"
#include "runtime/stage_handle.h"
#include "zbpipe/cancel.h"

namespace zbpipe::python {

namespace py = pybind11;

// A Python object behind one of the runtime's opaque types (StepData, StageOutput). Its
// destructor takes the GIL: the runtime may drop it from a thread that does not hold it.
template <class Base>
class PyHeld final : public Base {
 public:
  explicit PyHeld(py::object obj) : obj_(std::move(obj)) {}
  ~PyHeld() override {
    py::gil_scoped_acquire gil;
    obj_ = py::object();
  }
  const py::object& object() const { return obj_; }

 private:
  py::object obj_;
};
using PyStepData = PyHeld<runtime::StepData>;
using PyStageOutput = PyHeld<runtime::StageOutput>;

// The Python object of a step made by run_step (py_executor.h); throws for any other StepData.
const py::object& step_object(const runtime::StepData& step);

// TensorSpecs <-> Python [(shape tuple, dtype)].
py::list specs_to_py(const std::vector<runtime::TensorSpec>& specs);
std::vector<runtime::TensorSpec> specs_from_py(const py::handle& obj);
// A Signature from Python's (specs, structure) pair; None gives the empty signature.
runtime::Signature signature_from_py(const py::handle& obj);

// A Python exception as a StageError: its summary ("<Type>: <message>", the first line of
// every rank's report) and its formatted traceback without that summary at its end (shown on
// this rank only), so the user's message appears once.
runtime::StageError stage_error(py::error_already_set& e);
// The same from a Python exception's type, value and traceback (the GIL held).
runtime::StageError stage_error(py::handle type, py::handle value, py::handle trace);
// Runs f() (with the GIL held) and turns a Python exception into a StageError (stage_error);
// KeyboardInterrupt (Ctrl-C reached the stage's code) into zbpipe::Cancelled, so the step
// ends as interrupted (see step_interrupt.h). `where` names the Python code that raised.
template <typename F>
auto guarded(F&& f, const char* where = "the stage") -> decltype(f()) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_KeyboardInterrupt)) throw Cancelled();
    throw stage_error(e);
  } catch (py::cast_error& e) {
    throw runtime::StageError(std::string("TypeError: ") + where + " returned a value of the wrong type: " + e.what(), "");
  }
}

// Each call re-acquires the GIL (the executor runs without it); Python exceptions become
// StageErrors (guarded). The stage's _zb_* methods (the Python list: zbpipe/stage_interface.py)
// are looked up once, at construction, or by name at each call.
class PyStage final : public runtime::StageHandle {
 public:
  explicit PyStage(py::object stage);
  ~PyStage() override;

  runtime::ForwardResult forward(const runtime::StepData& step, int mb,
                                 const std::vector<at::Tensor>& inputs) override;
  bool queues_weight_work() const override { return queues_weight_; }
  void run_weight_work(const runtime::StepData& step, int mb) override;
  void weight_work_queued(const runtime::StepData& step, int mb) override;
  void backward_input_done(const runtime::StepData& step, int mb) override;
  bool syncs_gradients() const override { return syncs_grads_; }
  void begin_gradient_sync(const std::vector<at::Tensor>& roots) override;
  void end_gradient_sync() override;
  void use_inputs(const runtime::Signature& inputs) override;
  runtime::Signature infer_outputs(const runtime::StepData& step, const runtime::Signature& inputs) override;
  void before_backward_on_worker(const runtime::StepData& step, int mb) override;
  void split_fell_back(const std::string& reason) override;
  // A Python exception raised inside the engine (torch's python_error: a custom Function's
  // backward, a hook) as a StageError, KeyboardInterrupt as Cancelled; anything else as it is.
  std::exception_ptr describe_backward_error(std::exception_ptr error) override;

 private:
  py::object stage_, forward_, weight_work_, weight_queued_, infer_;
  bool queues_weight_;
  bool syncs_grads_;
};

}  // namespace zbpipe::python
