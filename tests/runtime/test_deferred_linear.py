"""deferred_linear=True takes only the Linears it computes exactly: an nn.Linear whose forward
is nn.Linear.forward, on plain Parameters. A subclass with a forward of its own (LoRA-style),
weight_norm (the old hook and the parametrization), a parametrize parametrization and a
Parameter subclass keep their forward; the stage's deferred_linear_report names what was
deferred and what was not (and why), and the stage warns once, at construction, naming the
layers kept. Two Gloo ranks under zb_h1 and zbv, against one process. (Issue 44: the subclass's
forward was replaced, or the gradient landed on weight_norm's computed weight while the real
parameters ended with no gradient.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.schedule_registry import local_stages

W, ROWS, M = 8, 2, 4


class LoRALinear(nn.Linear):
    """A Linear with a low-rank update added in its own forward."""

    def __init__(self, d):
        super().__init__(d, d)
        self.down, self.up = nn.Parameter(torch.randn(2, d) * 0.1), nn.Parameter(torch.randn(d, 2) * 0.1)

    def forward(self, x):
        return super().forward(x) + x @ self.down.t() @ self.up.t()


class TaggedParameter(nn.Parameter):  # a Parameter subclass (as quantization libraries make)
    pass


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(W, W)
        self.lora = LoRALinear(W)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
            self.old_norm = torch.nn.utils.weight_norm(nn.Linear(W, W))
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(W, W))
        self.sym = nn.Linear(W, W)
        nn.utils.parametrize.register_parametrization(self.sym, "weight", Symmetric())
        self.tagged = nn.Linear(W, W)
        self.tagged.weight = TaggedParameter(self.tagged.weight.detach().clone())

    def forward(self, x):
        for m in (self.plain, self.lora, self.old_norm, self.norm, self.sym, self.tagged):
            x = torch.tanh(m(x))
        return x


REPORT = {
    "deferred": ["plain"],
    "not_deferred": {
        "lora": "LoRALinear defines its own forward",
        "old_norm": "its weight is not a Parameter but computed before each forward (e.g. torch.nn.utils.weight_norm)",
        "norm": "its parameters are parametrized (torch.nn.utils.parametrize)",
        "sym": "its parameters are parametrized (torch.nn.utils.parametrize)",
        "tagged": "its weight is a TaggedParameter, not a plain Parameter",
    },
}


def _build(n, seed=0):
    torch.manual_seed(seed)
    return [Stage() for _ in range(n)]


def _case(rank, size, name):
    import zbpipe

    prog = zbpipe.compile(name, size, M)
    n = prog.num_stages
    refs, mods = _build(n), _build(n)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(M * ROWS, W, generator=gen), torch.randn(M * ROWS, W, generator=gen)
    out = x
    for m in refs:
        out = m(out)
    F.mse_loss(out, y).backward()
    mine = local_stages(prog, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stages = [zbpipe.PipelineStage(mods[s], s, n, "cpu", deferred_linear=True) for s in mine]
    told = [str(w.message) for w in caught if "deferred_linear keeps" in str(w.message)]
    sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=F.mse_loss, timeout=60)
    sched.step(*((x,) if 0 in mine else ()), target=y if n - 1 in mine else None)
    bad = []
    for s in mine:
        for (pname, p), q in zip(mods[s].named_parameters(), refs[s].parameters()):
            if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
                bad.append(f"stage {s} {pname}: {'no gradient' if p.grad is None else 'differs'}")
    plain = zbpipe.PipelineStage(Stage(), mine[0], n, "cpu")  # without deferred_linear: no report
    return bad, [st.deferred_linear_report for st in stages] + [plain.deferred_linear_report], told


@pytest.mark.parametrize("name", ["zb_h1", "zbv"])
def test_deferred_linear_defers_only_what_it_computes_exactly(spawn_world, name):
    for rank, (bad, reports, told) in enumerate(spawn_world(2).run(_case, name, timeout_s=120)):
        assert not bad, f"rank {rank}: {bad}"
        assert reports == [REPORT] * (len(reports) - 1) + [None], reports
        assert len(told) == len(reports) - 1, told
        assert all(all(f"'{layer}' ({why})" in t for layer, why in REPORT["not_deferred"].items()) for t in told), told

