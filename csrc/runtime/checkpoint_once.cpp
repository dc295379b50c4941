// The keep flag of a boundary node's run in I; see checkpoint_once.h.
#include "runtime/checkpoint_once.h"

#include <torch/csrc/autograd/function_hook.h>

#include <utility>

namespace zbpipe::runtime::checkpoint_once {

namespace {

using Open = std::shared_ptr<std::atomic<bool>>;

// This thread's flag: the scope it was raised under and the boundary nodes running in I here.
struct ThreadKeep {
  Open scope;
  int depth = 0;
};
thread_local ThreadKeep keep;

class BeginKeep final : public torch::autograd::FunctionPreHook {
 public:
  explicit BeginKeep(Open scope) : scope_(std::move(scope)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (keep.scope != scope_) keep = ThreadKeep{scope_, 0};  // what an earlier scope left is void
    ++keep.depth;
    return grads;
  }

 private:
  Open scope_;
};

class EndKeep final : public torch::autograd::FunctionPostHook {
 public:
  explicit EndKeep(Open scope) : scope_(std::move(scope)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (keep.scope == scope_ && keep.depth > 0 && --keep.depth == 0) keep = ThreadKeep{};
    return outputs;
  }

 private:
  Open scope_;
};

}  // namespace

bool keeps_unpacked() { return keep.depth > 0 && keep.scope && keep.scope->load(std::memory_order_acquire); }

KeepScope::KeepScope() : open_(std::make_shared<std::atomic<bool>>(true)) {}

KeepScope::~KeepScope() {
  open_->store(false, std::memory_order_release);  // every thread's flag under it reads false
  if (keep.scope == open_) keep = ThreadKeep{};
}

KeepHooks add_keep_hooks(torch::autograd::Node& node, const KeepScope& scope) {
  auto pre = std::make_unique<BeginKeep>(scope.open_);
  auto post = std::make_unique<EndKeep>(scope.open_);
  KeepHooks hooks{pre.get(), post.get()};
  node.add_pre_hook(std::move(pre));
  node.add_post_hook(std::move(post));
  return hooks;
}

}  // namespace zbpipe::runtime::checkpoint_once
