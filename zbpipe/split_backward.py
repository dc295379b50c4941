"""Split backward: backward-input (I) now, backward-weight (W) later, with exactly the
gradients of one full backward.

The autograd graph of a stage splits into the *input closure* (nodes from which a stage input
is reachable: I must run them) and the *weight region* (everything else: only parameters
below). I runs ``autograd.grad`` to the stage inputs and, in the same pass, captures the total
gradient arriving at every weight-region node fed from the input closure (a "boundary" slot,
named by a GradientEdge). W runs the weight region from those captured gradients.

Why not PyTorch's ``stage_backward_weight``: it replays the *intermediate* input-closure nodes
from their saved incoming gradients, grouped per parameter; a parameter used twice inside one
stage reaches two intermediates that are themselves connected, and the replay can count a
contribution twice. Capturing at the weight-region boundary cannot: each boundary slot's value
is the sum of everything the input closure sends it, taken once. A boundary node that is also
reachable from another boundary node (a weight-region diamond) is clamped to its captured total
during W so the second path does not add to it again.

``DeferredLinear`` is the second option: nn.Linear layers whose backward computes the input
gradient and queues (input, grad_output) for W, which does the two matmuls; no graph analysis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class WeightWork:
    """What W needs for one microbatch (I's captured gradients, or a Linear queue)."""

    edges: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    clamps: dict = field(default_factory=dict)  # node -> {input_nr: captured total}
    linear: list = field(default_factory=list)  # DeferredLinear entries


def _plan(root_edges: list[GradientEdge], input_nodes: list):
    """Boundary slots (node -> input numbers) and the boundary nodes to clamp."""
    parents: dict = {}
    seen = set()
    stack = []
    for e in root_edges:
        if e.node not in seen:
            seen.add(e.node)
            stack.append(e.node)
    while stack:
        n = stack.pop()
        for child, _ in n.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(n)
            if child not in seen:
                seen.add(child)
                stack.append(child)

    closure = set()
    stack = [n for n in input_nodes if n in seen]
    while stack:
        n = stack.pop()
        if n in closure:
            continue
        closure.add(n)
        stack.extend(p for p in parents.get(n, ()) if p not in closure)

    slots: dict = {}
    for n in closure:
        for child, nr in n.next_functions:
            if child is not None and child not in closure:
                slots.setdefault(child, set()).add(nr)
    for e in root_edges:  # outputs computed without touching the inputs
        if e.node not in closure:
            slots.setdefault(e.node, set()).add(e.output_nr)

    # Boundary nodes below another boundary node in the weight region get a second path in W.
    clamped = set()
    below = set()
    for b in slots:
        stack = [c for c, _ in b.next_functions if c is not None and c not in closure]
        while stack:
            n = stack.pop()
            if n in below:
                continue
            below.add(n)
            stack.extend(c for c, _ in n.next_functions if c is not None and c not in closure)
    for b in slots:
        if b in below:
            clamped.add(b)
            for p in parents.get(b, ()):  # capture every slot that receives something
                for child, nr in p.next_functions:
                    if child is b:
                        slots[b].add(nr)
    return slots, clamped


def backward_input(roots, root_grads, inputs) -> tuple[list, WeightWork]:
    """I: gradients of `roots` (with `root_grads`) w.r.t. the tensors `inputs` (None where a
    tensor does not require grad or is unused), plus the work W needs later."""
    work = WeightWork()
    if not roots:
        return [None] * len(inputs), work
    root_edges = [get_gradient_edge(r) for r in roots]
    wanted = [t for t in inputs if t.requires_grad]
    input_nodes = [get_gradient_edge(t).node for t in wanted]
    slots, clamped = _plan(root_edges, input_nodes)
    edges = [GradientEdge(node, nr) for node, nrs in slots.items() for nr in sorted(nrs)]
    if not wanted and not edges:
        return [None] * len(inputs), work
    res = torch.autograd.grad(
        roots, wanted + edges, grad_outputs=root_grads, retain_graph=True, allow_unused=True
    )
    got = iter(res[: len(wanted)])
    input_grads = [next(got) if t.requires_grad else None for t in inputs]
    for edge, g in zip(edges, res[len(wanted):]):
        if g is None:
            continue
        work.edges.append(edge)
        work.grads.append(g)
        if edge.node in clamped:
            work.clamps.setdefault(edge.node, {})[edge.output_nr] = g
    return input_grads, work


def backward_weight(work: WeightWork) -> None:
    """W: accumulates parameter gradients (into .grad) from what backward_input captured."""
    if work.edges:
        handles = []
        try:
            for node, caps in work.clamps.items():
                handles.append(node.register_prehook(_clamp_hook(caps)))
            torch.autograd.backward(work.edges, grad_tensors=work.grads)
        finally:
            for h in handles:
                h.remove()
    for entry in work.linear:
        entry.run()
    work.edges.clear()
    work.grads.clear()
    work.clamps.clear()
    work.linear.clear()


def _clamp_hook(caps: dict):
    def hook(grad_outputs):
        return tuple(caps.get(i, g) for i, g in enumerate(grad_outputs))

    return hook


# ---- deferred weight gradients for nn.Linear ---------------------------------------------


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


class _LinearWeightGrad:
    """One queued dW (and db) of a deferred Linear: grad_out^T @ input."""

    __slots__ = ("x", "gy", "weight", "bias")

    def __init__(self, x, gy, weight, bias):
        self.x, self.gy, self.weight, self.bias = x, gy, weight, bias

    def run(self) -> None:
        gy = self.gy.reshape(-1, self.gy.shape[-1])
        if self.weight.requires_grad:
            _accumulate(self.weight, gy.t().mm(self.x.reshape(-1, self.x.shape[-1])))
        if self.bias is not None and self.bias.requires_grad:
            _accumulate(self.bias, gy.sum(0))


class _DeferredLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, queue):
        ctx.save_for_backward(x, weight)
        ctx.bias = bias
        ctx.queue = queue
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.queue.append(_LinearWeightGrad(x, gy, weight, ctx.bias))
        return gx, None, None, None


class DeferredLinearHook:
    """Routes the nn.Linear layers of a module through _DeferredLinearFn while `queue` is set
    (training forward); otherwise (no_grad, shape inference) they run F.linear as usual."""

    def __init__(self, module: torch.nn.Module):
        self.queue: list | None = None
        self.count = 0
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                m.forward = self._forward_for(m)
                self.count += 1

    def _forward_for(self, lin: torch.nn.Linear):
        def forward(x):
            if self.queue is None or not torch.is_grad_enabled():
                return F.linear(x, lin.weight, lin.bias)
            return _DeferredLinearFn.apply(x, lin.weight, lin.bias, self.queue)

        return forward
