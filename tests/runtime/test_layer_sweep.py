"""torch.nn's layers under every split schedule (I then W), against one process: one spawned
world of two Gloo ranks, a small pipeline per group of layers, a stage per layer.

Each stage is a Linear feeding one layer, so the layer's backward is reached by the stage
input's gradient (the split's boundary, where I and W part) on every stage but the first,
where I has nothing to do and W runs the whole backward. The layers: normalization
(LayerNorm, GroupNorm, BatchNorm in train mode, InstanceNorm, RMSNorm), recurrent (RNN, LSTM,
GRU), convolutions (1d, 2d, transposed), Embedding and EmbeddingBag, attention
(nn.MultiheadAttention, F.scaled_dot_product_attention), PReLU, a weight tied across two
Linears, and parametrized weights (parametrizations.weight_norm, a parametrize
parametrization). Loss, every gradient and every buffer (BatchNorm's running statistics) equal
one process running the same microbatches in order; no stage falls back to a fused backward.
GroupNorm and LSTM aborted the process here (SIGABRT in the engine, issue 44) before the split
skipped the inputs a boundary node got no gradient for.

A stage the split cannot take (a reentrant checkpoint on its input path) runs its backward
fused, stays exact, and says so once (test_a_stage_the_split_cannot_take_falls_back_once).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

import zbpipe
from helpers.schedule_registry import local_stages

D, T, ROWS, M = 8, 4, 2, 4  # width, sequence, rows per microbatch, microbatches
SPLIT = ["interleaved_zb", "zb_h1", "zb_h2", "zbv", "dualpipev", "v_half", "v_min", "zb_auto"]


class Layer(nn.Module):
    """Linear, then `inner` on (rows, T, D) activations laid out as it wants them."""

    def __init__(self, inner: nn.Module, layout: str = "btd"):
        super().__init__()
        self.pre, self.inner, self.layout = nn.Linear(D, D), inner, layout

    def forward(self, x):
        h = self.pre(x)
        if self.layout == "bdt":  # channels first: (rows, D, T)
            return self.inner(h.transpose(1, 2)).transpose(1, 2)
        if self.layout == "img":  # (rows, 2, 2, T * D / 4)
            return self.inner(h.reshape(h.shape[0], 2, 2, -1)).reshape(h.shape)
        if self.layout == "rnn":
            return self.inner(h)[0]
        return self.inner(h)


class PositionEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, D)
        self.register_buffer("ids", torch.arange(T) % 10)

    def forward(self, h):
        return h + self.emb(self.ids)


class BagScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, D, mode="mean")
        self.register_buffer("ids", torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]))

    def forward(self, h):
        return h * self.bag(self.ids)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, h):
        return self.attn(h, h, h, need_weights=False)[0]


class CausalSDPA(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, h):
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, D // 2)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)


class TiedPair(nn.Module):  # one weight in two Linears, around a nonlinearity
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, h):
        return self.b(torch.tanh(self.a(h)))


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def _symmetric_linear():
    lin = nn.Linear(D, D)
    parametrize.register_parametrization(lin, "weight", Symmetric())
    return lin


LAYERS = {
    "LayerNorm": lambda: Layer(nn.LayerNorm(D)),
    "GroupNorm": lambda: Layer(nn.GroupNorm(2, D), "bdt"),
    "BatchNorm1d": lambda: Layer(nn.BatchNorm1d(D), "bdt"),
    "InstanceNorm1d": lambda: Layer(nn.InstanceNorm1d(D, affine=True), "bdt"),
    "RMSNorm": lambda: Layer(nn.RMSNorm(D)),
    "RNN": lambda: Layer(nn.RNN(D, D, batch_first=True), "rnn"),
    "LSTM": lambda: Layer(nn.LSTM(D, D, num_layers=2, batch_first=True), "rnn"),
    "GRU": lambda: Layer(nn.GRU(D, D, batch_first=True), "rnn"),
    "Conv1d": lambda: Layer(nn.Conv1d(D, D, 3, padding=1), "bdt"),
    "Conv2d": lambda: Layer(nn.Conv2d(2, 2, 3, padding=1), "img"),
    "ConvTranspose1d": lambda: Layer(nn.ConvTranspose1d(D, D, 3, padding=1), "bdt"),
    "Embedding": lambda: Layer(PositionEmbedding()),
    "EmbeddingBag": lambda: Layer(BagScale()),
    "MultiheadAttention": lambda: Layer(SelfAttention()),
    "scaled_dot_product_attention": lambda: Layer(CausalSDPA()),
    "PReLU": lambda: Layer(nn.PReLU(D), "bdt"),
    "tied": lambda: Layer(TiedPair()),
    "weight_norm": lambda: Layer(nn.utils.parametrizations.weight_norm(nn.Linear(D, D))),
    "parametrize": lambda: Layer(_symmetric_linear()),
}


def _groups(names: list[str], n: int) -> list[list[str]]:
    """`names` in pipelines of n stages, the last one filled up from the start."""
    out = [names[i:i + n] for i in range(0, len(names), n)]
    out[-1] += names[:n - len(out[-1])]
    return out


def _reference(layers: list[str], seed: int, x, y):
    """The stage modules run in one process, microbatch after microbatch (BatchNorm's statistics
    are per microbatch, as in the pipeline), each microbatch's loss scaled by 1/M."""
    torch.manual_seed(seed)
    mods = [LAYERS[n]() for n in layers]
    losses = []
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        out = xm
        for m in mods:
            out = m(out)
        loss = F.mse_loss(out, ym)
        (loss / M).backward()
        losses.append(loss.detach())
    return mods, torch.stack(losses)


def _compare(name, layers, mods, refs, mine, losses, ref_losses) -> list[str]:
    bad = []
    for s in mine:
        tag = f"{name} stage {s} ({layers[s]})"
        for (pname, p), q in zip(mods[s].named_parameters(), refs[s].parameters()):
            if p.grad is None or q.grad is None:
                if (p.grad is None) != (q.grad is None):
                    bad.append(f"{tag}: grad of {pname} is None on one side")
            elif not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5):
                bad.append(f"{tag}: grad of {pname} differs by {(p.grad - q.grad).abs().max().item():.2e}")
        for (bname, b), c in zip(mods[s].named_buffers(), refs[s].buffers()):
            if b.is_floating_point() and not torch.allclose(b, c, rtol=1e-5, atol=1e-5):
                bad.append(f"{tag}: buffer {bname} differs")
    if losses is not None and not torch.allclose(torch.stack(losses), ref_losses, rtol=1e-5, atol=1e-5):
        bad.append(f"{name}: losses {torch.stack(losses).tolist()} != {ref_losses.tolist()}")
    return bad


def _sweep(rank, size):
    """Every layer under every split schedule: the differences found on this rank."""
    bad = []
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(M * ROWS, T, D, generator=gen), torch.randn(M * ROWS, T, D, generator=gen)
    for name in SPLIT:
        prog = zbpipe.compile(name, size, M)
        n = prog.num_stages
        mine = local_stages(prog, rank)
        names = list(LAYERS)
        shift = 3 * SPLIT.index(name) % len(names)  # each schedule places the layers elsewhere
        for k, layers in enumerate(_groups(names[shift:] + names[:shift], n)):
            seed = 100 * k + SPLIT.index(name)
            refs, ref_losses = _reference(layers, seed, x, y)
            torch.manual_seed(seed)
            mods = [LAYERS[ln]() for ln in layers]
            stages = [zbpipe.PipelineStage(mods[s], s, n, "cpu") for s in mine]
            cls = zbpipe.get_schedule_class(name)
            sched = cls(stages if len(stages) > 1 else stages[0], M, loss_fn=F.mse_loss, timeout=60)
            losses = [] if n - 1 in mine else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sched.step(*((x,) if 0 in mine else ()), target=y if n - 1 in mine else None, losses=losses)
            bad += [f"{name}: stage fell back: {w.message}" for w in caught if "runs its whole backward" in str(w.message)]
            bad += _compare(name, layers, mods, refs, mine, losses, ref_losses)
    return bad


def test_every_split_schedule_is_swept():
    split = [n for n in zbpipe.schedule_names() if any("I" in a for a in zbpipe.compile(n, 2, 8).compute_actions(0))]
    assert sorted(split) == sorted(SPLIT)


def test_every_layer_under_every_split_schedule_equals_one_process(spawn_world):
    results = spawn_world(2).run(_sweep, timeout_s=240)
    failures = [f"rank {r}: {b}" for r, bad in enumerate(results) for b in bad]
    assert not failures, "\n".join(failures)


class ReentrantBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.pre(x)  # requires grad on the first stage too, which a reentrant region needs
        return torch.utils.checkpoint.checkpoint(lambda t: self.b(torch.tanh(self.a(t))), h, use_reentrant=True)


def _fallback(rank, size, name):
    torch.manual_seed(0)
    refs = [ReentrantBlock() for _ in range(4)]
    torch.manual_seed(0)
    mods = [ReentrantBlock() for _ in range(4)]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(M * ROWS, D, generator=gen), torch.randn(M * ROWS, D, generator=gen)
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        out = xm
        for m in refs:
            out = m(out)
        (F.mse_loss(out, ym) / M).backward()
    prog = zbpipe.compile(name, size, M)
    mine = local_stages(prog, rank)
    stages = [zbpipe.PipelineStage(mods[s], s, 4, "cpu") for s in mine]
    sched = zbpipe.get_schedule_class(name)(stages, M, loss_fn=F.mse_loss, timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the warning comes once, at the first step that fell back
            sched.step(*((x,) if 0 in mine else ()), target=y if 3 in mine else None)
    told = [str(w.message) for w in caught if "runs its whole backward" in str(w.message)]
    grads = {s: [p.grad / 2 for p in mods[s].parameters()] for s in mine}  # two steps accumulated
    want = {s: [p.grad for p in refs[s].parameters()] for s in mine}
    return told, {s: st.split_fallback for s, st in zip(mine, stages)}, grads, want


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_a_stage_the_split_cannot_take_falls_back_once(spawn_world, name):
    """A reentrant checkpoint on a stage's input path: its I runs the whole backward (W none),
    exact; one warning per stage whose input gets a gradient, naming use_reentrant=False; the
    stage's split_fallback says why. Stage 0's input needs no gradient: nothing to split there,
    W runs its backward as on any first stage, no warning."""
    for rank, (told, fallback, grads, want) in enumerate(spawn_world(2).run(_fallback, name, timeout_s=120)):
        mid = [s for s in fallback if s != 0]
        assert len(told) == len(mid), told
        assert all("use_reentrant=False" in t and f"stage {s} " in t for s, t in zip(sorted(mid), sorted(told))), told
        for s, why in fallback.items():
            assert (why is None) == (s == 0), (s, why)
            for g, w in zip(grads[s], want[s]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _ddp_fallback(rank, size):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    solo = [dist.new_group([r], backend="gloo") for r in range(size)]  # one replica per stage
    pipe = dist.new_group(list(range(size)), backend="gloo")
    torch.manual_seed(0)
    stage = zbpipe.PipelineStage(DDP(ReentrantBlock(), process_group=solo[rank]), rank, size, "cpu", group=pipe)
    sched = zbpipe.ScheduleZBH1(stage, M, loss_fn=F.mse_loss, timeout=30)
    x, y = torch.randn(M * ROWS, D), torch.randn(M * ROWS, D)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == size - 1 else None)
    except zbpipe.PipelineError as e:
        return str(e).splitlines()[0]
    return "ok"


def test_a_data_parallel_stage_that_would_fall_back_is_refused(spawn_world):
    """DDP reduces a stage's gradients during its last backward action, a W under zb_h1, which a
    fused stage leaves empty: the step fails, naming the stage, the reason and the way out."""
    first, second = spawn_world(2).run(_ddp_fallback, timeout_s=120)
    assert second.startswith("rank 1 failed in stage 1 at action 1I0"), second
    assert "data-parallel" in second and "use_reentrant=False" in second and "1f1b" in second, second
    assert first.startswith("aborted because rank 1 failed"), first
