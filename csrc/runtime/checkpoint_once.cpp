// The keep flag of a boundary node's run in I; see checkpoint_once.h.
#include "runtime/checkpoint_once.h"

#include <torch/csrc/autograd/function_hook.h>

#include <memory>

namespace zbpipe::runtime::checkpoint_once {

namespace {

thread_local int keep_depth = 0;  // boundary nodes running in I on this thread

class BeginKeep final : public torch::autograd::FunctionPreHook {
 public:
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    ++keep_depth;
    return grads;
  }
};

class EndKeep final : public torch::autograd::FunctionPostHook {
 public:
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (keep_depth > 0) --keep_depth;
    return outputs;
  }
};

}  // namespace

bool keeps_unpacked() { return keep_depth > 0; }

KeepHooks add_keep_hooks(torch::autograd::Node& node) {
  auto pre = std::make_unique<BeginKeep>();
  auto post = std::make_unique<EndKeep>();
  KeepHooks hooks{pre.get(), post.get()};
  node.add_pre_hook(std::move(pre));
  node.add_post_hook(std::move(post));
  return hooks;
}

ClearKeepOnExit::~ClearKeepOnExit() { keep_depth = 0; }

}  // namespace zbpipe::runtime::checkpoint_once
