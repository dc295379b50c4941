// PyEmbed: the trampoline through which the C++ executor reads a Python
// zbpipe.VocabParallelEmbedding (its shard, weight and a step's token ids; embed_handle.h).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <pybind11/pybind11.h>

#include <vector>

#include "runtime/embed_handle.h"

namespace zbpipe::python {

namespace py = pybind11;

// Each call re-acquires the GIL (the executor runs without it); Python exceptions become
// StageErrors. The shard is read once, at construction.
class PyEmbed final : public runtime::EmbedHandle {
 public:
  explicit PyEmbed(py::object embedding);
  ~PyEmbed() override;

  const runtime::EmbedShard& shard() const override { return shard_; }
  at::Tensor weight() override;
  std::vector<at::Tensor> ids(const runtime::StepData& step) override;

 private:
  py::object embedding_;
  runtime::EmbedShard shard_;
};

}  // namespace zbpipe::python
