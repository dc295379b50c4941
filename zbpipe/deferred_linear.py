"""Deferred weight gradients for nn.Linear (``PipelineStage(..., deferred_linear=True)``).

The stage's Linear layers run through an autograd Function whose backward computes only the
input gradient and queues (input, grad_output) for the W action, which then does the weight
and bias matmuls. Only the layers it computes exactly are taken: an nn.Linear whose forward is
nn.Linear.forward, on plain Parameters. A subclass with a forward of its own (LoRA, QAT), a
parametrized weight (parametrize, weight_norm) or a tensor-subclass parameter keeps its
forward; the stage's report (PipelineStage.deferred_linear_report) names each and why. No autograd-graph analysis is involved, so it is the simple alternative to
the executor's exact graph split (csrc/runtime/stage_backward.h); the other parameters of the
stage get their gradients during the backward itself.

Checkpointing: while the stage runs a training step, a forward with grad enabled but outside
the stage's own forward (torch.utils.checkpoint recomputing during the backward) goes through
the same Function, so a non-reentrant checkpoint recomputes the same saved tensors; that
recomputed node computes plain Linear gradients if it is ever backpropagated (a reentrant
checkpoint's inner backward does: those weight gradients are then computed at once, in I).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """Into .grad, then the parameter's post-accumulate-grad hooks, as autograd's AccumulateGrad
    runs them (FSDP mixed precision's move into the reduce dtype is one: data_parallel.py)."""
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g
    for hook in list((p._post_accumulate_grad_hooks or {}).values()):
        hook(p)


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
        ctx.weight, ctx.bias = weight, bias  # the parameters (a checkpoint unpacks detached copies)
        ctx.queue = queue
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.queue is None:  # a recomputation's node (see the module docstring)
            gy2 = gy.reshape(-1, gy.shape[-1])
            gw = gy2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
            gb = gy2.sum(0) if ctx.needs_input_grad[2] else None
            return gx, gw, gb, None
        # Detached: the saved input of a Linear after the first carries its forward history
        # (dW computed from it would get a grad_fn that keeps the activations alive in .grad),
        # and a stage input's .grad (the input gradient I sends) would live until W.
        ctx.queue.append(_LinearWeightGrad(x.detach(), gy, ctx.weight, ctx.bias))
        return gx, None, None, None


class DeferredLinearHook:
    """Routes the nn.Linear layers of a module that it can take exactly (deferrable) through
    _DeferredLinearFn while `queue` is set (training forward) or `in_step` (the stage is
    running a training step: a checkpoint's recomputation); otherwise (no_grad, shape
    inference, outside a step) they run F.linear. Every other Linear keeps its forward
    (`not_deferred` says why)."""

    def __init__(self, module: torch.nn.Module):
        self.queue: list | None = None
        self.in_step = False
        self.deferred: list[str] = []
        self.not_deferred: dict[str, str] = {}
        for name, m in module.named_modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            why = not_deferrable(m)
            if why is None:
                m.forward = self._forward_for(m)
                self.deferred.append(name)
            else:
                self.not_deferred[name] = why

    @property
    def count(self) -> int:
        return len(self.deferred)

    def report(self) -> dict:
        return {"deferred": list(self.deferred), "not_deferred": dict(self.not_deferred)}

    def describe_not_deferred(self) -> str:
        return "; ".join(f"'{n or '<the module>'}' ({why})" for n, why in self.not_deferred.items())

    def _forward_for(self, lin: torch.nn.Linear):
        def forward(x):
            if not torch.is_grad_enabled() or (self.queue is None and not self.in_step):
                return F.linear(x, lin.weight, lin.bias)
            return _DeferredLinearFn.apply(x, lin.weight, lin.bias, self.queue)

        return forward


def not_deferrable(lin: torch.nn.Linear) -> str | None:
    """Why `lin` must keep its own forward (None: its forward is nn.Linear's on plain
    Parameters, which _DeferredLinearFn computes exactly)."""
    if type(lin).forward is not torch.nn.Linear.forward:
        return f"{type(lin).__qualname__} defines its own forward"
    if "forward" in vars(lin):
        return "its forward was replaced on the instance"
    if torch.nn.utils.parametrize.is_parametrized(lin):
        return "its parameters are parametrized (torch.nn.utils.parametrize)"
    for pname in ("weight", "bias"):
        p = lin._parameters.get(pname)
        if p is None and (pname == "weight" or getattr(lin, "bias", None) is not None):
            return (f"its {pname} is not a Parameter but computed before each forward "
                    "(e.g. torch.nn.utils.weight_norm)")
        if p is not None and type(p) is not torch.nn.Parameter:
            return f"its {pname} is a {type(p).__qualname__}, not a plain Parameter"
    return None
