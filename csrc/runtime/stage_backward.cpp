// Stage backward (B) and its exact split (I, W) on the autograd engine; see stage_backward.h.
#include "runtime/stage_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace zbpipe::runtime {

namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

variable_list run_engine(const edge_list& roots, const variable_list& grads, bool keep_graph,
                         bool accumulate_grad, const edge_list& outputs = {}) {
  return torch::autograd::Engine::get_default_engine().execute(
      roots, grads, keep_graph, /*create_graph=*/false, accumulate_grad, outputs);
}

// The roots that carry a gradient, as graph edges, with their gradients.
void root_edges(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& root_grads,
                edge_list& edges, variable_list& grads) {
  TORCH_CHECK(roots.size() == root_grads.size(), "zbpipe backward: ", roots.size(),
              " roots but ", root_grads.size(), " gradients");
  for (size_t i = 0; i < roots.size(); ++i) {
    if (!roots[i].defined() || !roots[i].requires_grad()) continue;
    edges.push_back(torch::autograd::impl::gradient_edge(roots[i]));
    grads.push_back(root_grads[i]);
  }
}

// Boundary slots of the weight region and the boundary nodes to clamp (see the header).
struct Plan {
  struct Slot {
    c10::intrusive_ptr<Node> node;
    std::vector<uint32_t> input_nrs;  // sorted, unique
  };
  std::vector<Slot> slots;               // in discovery order (deterministic)
  std::unordered_set<const Node*> clamped;
};

Plan make_plan(const edge_list& roots, const std::vector<const Node*>& input_nodes) {
  // Every node below the roots, in discovery order, with its parents.
  std::unordered_map<const Node*, std::vector<const Node*>> parents;
  std::unordered_set<const Node*> seen;
  std::vector<const Node*> order, stack;
  for (const Edge& e : roots)
    if (seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    order.push_back(n);
    for (const Edge& c : n->next_edges()) {
      if (!c.is_valid()) continue;
      parents[c.function.get()].push_back(n);
      if (seen.insert(c.function.get()).second) stack.push_back(c.function.get());
    }
  }

  // Input closure: the inputs' nodes and everything above them.
  std::unordered_set<const Node*> closure;
  for (const Node* n : input_nodes)
    if (seen.count(n)) stack.push_back(n);
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (!closure.insert(n).second) continue;
    auto it = parents.find(n);
    if (it == parents.end()) continue;
    for (const Node* p : it->second)
      if (!closure.count(p)) stack.push_back(p);
  }

  Plan plan;
  std::unordered_map<const Node*, size_t> slot_of;
  auto add_slot = [&](const Edge& e) {
    auto [it, fresh] = slot_of.emplace(e.function.get(), plan.slots.size());
    if (fresh) plan.slots.push_back(Plan::Slot{e.function, {}});
    auto& nrs = plan.slots[it->second].input_nrs;
    if (std::find(nrs.begin(), nrs.end(), e.input_nr) == nrs.end()) nrs.push_back(e.input_nr);
  };
  for (const Node* n : order) {
    if (!closure.count(n)) continue;
    for (const Edge& c : n->next_edges())
      if (c.is_valid() && !closure.count(c.function.get())) add_slot(c);
  }
  for (const Edge& e : roots)  // outputs computed without touching the inputs
    if (!closure.count(e.function.get())) add_slot(e);

  // Boundary nodes below another boundary node get a second path in W: clamp them, and
  // capture every slot of theirs that receives anything.
  std::unordered_set<const Node*> below;
  for (const auto& s : plan.slots)
    for (const Edge& c : s.node->next_edges())
      if (c.is_valid() && !closure.count(c.function.get())) stack.push_back(c.function.get());
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (!below.insert(n).second) continue;
    for (const Edge& c : n->next_edges())
      if (c.is_valid() && !closure.count(c.function.get())) stack.push_back(c.function.get());
  }
  const size_t boundary = plan.slots.size();
  for (size_t i = 0; i < boundary; ++i) {
    const Node* b = plan.slots[i].node.get();
    if (!below.count(b)) continue;
    plan.clamped.insert(b);
    for (const Node* p : parents[b])
      for (const Edge& c : p->next_edges())
        if (c.function.get() == b) add_slot(c);
  }
  for (auto& s : plan.slots) std::sort(s.input_nrs.begin(), s.input_nrs.end());
  return plan;
}

// During W, replaces the gradients arriving at a clamped node with I's captured totals.
class ClampHook final : public torch::autograd::FunctionPreHook {
 public:
  explicit ClampHook(std::vector<std::pair<uint32_t, at::Tensor>> caps) : caps_(std::move(caps)) {}
  variable_list operator()(const variable_list& grads) override {
    variable_list out = grads;
    for (const auto& [nr, g] : caps_)
      if (nr < out.size()) out[nr] = g;
    return out;
  }

 private:
  std::vector<std::pair<uint32_t, at::Tensor>> caps_;
};

}  // namespace

void WeightWork::clear() {
  edges.clear();
  grads.clear();
  clamps.clear();
}

std::vector<at::Tensor> backward_full(const std::vector<at::Tensor>& roots,
                                      const std::vector<at::Tensor>& root_grads,
                                      const std::vector<at::Tensor>& inputs) {
  edge_list edges;
  variable_list grads;
  root_edges(roots, root_grads, edges, grads);
  if (!edges.empty()) run_engine(edges, grads, /*keep_graph=*/false, /*accumulate_grad=*/true);
  std::vector<at::Tensor> out;
  out.reserve(inputs.size());
  for (const auto& t : inputs) out.push_back(t.requires_grad() ? t.grad() : at::Tensor());
  return out;
}

std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& roots,
                                       const std::vector<at::Tensor>& root_grads,
                                       const std::vector<at::Tensor>& inputs, WeightWork& work) {
  work.clear();
  std::vector<at::Tensor> out(inputs.size());
  edge_list edges;
  variable_list grads;
  root_edges(roots, root_grads, edges, grads);
  if (edges.empty()) return out;

  edge_list outputs;
  std::vector<const Node*> input_nodes;
  std::vector<size_t> wanted;  // indices into inputs
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    outputs.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    input_nodes.push_back(outputs.back().function.get());
    wanted.push_back(i);
  }
  Plan plan = make_plan(edges, input_nodes);
  for (const auto& s : plan.slots)
    for (uint32_t nr : s.input_nrs) outputs.emplace_back(s.node, nr);
  if (outputs.empty()) return out;

  variable_list res = run_engine(edges, grads, /*keep_graph=*/true, /*accumulate_grad=*/false, outputs);
  for (size_t k = 0; k < wanted.size(); ++k) out[wanted[k]] = res[k];
  std::unordered_map<const Node*, size_t> clamp_of;
  for (size_t k = wanted.size(); k < outputs.size(); ++k) {
    if (!res[k].defined()) continue;  // nothing reached this slot
    work.edges.push_back(outputs[k]);
    work.grads.push_back(res[k]);
    const Node* node = outputs[k].function.get();
    if (!plan.clamped.count(node)) continue;
    auto [it, fresh] = clamp_of.emplace(node, work.clamps.size());
    if (fresh) work.clamps.emplace_back(outputs[k], std::vector<std::pair<uint32_t, at::Tensor>>{});
    work.clamps[it->second].second.emplace_back(outputs[k].input_nr, res[k]);
  }
  return out;
}

void backward_weight(WeightWork& work) {
  if (work.edges.empty()) {
    work.clear();
    return;
  }
  std::vector<std::pair<Node*, const torch::autograd::FunctionPreHook*>> installed;
  auto remove_hooks = [&] {
    for (auto [node, hook] : installed) {
      auto& hooks = node->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                 [hook = hook](const auto& h) { return h.get() == hook; }),
                  hooks.end());
    }
  };
  for (auto& [edge, caps] : work.clamps) {
    auto hook = std::make_unique<ClampHook>(std::move(caps));
    installed.emplace_back(edge.function.get(), hook.get());
    edge.function->add_pre_hook(std::move(hook));
  }
  try {
    run_engine(work.edges, work.grads, /*keep_graph=*/false, /*accumulate_grad=*/true);
  } catch (...) {
    remove_hooks();
    work.clear();
    throw;
  }
  remove_hooks();
  work.clear();
}

}  // namespace zbpipe::runtime
