// The generated nodes whose weight side needs their input side (joint_backward.h).
#include "runtime/joint_backward.h"

#include <algorithm>

namespace zbpipe::runtime {

const std::vector<std::string>& joint_backward_nodes() {
  // torch 2.13's derivatives.yaml: the formulas of several inputs without grad_input_mask
  // (tests/runtime/test_stage_backward.py derives this list from it), and the RNNs of cuDNN
  // and MIOpen, whose backward computes the input side unconditionally before the weights.
  static const std::vector<std::string> names = {
      "ConvTbcBackward0",
      "CudnnAttentionBackward0",
      "CudnnGridSamplerBackward0",
      "CudnnRnnBackward0",
      "EfficientAttentionBackward0",
      "EuclideanDistBackward0",
      "FakeQuantizeLearnablePerChannelAffineBackward0",
      "FakeQuantizeLearnablePerTensorAffineBackward0",
      "FlashAttentionBackward0",
      "GridSampler2DCpuFallbackBackward0",
      "IndexReduceBackward0",
      "LinalgHouseholderProductBackward0",
      "LinearBackwardBackward0",
      "LstmMpsBackward0",
      "MiopenRnnBackward0",
      "MkldnnRnnLayerBackward0",
      "PolarBackward0",
      "PreluKernelBackward0",
      "ScaledDotProductCudnnAttentionBackward0",
      "ScaledDotProductFlashAttentionBackward0",
      "ScaledDotProductFlashAttentionForCpuBackward0",
      "ScatterReduceBackward0",
      "ThnnFusedGruCellBackward0",
      "ThnnFusedLstmCellBackward0",
      "WeightNormInterfaceBackward0",
  };
  return names;
}

bool computes_weight_side_with_input_side(std::string_view name) {
  const auto& names = joint_backward_nodes();
  return std::binary_search(names.begin(), names.end(), name,
                            [](std::string_view a, std::string_view b) { return a < b; });
}

}  // namespace zbpipe::runtime
