// PyVocab (see py_vocab.h).
#include "python/py_vocab.h"

#include "python/py_stage.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace zbpipe::python {

PyVocab::PyVocab(py::object output) : output_(std::move(output)) {
  const auto range = output_.attr("shard_range").cast<std::pair<int64_t, int64_t>>();
  shard_.begin = range.first;
  shard_.end = range.second;
  shard_.vocab = output_.attr("vocab_size").cast<int64_t>();
  shard_.in_features = output_.attr("in_features").cast<int64_t>();
  shard_.ignore_index = output_.attr("ignore_index").cast<int64_t>();
  const auto emulate = output_.attr("_emulate_ms").cast<std::pair<double, double>>();
  shard_.emulate_s_ms = emulate.first;
  shard_.emulate_t_ms = emulate.second;
}

PyVocab::~PyVocab() {
  py::gil_scoped_acquire gil;
  output_ = py::object();
}

at::Tensor PyVocab::weight() {
  py::gil_scoped_acquire gil;
  return guarded([&] { return output_.attr("weight").cast<at::Tensor>(); }, "the vocabulary-parallel output");
}

at::Tensor PyVocab::bias() {
  py::gil_scoped_acquire gil;
  return guarded([&] {
    py::object b = output_.attr("bias");
    return b.is_none() ? at::Tensor() : b.cast<at::Tensor>();
  }, "the vocabulary-parallel output");
}

std::vector<at::Tensor> PyVocab::targets(const runtime::StepData& step) {
  py::gil_scoped_acquire gil;
  return guarded([&] { return output_.attr("_zb_targets")(step_object(step)).cast<std::vector<at::Tensor>>(); },
                 "the vocabulary-parallel output");
}

c10::intrusive_ptr<c10d::ProcessGroup> PyVocab::collective_group(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pipeline, const std::string& name, std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  return guarded([&] {
    c10::intrusive_ptr<c10d::Store> store;
    if (pipeline->getStore()) store = c10::make_intrusive<c10d::PrefixStore>(name, pipeline->getStore());
    py::object group = output_.attr("_zb_collective_group")(pipeline, store, timeout.count() / 1000.0);
    return group.is_none() ? c10::intrusive_ptr<c10d::ProcessGroup>()
                           : group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  }, "the vocabulary-parallel output");
}

}  // namespace zbpipe::python
