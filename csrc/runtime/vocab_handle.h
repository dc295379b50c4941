// The executor's view of a vocabulary-parallel output layer (zbpipe.VocabParallelOutput): this
// rank's shard of the LM head and the targets of a step. An interface, so csrc/runtime needs no
// pybind11 (the Python object implements it through csrc/python/py_vocab.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/stage_handle.h"

namespace zbpipe::runtime {

// Which rows of the head this rank holds: [begin, end) of a vocabulary of `vocab` entries.
struct VocabShard {
  int64_t begin = 0, end = 0, vocab = 0;
  int64_t in_features = 0;   // the head's input width (the last stage's output width)
  int64_t ignore_index = -100;  // a target that counts in no loss
  // Emulated devices (zbpipe bench, benchmarks/bench_vocab.py): each S and T also spends this
  // long without using the CPU (a sleep), so a tiny head stands for a large one's passes.
  double emulate_s_ms = 0.0, emulate_t_ms = 0.0;
};

// Contract: every call is made from the executor thread, without the GIL held.
class VocabHandle {
 public:
  virtual ~VocabHandle() = default;
  virtual const VocabShard& shard() const = 0;
  // The shard's parameters as they are now (read at every step): the weight rows
  // [end - begin, in_features] and the bias rows [end - begin] (undefined without a bias).
  // Their .grad is where T accumulates.
  virtual at::Tensor weight() = 0;
  virtual at::Tensor bias() = 0;
  // The targets of every microbatch of `step` (token ids, integer; any shape, one per token of
  // the last stage's output), checked by the front end.
  virtual std::vector<at::Tensor> targets(const StepData& step) = 0;
  // Stream-ordered backends (vocab_run.h): the process group the head's collectives run on, of
  // `pipeline`'s ranks in its order: the user's, else one the front end makes like `pipeline`'s
  // backend over its store under prefix `name` (every rank blocks until all made it, at most
  // `timeout`), else null (the executor then asks the backend).
  virtual c10::intrusive_ptr<c10d::ProcessGroup> collective_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pipeline,
                                                                  const std::string& name,
                                                                  std::chrono::milliseconds timeout) = 0;
};

}  // namespace zbpipe::runtime
