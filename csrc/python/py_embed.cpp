// PyEmbed (see py_embed.h).
#include "python/py_embed.h"

#include "python/py_stage.h"

namespace zbpipe::python {

PyEmbed::PyEmbed(py::object embedding) : embedding_(std::move(embedding)) {
  const auto range = embedding_.attr("shard_range").cast<std::pair<int64_t, int64_t>>();
  shard_.begin = range.first;
  shard_.end = range.second;
  shard_.vocab = embedding_.attr("num_embeddings").cast<int64_t>();
  shard_.dim = embedding_.attr("embedding_dim").cast<int64_t>();
  py::object padding = embedding_.attr("padding_idx");
  shard_.padding_idx = padding.is_none() ? -1 : padding.cast<int64_t>();
}

PyEmbed::~PyEmbed() {
  py::gil_scoped_acquire gil;
  embedding_ = py::object();
}

at::Tensor PyEmbed::weight() {
  py::gil_scoped_acquire gil;
  return guarded([&] { return embedding_.attr("weight").cast<at::Tensor>(); }, "the vocabulary-parallel embedding");
}

std::vector<at::Tensor> PyEmbed::ids(const runtime::StepData& step) {
  py::gil_scoped_acquire gil;
  return guarded([&] { return embedding_.attr("_zb_ids")(step_object(step)).cast<std::vector<at::Tensor>>(); },
                 "the vocabulary-parallel embedding");
}

}  // namespace zbpipe::python
