// Torch's generated backward nodes whose weight side cannot run without their input side:
// the split runs them whole in I, once (stage_backward.h).
//
// A generated node computes only the outputs the running graph task needs, so a boundary node
// normally does its input side in I and is re-run in W for its weight side. That halves the
// work only where its formula honours the request (native_layer_norm_backward's output_mask,
// convolution_backward's). The nodes listed here compute every output in one call whatever is
// asked (mkldnn_rnn_layer_backward: a CPU LSTM's input and weight gradients together), or
// compute the input side anyway to reach the weight side (_cudnn_rnn_backward): re-running them
// in W would redo the whole backward of the layer.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace zbpipe::runtime {

// Whether torch's generated node `name` (Node::name(), e.g. "MkldnnRnnLayerBackward0") is one.
bool computes_weight_side_with_input_side(std::string_view name);

// The list, for the test that keeps it equal to torch's derivatives.yaml.
const std::vector<std::string>& joint_backward_nodes();

}  // namespace zbpipe::runtime
