"""Deferred weight gradients for nn.Linear (``PipelineStage(..., deferred_linear=True)``).

The stage's Linear layers run through an autograd Function whose backward computes only the
input gradient and queues (input, grad_output) for the W action, which then does the weight
and bias matmuls. No autograd-graph analysis is involved, so it is the simple alternative to
the executor's exact graph split (csrc/runtime/stage_backward.h); the other parameters of the
stage get their gradients during the backward itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
