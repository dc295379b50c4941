"""Split backward (I then W, the executor's C++ code bound as zbpipe._C.backward_*) gives
exactly the gradients of one full backward, single process, and W carries the weight work:
weights used twice, tied/transposed weights, weight-region diamonds, unused parameters, stage
inputs that need no gradient, multi-output nodes, custom autograd Functions (DualPipe's
LinearFunc, which adds to weight.grad inside its backward), tensor/node hooks (each runs once),
non-reentrant checkpoint (reentrant runs fused, the fix named), a torch.compile'd stage,
the per-shape analysis cache, the release of I's part of the graph, and the deferred-Linear
queue (also under checkpoint). Boundary nodes some of whose inputs get no gradient (GroupNorm's
mean and rstd, an LSTM's last states: they aborted the process), and nodes whose weight side
needs their input side (run once, in I; the list checked against torch's derivatives.yaml)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.asserts import assert_close, assert_grads_close
from helpers.model_registry import DualPipeLinearFunc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

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


class FixedKV(nn.Module):  # a multi-output boundary node: attention with parameter keys/values
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(6, 6)
        self.k = nn.Parameter(torch.randn(1, 1, 5, 6))
        self.v = nn.Parameter(torch.randn(1, 1, 5, 6))

    def forward(self, x):
        q = self.q(x).view(1, 1, 4, 6)
        return F.scaled_dot_product_attention(q, self.k, self.v).view(4, 6) + x


class PlainLinearFunc(DualPipeLinearFunc):  # the same forward; its backward returns dW normally
    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        return gy @ weight, gy.T @ x


class Custom(nn.Module):  # custom Functions on the input path, next to generated nodes
    grads_in_own_backward = ("a",)  # DualPipeLinearFunc adds to a.grad inside I

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(6, 6))
        self.b = nn.Parameter(torch.randn(6, 6))
        self.c = nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(DualPipeLinearFunc.apply(x, self.a))
        return self.c(PlainLinearFunc.apply(h, self.b)) + PlainLinearFunc.apply(x, self.b)


MODULES = [Reuse, Branches, Diamond, Tied, Mixed, Block, FixedKV, Custom]


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
    # I touches no parameter gradient (but those a custom Function sets itself); W fills them.
    own = getattr(model, "grads_in_own_backward", ())
    assert all(p.grad is None for n, p in model.named_parameters() if n not in own)
    del out
    _C.backward_weight(work)
    assert len(work) == 0  # W consumed the captured slots
    assert_grads_close(model, ref)
    if input_grad:
        assert_close(dx, xr.grad)
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
    assert_grads_close(model, ref)


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
    assert_grads_close(model, ref)
    # W builds no graph: a dW with history would keep the queued activations alive in .grad.
    assert all(p.grad.grad_fn is None and not p.grad.requires_grad for p in model.parameters())
    # What W keeps per Linear: its input and its output gradient, nothing else.
    assert [(tuple(e.x.shape), tuple(e.gy.shape)) for e in queue] == [((2, 3, 8), (2, 3, 6)), ((2, 3, 6), (2, 3, 8))]


def test_deferred_linear_defers_linear_modules_only():
    """A transformer block: its MLP's nn.Linear modules are deferred; attention calls its
    projections through their weights (F.multi_head_attention_forward), so their dW and every
    other parameter's gradient are computed in the backward itself (in I)."""
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    hook = DeferredLinearHook(block)
    hook.queue = queue = []
    y = block(torch.randn(2, 3, 8))
    hook.queue = None
    y.square().mean().backward()
    waiting = {n for n, p in block.named_parameters() if p.grad is None}
    assert waiting == {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}
    assert len(queue) == 2


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
    assert_close(dx, xr.grad)
    assert_grads_close(model, ref)


def test_diamond_sums_each_path_once():
    """Three boundary nodes feed w (directly and through w*3): all are roots of W's one engine
    run, so the engine's dependency counting sums the diamond once."""
    torch.manual_seed(0)
    model = Diamond()
    x = torch.randn(4, 6, requires_grad=True)
    (_dx,), work = _C.backward_input([model(x)], [torch.ones(4, 6)], [x])
    assert sorted(work.rerun) == ["MmBackward0"] * 3
    ref = copy.deepcopy(model)
    ref(x.detach().requires_grad_(True)).backward(torch.ones(4, 6))
    _C.backward_weight(work)
    assert_close(model.w.grad, ref.w.grad)


def test_unused_input_gets_no_gradient():
    lin = nn.Linear(6, 6)
    x, unused = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    (dx, du), work = _C.backward_input([lin(x)], [torch.ones(4, 6)], [x, unused])
    assert dx is not None and du is None
    _C.backward_weight(work)
    assert lin.weight.grad is not None


class _CountMatmuls(TorchDispatchMode):
    """Counts the matrix products dispatched while active (the autograd engine runs them on
    the calling thread for CPU tensors)."""

    OPS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.OPS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _matmuls(fn) -> int:
    with _CountMatmuls() as c:
        fn()
    return c.n


def test_w_carries_the_weight_matmuls():
    """On Linear stages I does the input-side products only and W the weight-side ones; with
    no input gradient I does nothing and W the whole backward."""
    def stack():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))

    for input_grad, (want_i, want_w) in ((True, (3, 3)), (False, (0, 5))):
        model = stack()
        x = torch.randn(4, 6, requires_grad=input_grad)
        out = model(x)
        res = {}
        res["i"] = _matmuls(lambda: res.setdefault("work", _C.backward_input([out], [torch.ones(4, 6)], [x])[1]))
        res["w"] = _matmuls(lambda: _C.backward_weight(res["work"]))
        assert (res["i"], res["w"]) == (want_i, want_w), (input_grad, res["i"], res["w"])


@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_i_and_w_do_the_work_of_b_once(cls):
    """No product runs twice: I's plus W's equal B's, and W gets a share of them wherever the
    stage has a weight-side product on its input path."""
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    out_r = ref(xr)
    b = _matmuls(lambda: _C.backward_full([out_r], [g], [xr]))
    xs = x.clone().requires_grad_(True)
    out = model(xs)
    box = {}
    i = _matmuls(lambda: box.setdefault("work", _C.backward_input([out], [g], [xs])[1]))
    w = _matmuls(lambda: _C.backward_weight(box["work"]))
    assert i + w == b, (i, w, b)
    if cls is not Custom:  # Custom's weight products run inside its own Functions, in I
        assert w > 0


class Hooked(nn.Module):
    """Every kind of hook on a boundary node (the first Linear's AddmmBackward): a tensor hook
    that doubles the gradient, retain_grad, a node pre-hook and a node post-hook."""

    def __init__(self, calls):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.calls = calls

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: self._count("tensor", g * 2))
        h.retain_grad()
        h.grad_fn.register_prehook(lambda gi: self._count("pre", None))
        h.grad_fn.register_hook(lambda gin, gout: self._count("post", None))
        self.h = h
        return self.b(torch.tanh(h))

    def _count(self, kind, ret):
        self.calls[kind] = self.calls.get(kind, 0) + 1
        return ret


def test_boundary_hooks_run_once_and_w_uses_what_they_returned():
    torch.manual_seed(0)
    calls_ref, calls = {}, {}
    ref = Hooked(calls_ref)
    model = copy.deepcopy(ref)
    model.calls = calls
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    xs = x.clone().requires_grad_(True)
    (dx,), work = _C.backward_input([model(xs)], [g], [xs])
    assert "AddmmBackward0" in work.rerun
    _C.backward_weight(work)
    assert calls == calls_ref == {"tensor": 1, "pre": 1, "post": 1}
    assert_close(model.h.grad, ref.h.grad)  # retain_grad: once, not doubled
    assert_close(dx, xr.grad)
    assert_grads_close(model, ref)  # a's dW from the doubled gradient


class Routed(nn.Module):
    """Two experts of one shape (same graph signature, other parameters) and a wider branch
    (another shape)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.wide = nn.Linear(6, 6)
        self.route = 0

    def forward(self, x):
        if self.route == 2:
            return self.wide(torch.relu(x)) * x
        return self.experts[self.route](x)


def test_analysis_is_cached_per_graph_shape_and_stays_exact():
    torch.manual_seed(0)
    model = Routed()
    ref = copy.deepcopy(model)
    cache = _C.SplitPlanCache()
    works = []
    routes = [0, 0, 1, 0, 2, 2, 1]  # expert 1 has expert 0's shape; route 2 is a new one
    for k, r in enumerate(routes):
        model.route = ref.route = r
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        ref(x.clone().requires_grad_(True)).sum().backward()
        xs = x.clone().requires_grad_(True)
        works.append(_C.backward_input([model(xs).sum()], [torch.ones(())], [xs], cache)[1])
    assert (cache.misses, cache.hits) == (2, len(routes) - 2)
    for w in works:
        _C.backward_weight(w)
    assert_grads_close(model, ref)


def test_graph_is_released_at_i_and_w_under_saved_tensor_hooks():
    """With a saved_tensors_hooks pack that keeps the tensor (as save_on_cpu does on CPU),
    a saved output forms a cycle node -> saved tensor -> node; only releasing it breaks it.
    After I only what W needs is alive (the Linears' saved inputs and weights); after W
    nothing."""
    alive = []

    class Holder:
        def __init__(self, t):
            self.t = t

    def pack(t):
        h = Holder(t)
        alive.append(weakref.ref(h))
        return h

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU())
    x = torch.randn(4, 6, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        out = model(x)
    (_dx,), work = _C.backward_input([out], [torch.ones(4, 6)], [x])
    del out
    live = lambda: sum(r() is not None for r in alive)  # noqa: E731
    assert len(alive) == 6 and live() == 4  # tanh's and relu's results are released at I
    # What W keeps per Linear beyond those saved inputs: the output gradient its AddmmBackward
    # received in I ([4, 6] float32 each).
    assert work.captured_bytes == 2 * 4 * 6 * 4
    held = sorted(tuple(r().t.shape) for r in alive if r() is not None)
    assert held == [(4, 6), (4, 6), (6, 6), (6, 6)]  # x, tanh(h), the two weights (W's transposes)
    _C.backward_weight(work)
    del work
    gc.collect()
    assert live() == 0


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=self.reentrant) + x


@pytest.mark.parametrize("input_grad", [True, False], ids=["mid-stage", "first-stage"])
def test_non_reentrant_checkpoint_is_exact(input_grad):
    torch.manual_seed(0)
    model = Checkpointed(reentrant=False)
    ref = copy.deepcopy(model)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(input_grad)
    ref(xr).backward(g)
    xs = x.clone().requires_grad_(input_grad)
    (dx,), work = _C.backward_input([model(xs)], [g], [xs])
    _C.backward_weight(work)
    assert_grads_close(model, ref)
    if input_grad:
        assert_close(dx, xr.grad)


def test_reentrant_checkpoint_on_the_input_path_runs_fused_naming_the_fix():
    """The split cannot take a reentrant checkpoint on the input path (its backward runs a full
    backward of its own): I runs the whole backward, exact, W has nothing, and work.fused says
    why, naming use_reentrant=False."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True)
    ref = copy.deepcopy(model)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    xs = x.clone().requires_grad_(True)
    (dx,), work = _C.backward_input([model(xs)], [g], [xs])
    assert "use_reentrant=False" in work.fused and len(work) == 0
    assert_grads_close(model, ref)  # filled by I
    assert_close(dx, xr.grad)
    _C.backward_weight(work)
    assert_grads_close(model, ref)  # W added nothing


def test_a_split_graph_says_nothing_of_a_fallback():
    model = Checkpointed(reentrant=False)
    x = torch.randn(4, 6, requires_grad=True)
    _, work = _C.backward_input([model(x)], [torch.ones(4, 6)], [x])
    assert work.fused is None
    _C.backward_weight(work)


class GroupNormBlock(nn.Module):  # native_group_norm: outputs (y, mean, rstd), only y gets a gradient
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 6), nn.GroupNorm(2, 6)

    def forward(self, x):
        return self.norm(self.lin(x))


class LSTMBlock(nn.Module):  # mkldnn_rnn_layer: (out, hy, cy, workspace), only out gets one
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 6, num_layers=2)

    def forward(self, x):
        return self.lstm(x.unsqueeze(1))[0].squeeze(1)


class GRUBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(6, 6)

    def forward(self, x):
        return self.gru(x.unsqueeze(1))[0].squeeze(1)


class PReLUBlock(nn.Module):  # _prelu_kernel_backward: the input and weight gradients in one call
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(6, 6), nn.PReLU(6)

    def forward(self, x):
        return self.act(self.lin(x))


@pytest.mark.parametrize("input_grad", [True, False], ids=["mid-stage", "first-stage"])
@pytest.mark.parametrize("cls", [GroupNormBlock, LSTMBlock, GRUBlock, PReLUBlock], ids=lambda c: c.__name__)
def test_boundary_nodes_whose_outputs_got_no_gradient_split_exactly(cls, input_grad):
    """The split's W re-runs a boundary node from the gradients it received in I, as roots of
    one engine run; an output of the forward op that no gradient reached got an undefined one,
    which the engine cannot take as a root (std::terminate: the process aborted, issue 44). W
    gives it none, as B does."""
    test_split_equals_full(cls, input_grad)


class _CountOps(TorchDispatchMode):
    def __init__(self, names):
        super().__init__()
        self.names, self.n = names, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket).split(".")[-1] in self.names:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _count(names, fn) -> int:
    with _CountOps(names) as c:
        fn()
    return c.n


# Per module, its layer's backward kernel and how often I and W run it together: once where the
# kernel computes the input and weight sides in one call whatever is asked (the node runs
# whole in I), twice where it honours its output mask (input side in I, weight side in W).
KERNELS = [(LSTMBlock, "mkldnn_rnn_layer_backward", 2, 2), (PReLUBlock, "_prelu_kernel_backward", 1, 1),
           (GroupNormBlock, "native_group_norm_backward", 1, 2)]


@pytest.mark.parametrize("cls,kernel,in_b,in_split", KERNELS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_node_whose_weight_side_needs_its_input_side_runs_once_in_i(cls, kernel, in_b, in_split):
    torch.manual_seed(0)
    model = cls()
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    out = model(xr)
    assert _count({kernel}, lambda: _C.backward_full([out], [g], [xr])) == in_b
    xs = x.clone().requires_grad_(True)
    out = model(xs)
    box = {}
    i = _count({kernel}, lambda: box.setdefault("work", _C.backward_input([out], [g], [xs])[1]))
    w = _count({kernel}, lambda: _C.backward_weight(box["work"]))
    assert (i + w, w) == (in_split, 0 if in_split == in_b else 1), (i, w)


def test_the_joint_node_list_is_torchs():
    """The nodes run whole in I are those of torch's derivatives.yaml whose formula gives
    several inputs' gradients without grad_input_mask, plus the RNNs of cuDNN and MIOpen
    (their backward computes the input side to get the weights')."""
    pytest.importorskip("yaml")
    import os

    import torchgen
    from torchgen.packaged.autograd.load_derivatives import load_derivatives

    root = os.path.join(os.path.dirname(torchgen.__file__), "packaged")
    infos, _ = load_derivatives(os.path.join(root, "autograd", "derivatives.yaml"),
                                os.path.join(root, "ATen", "native", "native_functions.yaml"),
                                os.path.join(root, "ATen", "native", "tags.yaml"))
    joint = {info.op for by_key in infos.values() for info in by_key.values() if info.op
             for d in info.derivatives if len(d.var_names) > 1 and "grad_input_mask" not in d.formula}
    listed = _C._joint_backward_nodes()
    assert listed == sorted(listed)  # looked up by binary search
    assert set(listed) == joint | {"CudnnRnnBackward0", "MiopenRnnBackward0"}



@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_deferred_linear_under_checkpoint_is_exact(reentrant):
    """The recomputation goes through the deferred Function too (same saved tensors); a
    reentrant checkpoint's inner backward computes those Linears' dW at once."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6)
    ref(x.clone().requires_grad_(True)).square().sum().backward()
    hook = DeferredLinearHook(model)
    hook.in_step = True
    hook.queue = queue = []
    y = model(x.clone().requires_grad_(True))
    hook.queue = None
    y.square().sum().backward()
    # Reentrant: the forward runs without grad and the recomputation's Linears compute their
    # dW at once, in the backward (nothing queued); non-reentrant: both queue theirs for W.
    assert len(queue) == (0 if reentrant else 2)
    for entry in queue:
        entry.run()
    hook.in_step = False
    assert_grads_close(model, ref)


def test_compiled_stage_is_exact():
    """A torch.compile'd region is one custom-Function node: its weight gradients are computed
    in I (it is never re-run) and accumulated in W."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    xs = x.clone().requires_grad_(True)
    out = compiled(xs)
    box = {}
    i = _matmuls(lambda: box.setdefault("res", _C.backward_input([out], [g], [xs])))
    (dx,), work = box["res"]
    assert all(p.grad is None for p in model.parameters()) and len(work) == 4
    assert _matmuls(lambda: _C.backward_weight(work)) == 0 and i == 4  # dX and dW of both Linears, in I
    assert_close(dx, xr.grad)
    assert_grads_close(model, ref)


# Where PyTorch 2.13's own split (torch.distributed.pipelining._backward, as its PipelineStage
# calls it on a stage whose input needs a gradient) is exact and where its W raises; the README's
# comparison rests on this. Ours is exact on all of them (test_split_equals_full).
TORCH_EXACT = [Reuse, Branches, Diamond, FixedKV]
TORCH_RAISES = [Tied, Mixed]


@pytest.mark.parametrize("cls", TORCH_EXACT + TORCH_RAISES, ids=lambda c: c.__name__)
def test_pytorch_split_is_exact_on_a_reused_weight_and_raises_on_tied_and_mixed(cls):
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    xs = x.clone().requires_grad_(True)
    (dx,), groups = stage_backward_input([model(xs)], [g], [xs], model.parameters())
    assert_close(dx, xr.grad)
    if cls in TORCH_RAISES:  # its W: one parameter group's autograd.grad frees nodes another group needs
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            stage_backward_weight(model.parameters(), groups)
        return
    stage_backward_weight(model.parameters(), groups)
    assert_grads_close(model, ref)
