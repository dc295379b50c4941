"""Checkpointed regions are recomputed once per (stage, microbatch, region), whatever the
schedule (zbpipe/checkpointing.py, issue #21).

Single process, on the executor's own backward (zbpipe._C.backward_input / backward_weight /
backward_full) around a forward in `recompute_once()` (what a stage's training forward runs
in): I recomputes and W does not; between I and W only what W needs of the recomputed tensors
is alive (for a Linear, its input), nothing after W; selective AC, nested regions, debug=True;
outside a stage forward torch's rule is untouched; a torch lacking the internals the rule
needs is refused at the forward, naming them.

pp=2 over Gloo, every training schedule (B, I then W, V layouts, OVERLAP_F_B): calls of the
checkpointed function counted per (stage, microbatch, region) -- one in the forward, one
recomputation -- and every gradient equal to the un-checkpointed model's in one process, for
the user's own checkpoint, torch's checkpoint_wrapper, selective AC (torchtitan's policy),
regions sharing their weights with each other and with un-checkpointed code, a transformer
block under full and selective AC, and deferred_linear=True.
"""

from __future__ import annotations

import copy
import functools
import gc
import re
import threading
from collections import Counter, defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from helpers.asserts import ATOL, RTOL
from helpers.schedule_registry import training_names
from zbpipe import _C
from zbpipe.checkpointing import recompute_once

WIDTH = 8


# ---- counted regions ------------------------------------------------------------------------

class Calls:
    """Calls of one stage's checkpointed functions: ("F" or "R", microbatch, region) -> count.
    A call made while the stage's forward runs (on that thread) is the forward's and tags the
    region's input with the microbatch; any other is a recomputation of the tagged input."""

    def __init__(self):
        self.local = threading.local()
        self.tags: dict[tuple[int, int], int] = {}
        self.counts: Counter = Counter()

    def __deepcopy__(self, memo):  # a copied stage counts its own calls
        return Calls()

    def record(self, region: int, x: torch.Tensor) -> None:
        if not torch.is_grad_enabled():  # the handshake's shape run: not a region
            return
        mb = getattr(self.local, "mb", None)
        key = (region, x.data_ptr())
        if mb is not None:
            self.tags[key] = mb
            self.counts["F", mb, region] += 1
        else:
            self.counts["R", self.tags[key], region] += 1


class Counted(nn.Module):
    """`inner` with its calls counted as region `region` (a region's checkpointed function)."""

    def __init__(self, inner: nn.Module, calls: Calls, region: int):
        super().__init__()
        self.inner, self.calls, self.region = inner, calls, region

    def forward(self, x, region=None):
        self.calls.record(self.region if region is None else region, x)
        return self.inner(x)


def mlp(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def torchtitan_policy():
    """torchtitan's selective-AC op policy (llama3 parallelize.py, `selective` / `op`): save the
    outputs of the compute ops but every second matmul (addmm here: Linears with bias on CPU)."""
    save = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            meta[f"{mode}_mm_count"] += 1
        to_save = func in save and not (func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                                        and meta[f"{mode}_mm_count"] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Stage(nn.Module):
    """Two residual blocks `x + region(x)`. `form`: how the regions are checkpointed --
    "checkpoint" (the user's own call), "wrapper" (checkpoint_wrapper per block), "sac"
    (checkpoint_wrapper with torchtitan's selective policy), "tied" (both regions run one MLP,
    which also runs un-checkpointed after them), "block_full" / "block_sac" (transformer
    encoder blocks under checkpoint_wrapper, full and selective), "none" (the reference)."""

    def __init__(self, form: str, calls: Calls | None = None):
        super().__init__()
        self.form, self.calls = form, calls or Calls()
        self.transformer = transformer = form.startswith("block")
        make = (lambda: nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=16, dropout=0.0,
                                                   batch_first=True)) if transformer else mlp
        if form == "tied":
            shared = make()
            self.inner = nn.ModuleList([shared, shared])
        else:
            self.inner = nn.ModuleList([make(), make()])
        self.counted = nn.ModuleList(Counted(m, self.calls, r) for r, m in enumerate(self.inner))
        self.regions = None

    def checkpointed(self, form: str) -> "Stage":
        """A copy of this reference stage (same weights) with its regions checkpointed."""
        out = copy.deepcopy(self)
        out.form = form
        if form in ("wrapper", "block_full"):
            out.regions = nn.ModuleList(checkpoint_wrapper(c) for c in out.counted)
        elif form in ("sac", "block_sac"):
            out.regions = nn.ModuleList(checkpoint_wrapper(c, context_fn=torchtitan_policy) for c in out.counted)
        return out

    def forward(self, x):
        for r, counted in enumerate(self.counted):
            if self.form == "none":
                y = counted.inner(x)
            elif self.form in ("checkpoint", "tied"):
                y = checkpoint(counted, x, r, use_reentrant=False)
            else:
                y = self.regions[r](x)
            x = y if self.transformer else x + y  # an encoder block adds its own residual
        if self.form in ("tied", "none") and self.inner[0] is self.inner[1]:
            x = x + 0.5 * self.inner[0](torch.tanh(x))  # the shared weights, un-checkpointed
        return x

    def run(self, mb: int, *args):
        """The stage's forward as zbpipe calls it (its calls tagged with the microbatch)."""
        self.calls.local.mb = mb
        try:
            return self(*args)
        finally:
            self.calls.local.mb = None


class Tagged(nn.Module):
    """A stage module for the pipeline: forwards k = 0, 1, ... of a step are microbatch k."""

    def __init__(self, stage: Stage, microbatches: int):
        super().__init__()
        self.stage, self.m, self.k = stage, microbatches, 0

    def forward(self, x):
        if not torch.is_grad_enabled():  # the handshake's shape run
            return self.stage.run(-1, x)
        mb, self.k = self.k % self.m, self.k + 1
        return self.stage.run(mb, x)


# ---- single process ---------------------------------------------------------------------------

class _Storages(TorchDispatchMode):
    """Weak references to the storages of every op output while active."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self.refs.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().data_ptr(), str(func)))
        return out

    def alive(self, skip=()) -> set[tuple[int, str]]:
        return {(ptr, fn) for r, ptr, fn in self.refs if not r.expired() and ptr not in skip}


def _ptrs(*tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def _reference_grads(ref: Stage, x, g):
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    return xr.grad, [p.grad for p in ref.parameters()]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))


@pytest.mark.parametrize("form", ["checkpoint", "wrapper", "sac", "tied", "block_full", "block_sac"])
@pytest.mark.parametrize("split", [True, False], ids=["I+W", "B"])
@pytest.mark.parametrize("device", ["cpu", CUDA])  # CUDA: nodes run on the engine's device thread
def test_one_recomputation_in_i_and_exact(form, split, device):
    torch.manual_seed(0)
    ref = Stage(form).to(device)
    ref.form = "none"
    model = ref.checkpointed(form)
    shape = (2, 3, WIDTH) if form.startswith("block") else (4, WIDTH)
    x, g = torch.randn(shape, device=device), torch.randn(shape, device=device)
    dx_ref, grads_ref = _reference_grads(ref, x, g)
    xs = x.clone().requires_grad_(True)
    with recompute_once():
        out = model.run(0, xs)
    assert model.calls.counts == {("F", 0, 0): 1, ("F", 0, 1): 1}
    if split:
        (dx,), work = _C.backward_input([out], [g], [xs])
        assert model.calls.counts == {("F", 0, 0): 1, ("F", 0, 1): 1, ("R", 0, 0): 1, ("R", 0, 1): 1}
        _C.backward_weight(work)
    else:
        (dx,) = _C.backward_full([out], [g], [xs])
    assert model.calls.counts == {("F", 0, 0): 1, ("F", 0, 1): 1, ("R", 0, 0): 1, ("R", 0, 1): 1}
    torch.testing.assert_close(dx, dx_ref, rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), grads_ref):
        torch.testing.assert_close(p.grad, q, rtol=RTOL, atol=ATOL)


def test_first_stage_recomputes_once_in_w():
    """No input gradient: I does nothing, W runs the whole backward and recomputes there."""
    torch.manual_seed(0)
    model = Stage("none").checkpointed("checkpoint")
    x, g = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    with recompute_once():
        out = model.run(0, x)
    (_dx,), work = _C.backward_input([out], [g], [x])
    assert sum(v for (kind, *_), v in model.calls.counts.items() if kind == "R") == 0
    _C.backward_weight(work)
    assert model.calls.counts[("R", 0, 0)] == model.calls.counts[("R", 0, 1)] == 1


def test_between_i_and_w_only_what_w_needs_is_held():
    """What a recomputation leaves: during I, a recomputed tensor only I needs is dropped at its
    unpack (region 1's first Linear output, GELU's input, is gone when region 0 recomputes);
    after I, per region, GELU's output (the second Linear's input, W's) and no Linear output;
    the region inputs only where W needs them (region 1's: its first Linear's input). After W:
    nothing."""
    torch.manual_seed(0)
    model = Stage("none").checkpointed("checkpoint")
    x, g = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    xs = x.clone().requires_grad_(True)
    seen = _Storages()
    with recompute_once(), seen:
        out = model.run(0, xs)
    block0_out = next(ptr for _, ptr, fn in seen.refs if fn == "aten.add.Tensor")
    forward_ops = len(seen.refs)
    during_i = {}
    record = model.calls.record

    def record_and_look(region, t):  # at each recomputation's start: what I's recomputations left
        during_i[region] = [fn for r, _, fn in seen.refs[forward_ops:] if not r.expired()]
        record(region, t)

    model.calls.record = record_and_look
    with seen:
        (dx,), work = _C.backward_input([out], [g], [xs])
    del out
    gc.collect()
    assert sorted(during_i) == [0, 1] and "aten.addmm.default" not in during_i[0], during_i
    skip = _ptrs(xs, g, dx, *model.parameters())
    first_op = {}
    for r, ptr, fn in seen.refs:
        if not r.expired() and ptr not in skip:
            first_op.setdefault(ptr, fn)
    held = sorted(first_op.values())
    assert held.count("aten.gelu.default") == 2, held
    assert "aten.addmm.default" not in held, held
    assert block0_out in first_op, held
    _C.backward_weight(work)
    del work
    gc.collect()
    skip |= _ptrs(*(p.grad for p in model.parameters()))
    assert not seen.alive(skip), seen.alive(skip)


def test_selective_cache_is_freed_by_the_recomputation():
    """Selective AC caches its saved ops' outputs from the forward for the recomputation; an
    entry the recomputation never reaches (it stops once every saved tensor is back: here the
    scaling after the Linear) is freed with the recomputation closure, at I, not at W."""
    lin = nn.Linear(6, 6)
    policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mul.Tensor])
    xs = torch.randn(4, 6, requires_grad=True)
    with recompute_once():
        y = checkpoint(lambda t: lin(t) * torch.full((), 2.0), xs, use_reentrant=False, context_fn=policy)
    cached = StorageWeakRef(y.untyped_storage())  # the cache holds the only other reference
    out = xs + y
    del y
    assert not cached.expired()
    (_dx,), work = _C.backward_input([out], [torch.ones(4, 6)], [xs])
    assert cached.expired()
    _C.backward_weight(work)


def test_torch_rule_outside_a_stage_forward():
    """A region made outside a stage's training forward is torch's: recomputed per call."""
    calls = []
    lin = nn.Linear(6, 6)

    def fn(t):
        calls.append(1)
        return lin(torch.tanh(lin(t)))

    x = torch.randn(4, 6, requires_grad=True)
    out = checkpoint(fn, x, use_reentrant=False) + x
    (_dx,), work = _C.backward_input([out], [torch.ones(4, 6)], [x])
    _C.backward_weight(work)
    assert len(calls) == 3  # the forward, I's recomputation, W's
    calls.clear()
    with recompute_once():
        out = checkpoint(fn, x, use_reentrant=False) + x
    (_dx,), work = _C.backward_input([out], [torch.ones(4, 6)], [x])
    _C.backward_weight(work)
    assert len(calls) == 2  # the forward, I's recomputation
    # A region another thread makes while this one runs a stage's forward is torch's too.
    calls.clear()
    with recompute_once():
        made = []
        worker = threading.Thread(target=lambda: made.append(checkpoint(fn, x, use_reentrant=False) + x))
        worker.start()
        worker.join()
    (_dx,), work = _C.backward_input(made, [torch.ones(4, 6)], [x])
    _C.backward_weight(work)
    assert len(calls) == 3


def test_backward_inside_the_checkpointed_forward_keeps_torchs_rule():
    """torch's Rule 6: a region may run a backward of its own while its forward runs (here an
    input gradient it returns); unpacks before the forward completes follow torch's rule."""
    lin = nn.Linear(6, 6)

    def fn(t):
        h = torch.tanh(lin(t))
        (gt,) = torch.autograd.grad(h.sum(), t, create_graph=True)
        return h * gt

    ref = copy.deepcopy(lin)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    hr = torch.tanh(ref(xr))
    (gr,) = torch.autograd.grad(hr.sum(), xr, create_graph=True)
    (hr * gr).backward(g)
    xs = x.clone().requires_grad_(True)
    with recompute_once():
        out = checkpoint(fn, xs, use_reentrant=False)
    (dx,), work = _C.backward_input([out], [g], [xs])
    _C.backward_weight(work)
    torch.testing.assert_close(dx, xr.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=RTOL, atol=ATOL)


def test_nested_regions_and_debug_mode():
    calls = Counter()
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)

    def inner(t):
        calls["inner"] += 1
        return b(torch.tanh(t))

    def outer(t):
        calls["outer"] += 1
        return a(checkpoint(inner, torch.relu(a(t)), use_reentrant=False, debug=True))

    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    xr = x.clone().requires_grad_(True)
    ref_a(ref_b(torch.tanh(torch.relu(ref_a(xr))))).backward(g)  # outer(inner) without checkpoint
    xs = x.clone().requires_grad_(True)
    with recompute_once():
        out = checkpoint(outer, xs, use_reentrant=False)
    (dx,), work = _C.backward_input([out], [g], [xs])
    _C.backward_weight(work)
    # Forward: outer, inner. The outer recomputation runs inner as a throwaway (torch's nested
    # rule); the inner region made in the forward recomputes once.
    assert calls == {"outer": 2, "inner": 3}, calls
    torch.testing.assert_close(dx, xr.grad, rtol=RTOL, atol=ATOL)


def test_torch_without_the_internals_is_refused_at_the_forward(monkeypatch):
    monkeypatch.delattr(torch_checkpoint._CheckpointFrame, "check_recomputed_tensors_match")
    x = torch.randn(4, 6, requires_grad=True)
    checkpoint(torch.tanh, x, use_reentrant=False)  # outside a stage: torch's own, untouched
    with pytest.raises(RuntimeError, match=r"check_recomputed_tensors_match.*schedule without I/W"):
        with recompute_once():
            checkpoint(torch.tanh, x, use_reentrant=False)


def test_reentrant_wrapper_on_the_input_path_runs_fused_naming_the_fix():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    block = checkpoint_wrapper(mlp(), checkpoint_impl=CheckpointImpl.REENTRANT)
    x = torch.randn(4, WIDTH, requires_grad=True)
    with recompute_once():
        out = block(x)
    _, work = _C.backward_input([out], [torch.ones(4, WIDTH)], [x])
    assert re.search(r"use_reentrant=False.*CheckpointImpl.NO_REENTRANT", work.fused), work.fused
    assert len(work) == 0 and all(p.grad is not None for p in block.parameters())


# ---- pp=2 over Gloo, every training schedule --------------------------------------------------

FORMS = ("checkpoint", "wrapper", "sac", "tied", "block_full", "block_sac", "deferred")
M = 4


def _check(zbpipe, rank, pp, name, form):
    prog = zbpipe._C.build(name, pp, M)
    n, stage_to_rank = prog.num_stages, list(prog.stage_to_rank)
    base = "checkpoint" if form == "deferred" else form
    block = base.startswith("block")
    torch.manual_seed(0)
    refs = [Stage(base) for _ in range(n)]
    for r in refs:
        r.form = "none"
    mods = [r.checkpointed(base) for r in refs]
    shape = (2, 3, WIDTH) if block else (2, WIDTH)
    steps = 2 if form in ("checkpoint", "sac") else 1
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(M * shape[0], *shape[1:], generator=gen),
                torch.randn(M * shape[0], *shape[1:], generator=gen)) for _ in range(steps)]
    ref_losses = []
    for x, y in batches:
        out = x
        for r in refs:
            out = r(out)
        loss = F.mse_loss(out, y)
        loss.backward()
        ref_losses.append(loss.detach())
    mine = [s for s in range(n) if stage_to_rank[s] == rank]
    stages = [zbpipe.PipelineStage(Tagged(mods[s], M), s, n, "cpu", deferred_linear=form == "deferred")
              for s in mine]
    sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M,
                                           loss_fn=F.mse_loss, timeout=30)
    tag = f"{name} form={form} rank={rank}"
    for k, (x, y) in enumerate(batches):
        losses = []
        sched.step(*((x,) if 0 in mine else ()), target=y if n - 1 in mine else None, losses=losses)
        if n - 1 in mine and not torch.allclose(torch.stack(losses).mean(), ref_losses[k], rtol=RTOL, atol=ATOL):
            return f"{tag}: loss {torch.stack(losses).mean().item()} != {ref_losses[k].item()}"
    for s in mine:
        want = Counter({(kind, mb, r): steps for kind in "FR" for mb in range(M) for r in range(2)})
        if mods[s].calls.counts != want:
            wrong = {k: v for k, v in (mods[s].calls.counts - want + (want - mods[s].calls.counts)).items()}
            return f"{tag}: stage {s} calls of its checkpointed functions off by {dict(sorted(wrong.items()))}"
        for (pname, p), q in zip(mods[s].named_parameters(), refs[s].parameters()):
            if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL):
                return f"{tag}: stage {s} gradient of {pname} differs"
    return None


def _ac_case(rank, pp, name):
    """The failures of every form of `name` on this rank (an empty list: all exact, each
    checkpointed function run once per forward and once per recomputation)."""
    import zbpipe

    return [f for f in (_check(zbpipe, rank, pp, name, form) for form in FORMS) if f]


@pytest.mark.parametrize("name", training_names())
def test_every_schedule_recomputes_once_and_is_exact(spawn_world, name):
    results = spawn_world(2, gloo_devices=2).run(_ac_case, name, timeout_s=300)
    assert len(results) == 2
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


class _KeepProbe(torch.autograd.Function):
    """Identity whose backward records the keep flag of the thread that runs it (the caller's
    on CPU, the device's autograd thread on CUDA)."""

    seen: list = []

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        _KeepProbe.seen.append(_C._checkpoint_keeps_unpacked())
        return g


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a GPU: there the node runs on the device's autograd thread"))])
def test_an_error_inside_i_leaves_the_keep_flag_lowered(device):
    """The recomputation fails inside the Linear's node while it runs its input side in I (the
    keep flag raised, its post-hook then skipped): every later backward on the thread that ran
    it, the device's autograd thread on CUDA, sees the flag lowered (issue #36)."""
    lin = nn.Linear(6, 6).to(device)
    seen = []

    def fn(t):
        if seen:  # the recomputation, at the first unpack in I
            seen.append(_C._checkpoint_keeps_unpacked())
            raise ValueError("the recomputation fails")
        seen.append("forward")
        return lin(t)

    x = torch.randn(4, 6, device=device, requires_grad=True)
    with recompute_once():
        out = checkpoint(fn, x, use_reentrant=False)
    with pytest.raises(ValueError, match="the recomputation fails"):
        _C.backward_input([out], [torch.ones_like(out)], [x])
    assert seen == ["forward", True]  # it failed with the flag raised
    _KeepProbe.seen = []
    _KeepProbe.apply(torch.ones(3, device=device, requires_grad=True)).sum().backward()
    assert _KeepProbe.seen == [False]
    assert not _C._checkpoint_keeps_unpacked()
