// An owning reference to an autograd node from its raw pointer, for the torch zbpipe builds
// against: torch 2.13 holds nodes in c10::intrusive_ptr, earlier releases (2.11, on the GPU
// machines' images) in std::shared_ptr with Node::getptr(). Both are spelled through Edge.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

namespace zbpipe::runtime {

using NodeRef = decltype(torch::autograd::Edge::function);

// Templates so that only the branch of the installed torch is instantiated.
template <class N = torch::autograd::Node, class Ref = NodeRef>
Ref node_ref(N* node) {
  if constexpr (std::is_same_v<Ref, std::shared_ptr<N>>)
    return node->getptr();
  else
    return Ref::reclaim_copy(node);
}

// A new node of type T, owned the way the installed torch owns nodes.
template <class T, class Ref = NodeRef, class... Args>
Ref make_node(Args&&... args) {
  if constexpr (std::is_same_v<Ref, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<T>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
}

}  // namespace zbpipe::runtime
