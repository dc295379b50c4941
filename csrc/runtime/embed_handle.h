// The executor's view of a vocabulary-parallel input embedding (zbpipe.VocabParallelEmbedding):
// this rank's shard of the embedding's rows and the token ids of a step. An interface, so
// csrc/runtime needs no pybind11 (the Python object implements it through py_embed.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "runtime/stage_handle.h"

namespace zbpipe::runtime {

// Which rows of the embedding this rank holds: [begin, end) of a vocabulary of `vocab` rows.
struct EmbedShard {
  int64_t begin = 0, end = 0, vocab = 0;
  int64_t dim = 0;           // the embedding's width (stage 0's input width)
  int64_t padding_idx = -1;  // a token whose row gets no gradient (nn.Embedding's), -1: none
};

// Contract: every call is made from the executor thread, without the GIL held.
class EmbedHandle {
 public:
  virtual ~EmbedHandle() = default;
  virtual const EmbedShard& shard() const = 0;
  // The shard's weight rows [end - begin, dim] as they are now (read at every step); its .grad
  // is where EW accumulates.
  virtual at::Tensor weight() = 0;
  // The token ids of every microbatch of `step` (integer, any shape; checked by the front end).
  virtual std::vector<at::Tensor> ids(const StepData& step) = 0;
};

}  // namespace zbpipe::runtime
