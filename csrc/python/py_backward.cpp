// The stage backward's Python face (see py_backward.h).
#include "python/py_backward.h"

#include <memory>

#include "runtime/joint_backward.h"

namespace zbpipe::python {

py::tuple backward_input(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& root_grads,
                         const std::vector<at::Tensor>& inputs, runtime::SplitPlanCache* cache) {
  auto work = std::make_unique<runtime::WeightWork>();
  std::vector<at::Tensor> grads;
  {
    py::gil_scoped_release nogil;
    grads = runtime::backward_input(roots, root_grads, inputs, *work, cache);
  }
  return py::make_tuple(grads, std::move(work));
}

std::size_t weight_work_roots(const runtime::WeightWork& work) { return work.roots.size(); }

py::object weight_work_fused(const runtime::WeightWork& work) {
  return work.fused.empty() ? py::object(py::none()) : py::object(py::str(work.fused));
}

py::list joint_backward_nodes() { return py::cast(runtime::joint_backward_nodes()); }

py::list weight_work_rerun(const runtime::WeightWork& work) {
  py::list names;
  for (const auto& node : work.rerun) names.append(node->name());
  return names;
}

}  // namespace zbpipe::python
