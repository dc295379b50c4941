// Refuses to send what a replayed CUDA graph returned. See [Note: CUDA graph outputs are not sent].
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>

namespace zbpipe::runtime {

// [Note: CUDA graph outputs are not sent]
// A replayed CUDA graph of torch.compile's cudagraph trees (mode="reduce-overhead" or
// "max-autotune") returns its outputs in the graph's memory pool, where its next replay writes
// them again, whatever the caching allocator or NCCL recorded: a send released at its post
// (P2P::post) may still be read by the backend when that replay runs. Keeping the tensor alive
// would not help (a replay does not ask the allocator), and the trees' replays follow F and B
// as the schedule interleaves them, so no point in the step is safe: such a send is refused.
// The trees mark a replay's outputs as cached tensors (at::caching); a non-contiguous output
// is sent as a copy and passes. Checked before the executor detaches the tensor (a detached
// tensor is another TensorImpl). zbpipe/device_checks.py refuses such modules at setup.

// Throws zbpipe::Error when `t`, the stage's output (`gradient`: input gradient) `index`, which
// goes to another rank, is (or is a view of) a CUDA graph replay's output.
void refuse_cuda_graph_output(const at::Tensor& t, int stage, bool gradient, size_t index);

}  // namespace zbpipe::runtime
