// Refusing to send a replayed CUDA graph's output; see graph_outputs.h.
#include "runtime/graph_outputs.h"

#include <ATen/CachedTensorUtils.h>

#include "runtime/errors.h"

namespace zbpipe::runtime {

void refuse_cuda_graph_output(const at::Tensor& t, int stage, bool gradient, size_t index) {
  if (!t.defined() || !t.is_contiguous()) return;
  const bool replayed =
      at::caching::is_cached_tensor(t) || (t.is_view() && at::caching::is_cached_tensor(at::Tensor(t._base())));
  ZB_CHECK(!replayed, "stage ", stage, "'s ", gradient ? "input gradient " : "output ", index,
           ", sent to another rank, is the output of a CUDA graph replay (torch.compile mode=\"reduce-overhead\" "
           "or \"max-autotune\", cudagraph trees): the graph's next replay rewrites its memory while the message "
           "may still be read from it. Compile the stage without CUDA graphs (mode=\"max-autotune-no-cudagraphs\" "
           "or the default mode), or return a clone (docs/nccl.md#cuda-graphs)");
}

}  // namespace zbpipe::runtime
