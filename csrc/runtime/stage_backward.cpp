// Stage backward (B) and its exact split (I, W) on the autograd engine; see stage_backward.h.
#include "runtime/stage_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <c10/util/Type.h>

#include <algorithm>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include "runtime/checkpoint_once.h"
#include "runtime/joint_backward.h"
#include "runtime/node_ref.h"
#include "zbpipe/error.h"

namespace zbpipe::runtime {

namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::FunctionPostHook;
using torch::autograd::FunctionPreHook;
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
    // Checked here: inside the engine an undefined root gradient is std::terminate.
    TORCH_CHECK(root_grads[i].defined(), "zbpipe backward: root ", i, " (", roots[i].sizes(),
                ") requires grad but its gradient is undefined");
    edges.push_back(torch::autograd::impl::gradient_edge(roots[i]));
    grads.push_back(root_grads[i]);
  }
}

// Torch's generated backward nodes (torch::autograd::generated::*) compute only the outputs
// the running graph task needs (task_should_compute_output) and have no side effects, so a
// boundary node of theirs can run its input side in I and its weight side in W. Not all of
// them derive from TraceableFunction (TBackward0 is a plain Node), hence a test of the class's
// namespace, read from its demangled name (the same on every C++ ABI; MSVC's start with
// "struct "). A class of another namespace merely naming a generated one (a template
// argument) does not pass.
bool is_generated_type(const std::type_info& type) {
  static constexpr char kNamespace[] = "torch::autograd::generated::";
  const std::string name = c10::demangle(type.name());
  const size_t at = name.find(kNamespace);
  return at == 0 || (at != std::string::npos && (name.compare(0, at, "struct ") == 0 ||
                                                 name.compare(0, at, "class ") == 0));
}

// Role of a node in the split, by DFS index.
enum Role : uint8_t {
  kWeight,    // weight region: runs in W
  kClosure,   // input closure, not a boundary: runs in I, released after I
  kInput,     // a stage input's node: the split stops there (not run, not released)
  kRerun,     // generated boundary node: input side in I, weight side in W
  kKeepInI,   // other boundary node: runs whole in I; what it sends the weight region feeds W
  kJoint,     // generated boundary node whose weight side needs its input side (joint_backward.h):
              // runs whole in I, what it sends the weight region captured at sinks, feeds W
};

// The analysis of one graph shape.
struct Plan {
  std::vector<uint64_t> signature;
  std::vector<uint8_t> role;                        // by DFS index
  std::vector<uint32_t> rerun;                      // kRerun nodes, DFS order
  std::vector<std::pair<uint32_t, uint32_t>> cuts;  // (kRerun node, next edge into C)
  std::vector<uint32_t> keep;                       // kKeepInI nodes
  std::vector<std::vector<uint32_t>> sends;         // per keep node: its edges into the weight region
  std::vector<uint32_t> joint;                      // kJoint nodes
  std::vector<std::vector<uint32_t>> joint_sends;   // per joint node: its edges into the weight region
  std::vector<uint32_t> release;                    // kClosure, kKeepInI and kJoint nodes
  std::vector<uint32_t> closure_roots, weight_roots;  // positions in the valid roots
  // Non-empty: the split cannot take this graph and the stage's backward runs whole in I (the
  // reason, told to the user once per stage).
  std::string fused;
};

constexpr uint64_t kInvalidEdge = ~uint64_t{0};
constexpr uint64_t kInputMark = ~uint64_t{0} - 1;
constexpr size_t kMaxShapes = 4;  // graph shapes remembered per stage

// What a re-run boundary node received in I.
struct CapturedInputs {
  variable_list grads;
  bool fired = false;  // it ran in I (nothing may have reached it)
};

// Captures the gradients a boundary node is about to run on (appended last to its pre-hooks:
// after its tensor pre-hooks, retains_grad hooks and other function pre-hooks).
class CaptureInputs final : public FunctionPreHook {
 public:
  explicit CaptureInputs(CapturedInputs* dest) : dest_(dest) {}
  variable_list operator()(const variable_list& grads) override {
    dest_->grads = grads;
    dest_->fired = true;
    return grads;
  }

 private:
  CapturedInputs* dest_;
};

// Captures what a kept-in-I node sends along its weight-region edges (appended last to its
// post-hooks: the values the engine would route).
class CaptureSends final : public FunctionPostHook {
 public:
  CaptureSends(const std::vector<uint32_t>* edges, variable_list* dest) : edges_(edges), dest_(dest) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    dest_->clear();
    for (uint32_t e : *edges_) dest_->push_back(e < outputs.size() ? outputs[e] : at::Tensor());
    return outputs;
  }

 private:
  const std::vector<uint32_t>* edges_;
  variable_list* dest_;
};

// Stands in, during I, for the weight-region node a kJoint node sends a gradient to: asking
// the engine for this edge's gradient (an output of the I run) makes the node compute it,
// and the engine captures it here without running anything behind it. Never applied.
class WeightSideSink final : public Node {
 public:
  // Takes `target`'s metadata for input `nr`, which the engine checks the gradient against.
  WeightSideSink(const Node& target, uint32_t nr) {
    const auto& m = target.input_metadata(nr);
    if (m.was_default_constructed()) add_input_metadata(Node::undefined_input{});
    else add_input_metadata(m.options(), m.shape_as_dim_vector(), m.is_tensor_subclass(), false, m.grad_dtype());
  }
  variable_list apply(variable_list&& /*grads*/) override { return {}; }
  std::string name() const override { return "zbpipe::WeightSideSink"; }
};

// A kJoint target the sink can stand in for: not a nested tensor's input (its metadata keeps
// no plain shape).
bool sink_can_stand_in(const Edge& e) {
  const auto& m = e.function->input_metadata(e.input_nr);
  return m.was_default_constructed() || !m.is_nested_tensor();
}

template <typename Hook>
void erase_hook(std::vector<std::unique_ptr<Hook>>& hooks, const Hook* h) {
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [h](const auto& p) { return p.get() == h; }),
              hooks.end());
}

// A boundary node's hooks, moved out for W (they ran in I) and put back after.
struct StrippedHooks {
  Node* node;
  std::vector<std::unique_ptr<FunctionPreHook>> tensor_pre, pre;
  std::unordered_map<size_t, std::unique_ptr<FunctionPreHook>> retains;
  std::vector<std::unique_ptr<FunctionPostHook>> post;

  explicit StrippedHooks(Node* n)
      : node(n),
        tensor_pre(std::move(n->tensor_pre_hooks())),
        pre(std::move(n->pre_hooks())),
        retains(std::move(n->retains_grad_hooks())),
        post(std::move(n->post_hooks())) {
    n->tensor_pre_hooks().clear();
    n->pre_hooks().clear();
    n->retains_grad_hooks().clear();
    n->post_hooks().clear();
  }
  void restore() {
    node->tensor_pre_hooks() = std::move(tensor_pre);
    node->pre_hooks() = std::move(pre);
    node->retains_grad_hooks() = std::move(retains);
    node->post_hooks() = std::move(post);
  }
  static bool any(Node* n) {
    return !n->tensor_pre_hooks().empty() || !n->pre_hooks().empty() ||
           !n->retains_grad_hooks().empty() || !n->post_hooks().empty();
  }
};

}  // namespace

struct SplitPlanCache::Impl {
  // Scratch of the walk, reused across calls.
  std::unordered_map<const Node*, uint32_t> index;
  std::vector<Node*> order;   // DFS index -> node
  std::vector<Node*> stack;
  std::vector<uint64_t> sig;
  std::vector<const Node*> input_nodes;
  std::vector<Plan> plans;    // most recently used first
  // Per node type: 0 not generated, 1 generated, 2 generated and joint (joint_backward.h).
  std::unordered_map<std::type_index, uint8_t> kinds;

  uint8_t kind(const Node& n) {
    auto [it, fresh] = kinds.emplace(std::type_index(typeid(n)), 0);
    if (fresh && is_generated_type(typeid(n)))
      it->second = computes_weight_side_with_input_side(n.name()) ? 2 : 1;
    return it->second;
  }

  // The plan of the graph below `roots` (walked; analysed if its shape is new), counted in
  // hits or misses.
  const Plan& plan(const edge_list& roots, int64_t& hits, int64_t& misses) {
    walk(roots);
    if (const Plan* found = find()) {
      ++hits;
      return *found;
    }
    ++misses;
    return analyse(roots);
  }

  // One DFS from the roots: numbers the nodes in discovery order and writes the shape's
  // signature (per node popped: its type, then each next edge as child index and input
  // number), not descending below a stage input. Equal signatures mean equal shapes.
  void walk(const edge_list& roots) {
    index.clear();
    order.clear();
    stack.clear();
    sig.clear();
    auto visit = [&](Node* n) -> uint64_t {
      auto [it, fresh] = index.emplace(n, static_cast<uint32_t>(order.size()));
      if (fresh) {
        order.push_back(n);
        stack.push_back(n);
      }
      return it->second;
    };
    for (const Edge& e : roots) sig.push_back(visit(e.function.get()) << 32 | e.input_nr);
    for (const Node* n : input_nodes) {
      auto it = index.find(n);
      sig.push_back(it == index.end() ? kInvalidEdge : it->second);
    }
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      sig.push_back(reinterpret_cast<uintptr_t>(&typeid(*n)));
      if (std::find(input_nodes.begin(), input_nodes.end(), n) != input_nodes.end()) {
        sig.push_back(kInputMark);
        continue;
      }
      sig.push_back(n->next_edges().size());
      for (const Edge& c : n->next_edges())
        sig.push_back(c.is_valid() ? visit(c.function.get()) << 32 | c.input_nr : kInvalidEdge);
    }
  }

  // The plan of the shape just walked (analysed on a miss).
  const Plan* find() {
    for (size_t i = 0; i < plans.size(); ++i) {
      if (plans[i].signature != sig) continue;
      if (i != 0) std::rotate(plans.begin(), plans.begin() + i, plans.begin() + i + 1);
      return &plans.front();
    }
    return nullptr;
  }

  // The stage inputs' nodes, by DFS index.
  std::vector<uint8_t> input_flags() const {
    std::vector<uint8_t> is_input(order.size(), 0);
    for (const Node* in : input_nodes) {
      auto it = index.find(in);
      if (it != index.end()) is_input[it->second] = 1;
    }
    return is_input;
  }

  // The input closure C: the inputs' nodes and every node above them (walking parents, the
  // inputs' own edges excluded: the split stops there).
  std::vector<uint8_t> input_closure(const std::vector<uint8_t>& is_input) const {
    const size_t n = order.size();
    std::vector<std::vector<uint32_t>> parents(n);
    for (uint32_t i = 0; i < n; ++i) {
      if (is_input[i]) continue;
      for (const Edge& c : order[i]->next_edges())
        if (c.is_valid()) parents[index.at(c.function.get())].push_back(i);
    }
    std::vector<uint32_t> todo;
    for (uint32_t i = 0; i < n; ++i)
      if (is_input[i]) todo.push_back(i);
    std::vector<uint8_t> in_c(n, 0);
    while (!todo.empty()) {
      uint32_t i = todo.back();
      todo.pop_back();
      if (in_c[i]) continue;
      in_c[i] = 1;
      for (uint32_t p : parents[i])
        if (!in_c[p]) todo.push_back(p);
    }
    return in_c;
  }

  const Plan& analyse(const edge_list& roots) {
    const size_t n = order.size();
    Plan plan;
    plan.signature = sig;
    plan.role.assign(n, kWeight);
    const std::vector<uint8_t> is_input = input_flags();
    const std::vector<uint8_t> in_c = input_closure(is_input);
    for (uint32_t i = 0; i < n; ++i)
      if (is_input[i]) plan.role[i] = kInput;
    for (uint32_t i = 0; i < n; ++i) {
      if (!in_c[i] || is_input[i]) continue;
      Node* node = order[i];
      const uint8_t kind_of = kind(*node);
      const bool generated = kind_of != 0;
      // A reentrant checkpoint runs its own backward inside ours, which the engine refuses
      // while only the inputs' gradients are asked for: the stage's backward runs fused.
      if (!generated && node->name() == "CheckpointFunctionBackward" && plan.fused.empty())
        plan.fused =
            "its input gradient passes through torch.utils.checkpoint with use_reentrant=True, "
            "whose backward runs a full backward of its own and cannot be split into "
            "backward-input (I) and backward-weight (W). Use torch.utils.checkpoint.checkpoint(..., "
            "use_reentrant=False) (checkpoint_wrapper: checkpoint_impl=CheckpointImpl.NO_REENTRANT, "
            "its default), which zbpipe splits and recomputes once per stage microbatch";
      std::vector<uint32_t> to_c, to_w;
      const auto& edges = node->next_edges();
      for (uint32_t k = 0; k < edges.size(); ++k) {
        if (!edges[k].is_valid()) continue;
        (in_c[index.at(edges[k].function.get())] ? to_c : to_w).push_back(k);
      }
      const bool joint = kind_of == 2 && std::all_of(to_w.begin(), to_w.end(), [&](uint32_t k) {
        return sink_can_stand_in(edges[k]);
      });
      if (to_w.empty()) {
        plan.role[i] = kClosure;
        plan.release.push_back(i);
      } else if (joint) {
        plan.role[i] = kJoint;
        plan.joint.push_back(i);
        plan.joint_sends.push_back(std::move(to_w));
        plan.release.push_back(i);
      } else if (generated) {
        plan.role[i] = kRerun;
        plan.rerun.push_back(i);
        for (uint32_t k : to_c) plan.cuts.emplace_back(i, k);
      } else {
        plan.role[i] = kKeepInI;
        plan.keep.push_back(i);
        plan.sends.push_back(std::move(to_w));
        plan.release.push_back(i);
      }
    }
    for (uint32_t r = 0; r < roots.size(); ++r)
      (in_c[index.at(roots[r].function.get())] ? plan.closure_roots : plan.weight_roots).push_back(r);
    if (plans.size() == kMaxShapes) plans.pop_back();
    plans.insert(plans.begin(), std::move(plan));
    return plans.front();
  }
};

SplitPlanCache::SplitPlanCache() : impl_(std::make_unique<Impl>()) {}
SplitPlanCache::~SplitPlanCache() = default;
SplitPlanCache::SplitPlanCache(SplitPlanCache&&) noexcept = default;
SplitPlanCache& SplitPlanCache::operator=(SplitPlanCache&&) noexcept = default;

void WeightWork::clear() {
  roots.clear();
  grads.clear();
  rerun.clear();
  fused.clear();
}

int64_t WeightWork::captured_bytes() const {
  std::unordered_set<const void*> seen;
  int64_t total = 0;
  for (const auto& g : grads)
    if (g.defined() && seen.insert(g.storage().unsafeGetStorageImpl()).second)
      total += static_cast<int64_t>(g.storage().nbytes());
  return total;
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

namespace {

// The stage inputs that want a gradient: their graph edges (the I run's outputs), their
// positions in `inputs`, and their nodes (where the walk stops).
struct WantedInputs {
  edge_list edges;
  std::vector<size_t> positions;
};
WantedInputs wanted_inputs(const std::vector<at::Tensor>& inputs, std::vector<const Node*>& nodes) {
  WantedInputs w;
  nodes.clear();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    w.edges.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    nodes.push_back(w.edges.back().function.get());
    w.positions.push_back(i);
  }
  return w;
}

// What I captured at the boundary, per plan.rerun, plan.keep and plan.joint node.
struct Captures {
  std::vector<CapturedInputs> rerun;
  std::vector<variable_list> sent;
  std::vector<variable_list> joint_sent;  // per joint node, per edge of plan.joint_sends
  explicit Captures(const Plan& plan)
      : rerun(plan.rerun.size()), sent(plan.keep.size()), joint_sent(plan.joint.size()) {}
};

// During I, each kJoint node's weight-region edges lead to sinks (WeightSideSink) that the
// engine is asked for: it computes those gradients with the input side and captures them.
// The edges are put back when the I run ends, also after a throw.
class JointSinks {
 public:
  JointSinks(const Plan& plan, const std::vector<Node*>& order, edge_list& outputs) : plan_(plan), order_(order) {
    for (size_t k = 0; k < plan.joint.size(); ++k) {
      auto& edges = order[plan.joint[k]]->next_edges();
      for (uint32_t e : plan.joint_sends[k]) {
        saved_.push_back(edges[e]);
        NodeRef sink = make_node<WeightSideSink>(*edges[e].function, edges[e].input_nr);
        edges[e] = Edge(sink, 0);
        outputs.emplace_back(std::move(sink), 0);
      }
    }
  }
  ~JointSinks() {
    size_t j = 0;
    for (size_t k = 0; k < plan_.joint.size(); ++k) {
      auto& edges = order_[plan_.joint[k]]->next_edges();
      for (uint32_t e : plan_.joint_sends[k]) edges[e] = std::move(saved_[j++]);
    }
  }
  JointSinks(const JointSinks&) = delete;
  JointSinks& operator=(const JointSinks&) = delete;

 private:
  const Plan& plan_;
  const std::vector<Node*>& order_;
  edge_list saved_;  // the replaced edges, in plan order
};

// The capture hooks on the boundary nodes for the I run, removed when it ends.
class BoundaryHooks {
 public:
  BoundaryHooks(const Plan& plan, const std::vector<Node*>& order, Captures& into,
                const checkpoint_once::KeepScope& keep_scope) {
    for (size_t k = 0; k < plan.rerun.size(); ++k) {
      auto hook = std::make_unique<CaptureInputs>(&into.rerun[k]);
      pre_.emplace_back(order[plan.rerun[k]], hook.get());
      order[plan.rerun[k]]->add_pre_hook(std::move(hook));
      // Checkpointed tensors it unpacks now are kept for its re-run in W (checkpoint_once.h).
      auto keep = checkpoint_once::add_keep_hooks(*order[plan.rerun[k]], keep_scope);
      pre_.emplace_back(order[plan.rerun[k]], keep.pre);
      post_.emplace_back(order[plan.rerun[k]], keep.post);
    }
    for (size_t k = 0; k < plan.keep.size(); ++k) {
      auto hook = std::make_unique<CaptureSends>(&plan.sends[k], &into.sent[k]);
      post_.emplace_back(order[plan.keep[k]], hook.get());
      order[plan.keep[k]]->add_post_hook(std::move(hook));
    }
  }
  ~BoundaryHooks() {
    for (auto [n, h] : pre_) erase_hook(n->pre_hooks(), h);
    for (auto [n, h] : post_) erase_hook(n->post_hooks(), h);
  }
  BoundaryHooks(const BoundaryHooks&) = delete;
  BoundaryHooks& operator=(const BoundaryHooks&) = delete;

 private:
  std::vector<std::pair<Node*, const FunctionPreHook*>> pre_;
  std::vector<std::pair<Node*, const FunctionPostHook*>> post_;
};

// I: the engine from the roots in the input closure to the wanted inputs, capturing at the
// boundary; returns their gradients.
variable_list run_input_side(const Plan& plan, const std::vector<Node*>& order, const edge_list& edges,
                             const variable_list& grads, const edge_list& outputs, Captures& captures) {
  edge_list i_roots;
  variable_list i_grads;
  for (uint32_t r : plan.closure_roots) {
    i_roots.push_back(edges[r]);
    i_grads.push_back(grads[r]);
  }
  checkpoint_once::KeepScope keep;  // its end lowers the flag on every thread, also after a throw
  BoundaryHooks hooks(plan, order, captures, keep);
  edge_list all_outputs = outputs;
  variable_list res;
  {
    JointSinks sinks(plan, order, all_outputs);
    res = run_engine(i_roots, i_grads, /*keep_graph=*/true, /*accumulate_grad=*/false, all_outputs);
  }
  size_t at = outputs.size();
  for (size_t k = 0; k < plan.joint.size(); ++k)
    for (size_t j = 0; j < plan.joint_sends[k].size(); ++j) captures.joint_sent[k].push_back(std::move(res[at++]));
  res.resize(outputs.size());
  return res;
}

// W's roots: every input of each re-run boundary node, what kept-in-I nodes sent into the
// weight region, and the outputs computed without touching an input.
void collect_weight_roots(const Plan& plan, const std::vector<Node*>& order, const edge_list& edges,
                          const variable_list& grads, Captures& captures, WeightWork& work) {
  for (size_t k = 0; k < plan.rerun.size(); ++k) {
    CapturedInputs& c = captures.rerun[k];
    if (!c.fired) continue;  // it did not run in I (nothing reached it): nor does it in W
    // Only the inputs that carried a gradient become roots: an output of the forward op that
    // no gradient reached (GroupNorm's mean and rstd, an LSTM's last states) got an undefined
    // one in I and stays undefined in W's input buffer, as in B. The engine cannot take an
    // undefined root gradient (its GraphRoot reads each one's metadata in a noexcept call:
    // std::terminate). A node that received none computes nothing in W either.
    const bool any = std::any_of(c.grads.begin(), c.grads.end(), [](const at::Tensor& g) { return g.defined(); });
    if (!any) {
      c.fired = false;  // released with I's part of the graph
      continue;
    }
    work.rerun.emplace_back(node_ref(order[plan.rerun[k]]));
    for (uint32_t nr = 0; nr < c.grads.size(); ++nr) {
      if (!c.grads[nr].defined()) continue;
      work.roots.emplace_back(work.rerun.back(), nr);
      work.grads.push_back(std::move(c.grads[nr]));
    }
  }
  for (size_t k = 0; k < plan.keep.size(); ++k) {
    const auto& es = order[plan.keep[k]]->next_edges();
    auto& sent = captures.sent[k];
    for (size_t j = 0; j < sent.size(); ++j) {
      if (!sent[j].defined()) continue;
      work.roots.push_back(es[plan.sends[k][j]]);
      work.grads.push_back(std::move(sent[j]));
    }
  }
  for (size_t k = 0; k < plan.joint.size(); ++k) {
    const auto& es = order[plan.joint[k]]->next_edges();
    auto& sent = captures.joint_sent[k];
    for (size_t j = 0; j < sent.size(); ++j) {
      if (!sent[j].defined()) continue;
      work.roots.push_back(es[plan.joint_sends[k][j]]);
      work.grads.push_back(std::move(sent[j]));
    }
  }
  for (uint32_t r : plan.weight_roots) {
    work.roots.push_back(edges[r]);
    work.grads.push_back(grads[r]);
  }
}

// Frees I's part of the graph: releases the saved tensors keep_graph kept there, then cuts
// the boundary nodes' edges into it (W must not run it again; a cut may destroy nodes, so it
// comes last).
void release_input_side(const Plan& plan, const std::vector<Node*>& order, const Captures& captures) {
  for (uint32_t i : plan.release) order[i]->release_variables();
  for (size_t k = 0; k < plan.rerun.size(); ++k)
    if (!captures.rerun[k].fired) order[plan.rerun[k]]->release_variables();
  for (auto [i, k] : plan.cuts) order[i]->next_edges()[k] = Edge();
}

}  // namespace

std::vector<at::Tensor> backward_input(const std::vector<at::Tensor>& roots,
                                       const std::vector<at::Tensor>& root_grads,
                                       const std::vector<at::Tensor>& inputs, WeightWork& work,
                                       SplitPlanCache* cache) {
  work.clear();
  std::vector<at::Tensor> out(inputs.size());
  edge_list edges;
  variable_list grads;
  root_edges(roots, root_grads, edges, grads);
  if (edges.empty()) return out;

  SplitPlanCache local;
  SplitPlanCache& pc = cache ? *cache : local;
  SplitPlanCache::Impl& st = *pc.impl_;
  const WantedInputs wanted = wanted_inputs(inputs, st.input_nodes);
  const Plan& plan = st.plan(edges, pc.hits_, pc.misses_);
  if (!plan.fused.empty()) {  // the split cannot take this graph: I is B, W has nothing to do
    work.fused = plan.fused;
    run_engine(edges, grads, /*keep_graph=*/false, /*accumulate_grad=*/true);
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined() && inputs[i].requires_grad()) out[i] = inputs[i].grad();
    return out;
  }

  Captures captures(plan);
  if (!plan.closure_roots.empty()) {
    variable_list res = run_input_side(plan, st.order, edges, grads, wanted.edges, captures);
    for (size_t k = 0; k < wanted.positions.size(); ++k) out[wanted.positions[k]] = res[k];
  }
  collect_weight_roots(plan, st.order, edges, grads, captures, work);
  release_input_side(plan, st.order, captures);
  return out;
}

bool runs_own_backward(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& inputs) {
  thread_local std::unordered_map<std::type_index, bool> generated;  // is_generated_type, per type
  std::unordered_set<const Node*> seen, stop;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) stop.insert(torch::autograd::impl::gradient_edge(t).function.get());
  std::vector<Node*> todo;
  for (const auto& t : roots)
    if (t.defined() && t.requires_grad()) todo.push_back(torch::autograd::impl::gradient_edge(t).function.get());
  while (!todo.empty()) {
    Node* n = todo.back();
    todo.pop_back();
    if (!n || stop.count(n) || !seen.insert(n).second) continue;
    auto [it, fresh] = generated.emplace(std::type_index(typeid(*n)), false);
    if (fresh) it->second = is_generated_type(typeid(*n));
    if (!it->second && n->name() == "CheckpointFunctionBackward") return true;
    for (const Edge& c : n->next_edges())
      if (c.is_valid()) todo.push_back(c.function.get());
  }
  return false;
}

void backward_weight(WeightWork& work) {
  if (work.roots.empty()) {
    work.clear();
    return;
  }
  std::vector<StrippedHooks> stripped;
  for (const auto& n : work.rerun)
    if (StrippedHooks::any(n.get())) stripped.emplace_back(n.get());
  auto restore = [&] {
    for (auto& s : stripped) s.restore();
  };
  try {
    run_engine(work.roots, work.grads, /*keep_graph=*/false, /*accumulate_grad=*/true);
  } catch (...) {
    restore();
    work.clear();
    throw;
  }
  restore();
  work.clear();
}

}  // namespace zbpipe::runtime
