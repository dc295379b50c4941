// PyVocab: the trampoline through which the C++ executor reads a Python
// zbpipe.VocabParallelOutput (its shard, parameters and a step's targets; vocab_handle.h).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <pybind11/pybind11.h>

#include <vector>

#include "runtime/vocab_handle.h"

namespace zbpipe::python {

namespace py = pybind11;

// Each call re-acquires the GIL (the executor runs without it); Python exceptions become
// StageErrors. The shard is read once, at construction.
class PyVocab final : public runtime::VocabHandle {
 public:
  explicit PyVocab(py::object output);
  ~PyVocab() override;

  const runtime::VocabShard& shard() const override { return shard_; }
  at::Tensor weight() override;
  at::Tensor bias() override;
  std::vector<at::Tensor> targets(const runtime::StepData& step) override;
  // VocabParallelOutput._zb_collective_group(pipeline, store under `name`, timeout_s).
  c10::intrusive_ptr<c10d::ProcessGroup> collective_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pipeline,
                                                          const std::string& name,
                                                          std::chrono::milliseconds timeout) override;

 private:
  py::object output_;
  runtime::VocabShard shard_;
};

}  // namespace zbpipe::python
