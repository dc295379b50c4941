// The stage backward's Python face (zbpipe._C.backward_*): the split the executor runs for B,
// I and W, callable on its own (single process) by tests and by trainers that split a backward
// themselves.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <pybind11/pybind11.h>

#include <vector>

#include "runtime/stage_backward.h"

namespace zbpipe::python {

namespace py = pybind11;

// I: (gradients of `inputs`, WeightWork) with the GIL released; no parameter .grad is touched.
py::tuple backward_input(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& root_grads,
                         const std::vector<at::Tensor>& inputs, runtime::SplitPlanCache* cache);

std::size_t weight_work_roots(const runtime::WeightWork& work);
// Names of the boundary nodes W runs again for their weight side.
py::list weight_work_rerun(const runtime::WeightWork& work);
// Why I ran the whole backward (WeightWork::fused), or None.
py::object weight_work_fused(const runtime::WeightWork& work);
// runtime::joint_backward_nodes(), for the test that checks it against torch.
py::list joint_backward_nodes();

}  // namespace zbpipe::python
