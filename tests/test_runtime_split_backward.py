"""Split backward (I then W, the executor's C++ code bound as zbpipe._C.backward_*) gives
exactly the gradients of one full backward, single process: weights used twice, tied/transposed
weights, weight-region diamonds, unused parameters, stage inputs that need no gradient, and the
deferred-Linear queue."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zbpipe import _C
from zbpipe.deferred_linear import DeferredLinearHook


class Reuse(nn.Module):  # one Linear applied twice in sequence
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(torch.relu(self.lin(x)))


class Branches(nn.Module):  # the same weight on two branches that join
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return F.linear(x, self.w) + F.linear(torch.tanh(x), self.w)


class Diamond(nn.Module):  # weight used directly and through a derived tensor: boundary below boundary
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        w3 = self.w * 3
        return x @ self.w + torch.sin(x @ w3) + torch.cos(x) @ w3


class Tied(nn.Module):  # projection and its transpose around a LayerNorm (PyTorch's W path errs)
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        h = self.norm(x @ self.w)
        return h @ self.w.t() + h


class Mixed(nn.Module):  # two weights whose uses interleave, a scalar, an unused parameter
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))
        self.v = nn.Parameter(torch.randn(6, 6))
        self.s = nn.Parameter(torch.tensor(0.5))
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x):
        a = x @ self.w
        return (torch.relu(a) @ self.v) @ self.w * self.s + a @ self.v


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(6, nhead=2, dim_feedforward=12, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.block(x.view(2, 2, 6)).reshape(4, 6)


MODULES = [Reuse, Branches, Diamond, Tied, Mixed, Block]


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for n in want:
        if want[n] is None:
            assert got[n] is None, n
        else:
            assert got[n] is not None, n
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("input_grad", [True, False], ids=["mid-stage", "first-stage"])
@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_split_equals_full(cls, input_grad):
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(4, 6)
    g = torch.randn(4, 6)

    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_(input_grad)
    ref(xr).backward(g)

    xs = x.clone().requires_grad_(input_grad)
    out = model(xs)
    (dx,), work = _C.backward_input([out], [g], [xs])
    # I must not touch parameter gradients; W fills them.
    assert all(p.grad is None for p in model.parameters())
    del out
    _C.backward_weight(work)
    assert len(work) == 0  # W consumed the captured slots
    _assert_same(_grads(model), _grads(ref))
    if input_grad:
        torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-6)
    else:
        assert dx is None


def test_split_accumulates_across_microbatches():
    torch.manual_seed(0)
    model, ref = Tied(), None
    ref = copy.deepcopy(model)
    xs = [torch.randn(4, 6) for _ in range(3)]
    for x in xs:
        ref(x.requires_grad_(True)).sum().backward()
    works = []
    for x in xs:  # all I first, then all W (as a zero-bubble schedule may order them)
        y = model(x.clone().requires_grad_(True))
        works.append(_C.backward_input([y], [torch.ones_like(y)], [])[1])
    for w in works:
        _C.backward_weight(w)
    _assert_same(_grads(model), _grads(ref))


def test_deferred_linear_queues_weight_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 6))
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 6)
    ref(x).square().mean().backward()

    hook = DeferredLinearHook(model)
    assert hook.count == 2
    hook.queue = []
    y = model(x)
    queue, hook.queue = hook.queue, None
    y.square().mean().backward()
    assert model[0].weight.grad is None and model[3].bias.grad is None  # waiting in the queue
    assert model[2].weight.grad is not None                             # LayerNorm: immediate
    for entry in queue:
        entry.run()
    _assert_same(_grads(model), _grads(ref))


@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_full_backward_returns_input_gradient_and_fills_params(cls):
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    xs = x.clone().requires_grad_(True)
    (dx,) = _C.backward_full([model(xs)], [g], [xs])
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-6)
    _assert_same(_grads(model), _grads(ref))


def test_diamond_is_clamped_not_double_counted():
    """Without the clamp, W would add the w*3 path twice into the Diamond's weight gradient."""
    torch.manual_seed(0)
    model = Diamond()
    x = torch.randn(4, 6, requires_grad=True)
    (_dx,), work = _C.backward_input([model(x)], [torch.ones(4, 6)], [x])
    assert len(work) >= 2  # the boundary below another boundary is captured too
    ref = copy.deepcopy(model)
    ref(x.detach().requires_grad_(True)).backward(torch.ones(4, 6))
    _C.backward_weight(work)
    torch.testing.assert_close(model.w.grad, ref.w.grad, rtol=1e-5, atol=1e-6)


def test_unused_input_gets_no_gradient():
    lin = nn.Linear(6, 6)
    x, unused = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    (dx, du), work = _C.backward_input([lin(x)], [torch.ones(4, 6)], [x, unused])
    assert dx is not None and du is None
    _C.backward_weight(work)
    assert lin.weight.grad is not None
