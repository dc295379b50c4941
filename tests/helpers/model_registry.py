"""Small deterministic models for the runtime tests, built as one module per pipeline stage.

Every rank builds all stages from the same seed, so each can run the single-process reference
itself and compare with the pipelined step of its own stages. Also the stages that misbehave on
purpose (FaultyLinear) and DualPipe's weight-gradient-in-backward Linear, which several files use.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

WIDTH = 8


class MLPStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, gain=1.0, shift=None):  # kwargs every stage receives
        y = self.fc2(torch.tanh(self.fc1(x))) * gain
        return y if shift is None else y + shift  # shift: a per-sample tensor, chunked


class BlockStage(nn.Module):
    """A transformer encoder block (attention + MLP + layer norms) on [batch, seq, width]."""

    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.block(x)


class TwiceStage(nn.Module):
    """One Linear used twice, a scalar weight, and a parameter that gets no gradient."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.lin(torch.relu(self.lin(x))) * self.scale + x


class DictStage(nn.Module):
    """Dict in, dict out (keyword arguments of the next stage), with an integer passenger."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, skip=None, count=None):
        if self.first:
            skip = h
            count = torch.zeros(h.shape[0], dtype=torch.long)
        h = torch.tanh(self.a(h)) + self.b(skip)
        return {"h": h, "skip": skip * 0.5 + h, "count": count + 1}


class CheckpointStage(nn.Module):
    """MLPStage's layers under non-reentrant torch.utils.checkpoint (recomputed in the backward)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLPStage()

    def forward(self, x):
        return checkpoint(self.mlp, x, use_reentrant=False)


def dict_loss(out, y):
    return F.mse_loss(out["h"] + out["skip"], y) + 0.0 * out["count"].float().sum()


MODELS = {
    # name: (stage factory(index), input shape per sample, loss_fn)
    "mlp": (lambda i: MLPStage(), (WIDTH,), F.mse_loss),
    "block": (lambda i: BlockStage(), (3, WIDTH), F.mse_loss),
    "twice": (lambda i: TwiceStage(), (WIDTH,), F.mse_loss),
    "dict": (lambda i: DictStage(i == 0), (WIDTH,), dict_loss),
    "ckpt": (lambda i: CheckpointStage(), (WIDTH,), F.mse_loss),
}


def build(name: str, num_stages: int, seed: int = 0) -> list[nn.Module]:
    factory = MODELS[name][0]
    torch.manual_seed(seed)
    return [factory(i) for i in range(num_stages)]


def call_chain(stages, x, **kwargs):
    """Single-process reference: the stages in order, with the pipeline's calling convention."""
    out = x
    for i, m in enumerate(stages):
        if i == 0:
            out = m(out, **kwargs)
        elif isinstance(out, dict):
            out = m(**out, **kwargs)
        elif isinstance(out, (tuple, list)):
            out = m(*out, **kwargs)
        else:
            out = m(out, **kwargs)
    return out


def data(name: str, batch: int, seed: int = 1):
    shape = MODELS[name][1]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=g), torch.randn(batch, *shape, generator=g)


class FaultyLinear(nn.Module):
    """nn.Linear(8, 8) that misbehaves at its n-th training forward (1-based; the handshake's
    no-grad shape run does not count): raises (fail_at), sleeps 4 s (sleep_at), returns half
    its width (shrink_at), or ends its process with code 3 (die_at); with broken=True every
    call raises a RuntimeError, the shape runs (meta and real) included."""

    def __init__(self, fail_at=None, shrink_at=None, sleep_at=None, die_at=None, broken=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.fail_at, self.shrink_at, self.sleep_at, self.die_at = fail_at, shrink_at, sleep_at, die_at
        self.broken = broken

    def forward(self, x):
        if self.broken:
            raise RuntimeError("this module is broken")
        self.calls += torch.is_grad_enabled()
        if self.calls == self.fail_at:
            raise ValueError("boom from inside the stage")
        if self.calls == self.die_at:
            os._exit(3)
        if self.calls == self.sleep_at:
            time.sleep(4.0)
        y = self.lin(x)
        return y[:, :4] if self.calls == self.shrink_at else y


class DualPipeLinearFunc(torch.autograd.Function):
    """DualPipe's examples/example_dualpipev.py LinearFunc (its WeightGradStore disabled, the
    default): adds dW to weight.grad inside its own backward and returns None for the weight."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad += gy.flatten(0, -2).T @ x.flatten(0, -2)
        return gy @ weight, None


class Stops(nn.Module):
    """A Linear(4, 4) whose training forward number `stop_at` raises (its rank stops posting)."""

    def __init__(self, stop_at=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls, self.stop_at = 0, stop_at

    def forward(self, x):
        self.calls += torch.is_grad_enabled()
        if self.calls == self.stop_at:
            raise RuntimeError("this rank stops here")
        return self.lin(x)
