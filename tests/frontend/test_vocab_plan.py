"""plan_partition(..., vocab_parallel=True) (docs/partition.md, docs/vocab_parallel.md): the
layers planned with the LM head split over every rank. The search finds what brute force finds
(every split of every candidate compiled with vocab_parallel and simulated); on a real model the
plan keeps the head out of the stages, measures its S and T, reports the step and per-rank peak
with the head on one rank and split, and its program is the one it predicted; two ranks reach
one plan and train exactly; `zbpipe train --vocab-parallel` matches one process."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from helpers.asserts import assert_grads_close
from torch import nn

import zbpipe
from zbpipe import _C
from zbpipe.partition import UnitCost, _programs, _search
from zbpipe.train.model import Block, TinyConfig


def _units(n: int, seed: int) -> list[UnitCost]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        f, i, w = (rng.uniform(0.5, 3.0) for _ in range(3))
        out.append(UnitCost(f"u{k}", f, i, w, (i + w) * rng.uniform(0.8, 1.0), rng.uniform(1, 4) * 1e3,
                            rng.uniform(0, 1) * 1e3, 1e3, 4e3))
    return out


def _vocab(pp: int, seed: int) -> dict:
    rng = random.Random(seed)
    return dict(s=[rng.uniform(2, 6) for _ in range(pp)], t=[rng.uniform(1, 3) for _ in range(pp)],
                mem_s=[5e3] * pp, static_bytes=[2e4] * pp, collective=0.05)


@pytest.mark.parametrize("n,pp,m,seed", [(5, 2, 4, 0), (6, 2, 6, 1), (7, 3, 6, 2)])
def test_the_vocab_search_equals_brute_force(n, pp, m, seed):
    units, vocab = _units(n, seed), _vocab(pp, seed)
    names = ["1f1b", "zb_h1", "zbv", "interleaved_zb"]
    programs, _ = _programs(names, pp, m, n)
    plan = _search(units, programs, [], pp, m, None, 0.1, 50_000, vocab)
    best = None
    for prog in programs:
        S = prog.num_stages
        for cut in itertools.combinations(range(1, n), S - 1):
            bounds = [0, *cut, n]
            c = plan.stage_costs(bounds)
            placed = zbpipe.compile(prog.schedule, pp, m, S // pp, vocab_parallel=True, f=c["f"], b=c["b"],
                                    w=c["w"], b_full=c["b_full"], comm=0.1, s=vocab["s"], t=vocab["t"],
                                    collective=vocab["collective"])
            step = zbpipe.simulate(placed, c["f"], c["b"], c["w"], 0.1, b_full=c["b_full"], mem_f=c["mem_f"],
                                   mem_w=c["mem_w"], s=vocab["s"], t=vocab["t"],
                                   collective=vocab["collective"], mem_s=vocab["mem_s"]).makespan
            if best is None or step < best[0] * (1 - 1e-12):
                best = (step, prog.schedule, bounds)
    assert plan.predicted_step_s == pytest.approx(best[0], rel=1e-12)
    assert plan.vocab_parallel and plan.vocab is vocab


def test_the_head_on_one_rank_bounds_the_step_and_the_split_does_not():
    """A head of 30 units' work on one rank of 6 light layers: the split plan beats it."""
    layers = _units(6, 5)
    head = UnitCost("head", 20.0, 20.0, 20.0, 40.0, 1e5, 1e4, 1e6, 4e6)
    programs, _ = _programs(["zb_h1"], 2, 8, 7)
    one = _search(layers + [head], programs, [], 2, 8, None, 0.0, 50_000)
    assert one.bounding_unit == "head"
    split = _search(layers, programs, [], 2, 8, None, 0.0, 50_000,
                    dict(s=[20.0, 20.0], t=[10.0, 10.0], mem_s=[1e4, 1e4], static_bytes=[2e6, 2e6], collective=0.0))
    split.head, split.head_on_one_rank = "head", one
    assert split.predicted_step_s < 0.8 * one.predicted_step_s
    assert split.bounding_unit is None
    text = split.table()
    assert "head 'head' split over the 2 ranks" in text and "on one rank    zb_h1" in text
    assert "split / one rank: step" in text


# ---- a real model ---------------------------------------------------------------------------

CFG = TinyConfig(n_layers=4, vocab=4096)


class _Lm(nn.Module):
    def __init__(self, cfg=CFG):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, x):
        x = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers if self.layers is not None else []:
            x = layer(x)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _model_and_batch(b=2, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(CFG.vocab, (b, CFG.seq_len), generator=g) for _ in range(2))
    return _Lm(), x, y


def test_a_plan_keeps_the_head_out_and_predicts_its_program():
    model, x, y = _model_and_batch()
    plan = zbpipe.plan_partition(model, (x,), pp=2, microbatches=4, loss_fn=_lm_loss, mb_target=y,
                                 schedules=["zb_h1", "zbv"], measure_steps=1, vocab_parallel=True)
    assert plan.head == "output" and plan.vocab_parallel
    assert "output" not in [n for names in plan.module_fqns_per_stage for n in names]
    one = plan.head_on_one_rank
    assert one.module_fqns_per_stage[-1][-1] == "output" and not one.vocab_parallel
    rows = [2048, 2048]
    per_row = (CFG.d_model + 1) * 4
    assert plan.vocab["static_bytes"] == [n * per_row * 4 for n in rows]  # weights, grads, Adam's two states
    assert min(plan.vocab["s"]) > 0 and min(plan.vocab["t"]) > 0
    prog = plan.program()
    assert any(str(a).endswith("S0") for a in prog.action_values(0))
    c = plan.stage_costs()
    res = zbpipe.simulate(prog, c["f"], c["b"], c["w"], plan.comm_s, b_full=c["b_full"], mem_f=c["mem_f"],
                          mem_w=c["mem_w"], s=plan.vocab["s"], t=plan.vocab["t"],
                          collective=plan.vocab["collective"], mem_s=plan.vocab["mem_s"])
    assert res.makespan == pytest.approx(plan.predicted_step_s, rel=1e-12)
    text = plan.table()
    assert "head 'output' split over the 2 ranks" in text and "on one rank" in text


def test_a_head_that_is_not_one_linear_unit_is_refused():
    model, x, y = _model_and_batch()
    with pytest.raises(ValueError, match=r"the head must be one nn.Linear unit, got unit 'norm' \(LayerNorm\)"):
        zbpipe.plan_partition(model, (x,), pp=2, microbatches=2, loss_fn=_lm_loss, mb_target=y,
                              vocab_parallel=True, head="norm", measure_steps=1)
    with pytest.raises(ValueError, match="head 'lm_head' is not a unit"):
        zbpipe.plan_partition(model, (x,), pp=2, microbatches=2, loss_fn=_lm_loss, mb_target=y,
                              vocab_parallel=True, head="lm_head", measure_steps=1)


def _plan_and_train(rank, size):
    model, x, y = _model_and_batch(b=8)
    plan = zbpipe.plan_partition(model, (x[:2],), pp=size, microbatches=4, loss_fn=_lm_loss, mb_target=y[:2],
                                 schedules=["zb_h1", "zbv"], measure_steps=1, vocab_parallel=True)
    ref, _, _ = _model_and_batch()
    ref_losses = [_lm_loss(ref(xc), yc) for xc, yc in zip(x.chunk(4), y.chunk(4))]
    torch.stack(ref_losses).mean().backward()
    model.output = None  # the head is the vocabulary-parallel output's
    modules = zbpipe.split_by_fqn(model, plan.module_fqns_per_stage)
    program = plan.program()
    mine = [s for s, r in enumerate(program.stage_to_rank) if r == rank]
    stages = [zbpipe.PipelineStage(modules[s], s, program.num_stages, "cpu") for s in mine]
    out = zbpipe.VocabParallelOutput(_model_and_batch()[0].output)
    zbpipe.PipelineSchedule.from_program(stages, program, output=out).step(*((x,) if 0 in mine else ()), target=y)
    params = dict(ref.named_parameters())
    for s in mine:
        assert_grads_close(dict(modules[s].named_parameters()), {n: params[n] for n, _ in modules[s].named_parameters()},
                           f"stage {s}")
    b, e = out.shard_range
    torch.testing.assert_close(out.weight.grad, ref.output.weight.grad[b:e], rtol=1e-5, atol=1e-7)
    return plan.module_fqns_per_stage, plan.schedule, [prog_actions for prog_actions in
                                                       (program.actions(r) for r in range(program.pp))]


def test_two_ranks_reach_one_vocab_plan_and_train_exactly(spawn_world):
    a, b = spawn_world(2).run(_plan_and_train, timeout_s=180)
    assert a == b  # the same split, schedule and program (placed under the gathered costs)


def test_zbpipe_train_vocab_parallel_matches_one_process(capsys):
    from zbpipe.train.main import main

    rc = main(["--pp", "2", "--schedule", "zbv", "--vocab-parallel", "--vocab", "512", "--partition", "auto",
               "--steps", "3", "--layers", "4", "--batch-size", "8", "--microbatches", "4", "--timeout", "180"])
    out = capsys.readouterr().out
    assert rc == 0 and "MATCH" in out, out[-2000:]
    assert "head 'head' split over the 2 ranks" in out
