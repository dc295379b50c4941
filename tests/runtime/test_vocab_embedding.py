"""The vocabulary-parallel input embedding runs exactly (docs/vocab_parallel.md): with the
embedding split by rows over every rank (zbpipe.VocabParallelEmbedding as input_embedding=),
the step's losses and every gradient (the stages', and each shard's embedding rows) equal one
process running the whole model with the nn.Embedding, on every training schedule (V,
interleaved and DualPipeV placements included), at pp=2 and pp=4, with an uneven vocabulary and
a padding_idx, with the loss on the last stage (loss_fn=) and with the head split too
(output=VocabParallelOutput); eval and two accumulating steps too; and under DDP stages with
data-parallel replicas (pp 2 x dp 2), each shard's gradient averaged over its replicas.

One spawned world per size (2 and 4 ranks), shared by the module's tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.grids import pp2_dp2_grid
from helpers.schedule_registry import local_stages, training_names

import zbpipe

TRAINING = training_names()
D, V, SEQ, PAD = 16, 37, 6, 5  # V=37: shards of 18 and 19 rows at pp=2, 9 and 10 at pp=4
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _lm(num_stages: int, seed: int = 0):
    """A small LM as one module per stage (the embedding first on stage 0, a LayerNorm last on
    the last stage) and its head, the same on every rank."""
    torch.manual_seed(seed)
    mods = []
    for s in range(num_stages):
        layers = [nn.Embedding(V, D, padding_idx=PAD)] if s == 0 else []
        layers.append(nn.Sequential(nn.Linear(D, D), nn.Tanh()))
        if s == num_stages - 1:
            layers.append(nn.LayerNorm(D))
        mods.append(nn.Sequential(*layers))
    return mods, nn.Linear(D, V)


def _batch(m: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(V, (2 * m, SEQ), generator=g), torch.randint(V, (2 * m, SEQ), generator=g)
    x[1, :3] = PAD
    return x, y


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _reference(mods, head, x, y, m):
    h = x
    for mod in mods:
        h = mod(h)
    losses = [_loss(head(hc), yc) for hc, yc in zip(h.chunk(m), y.chunk(m))]
    torch.stack(losses).mean().backward()
    return [loss.detach() for loss in losses]


def _schedule(name, stages, m, **kwargs):
    cls = zbpipe.get_schedule_class(name)
    return cls(stages[0] if issubclass(cls, zbpipe.PipelineScheduleSingle) else stages, m, timeout=60, **kwargs)


def _pipeline(name, program, rank, mods, head, split_head):
    """This rank's stages (stage 0 without its embedding, the last with the head unless split),
    the embedding's shard and the schedule."""
    mine = local_stages(program, rank)
    last = program.num_stages - 1
    modules = {s: nn.Sequential(*list(mods[s])[1:]) if s == 0 else mods[s] for s in mine}
    if last in modules and not split_head:
        modules[last] = nn.Sequential(modules[last], head)
    stages = [zbpipe.PipelineStage(modules[s], s, program.num_stages, "cpu") for s in mine]
    emb = zbpipe.VocabParallelEmbedding(mods[0][0])
    kw = dict(output=zbpipe.VocabParallelOutput(head)) if split_head else dict(loss_fn=_loss)
    return mine, emb, kw.get("output"), _schedule(name, stages, program.microbatches, input_embedding=emb, **kw)


def _check(name, program, rank, mine, mods, ref_mods, emb, out, head, ref_head, losses, ref_losses):
    for s in mine:
        for (n, p), q in zip(mods[s].named_parameters(), ref_mods[s].parameters()):
            if s == 0 and n.startswith("0."):  # the user's nn.Embedding: unused, its shard trains
                assert p.grad is None
                continue
            assert _rel(p.grad, q.grad) <= TOL, f"{name}: stage {s} {n}"
    b, e = emb.shard_range
    assert _rel(emb.weight.grad, ref_mods[0][0].weight.grad[b:e]) <= TOL, f"{name}: embedding rows {b}:{e}"
    if b <= PAD < e:
        assert torch.count_nonzero(emb.weight.grad[PAD - b]) == 0
    if out is not None:
        hb, he = out.shard_range
        assert _rel(out.weight.grad, ref_head.weight.grad[hb:he]) <= TOL, f"{name}: head rows {hb}:{he}"
    elif program.stage_to_rank[-1] == rank:
        for p, q in zip(head.parameters(), ref_head.parameters()):
            assert _rel(p.grad, q.grad) <= TOL, f"{name}: head"
    if program.stage_to_rank[-1] == rank:
        assert len(losses) == program.microbatches
        for got, want in zip(losses, ref_losses):
            assert abs(got.item() - want.item()) <= TOL * abs(want.item())


def _exact(rank, size, name):
    m = 2 * size
    program = zbpipe.compile(name, size, m)
    ranges = []
    for split_head in (False, True):
        mods, head = _lm(program.num_stages)
        ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
        x, y = _batch(m)
        ref_losses = _reference(ref_mods, ref_head, x, y, m)
        mine, emb, out, sched = _pipeline(name, program, rank, mods, head, split_head)
        losses = []
        sched.step(x, target=y, losses=losses)  # the token ids on every rank
        _check(name, program, rank, mine, mods, ref_mods, emb, out, head, ref_head, losses, ref_losses)
        ranges.append(emb.shard_range)
    return ranges[0]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", TRAINING)
def test_loss_and_every_gradient_equal_one_process(spawn_world, name, pp):
    ranges = spawn_world(pp).run(_exact, name, timeout_s=240)
    assert ranges == [(r * V // pp, (r + 1) * V // pp) for r in range(pp)]  # uneven shards, in order


def _eval_and_two_steps(rank, size):
    """eval() runs the lookups without gradients; two steps accumulate as one process does."""
    name, m = "zbv", 2 * size
    program = zbpipe.compile(name, size, m)
    mods, head = _lm(program.num_stages)
    ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    mine, emb, out, sched = _pipeline(name, program, rank, mods, head, True)
    x, y = _batch(m)
    losses = []
    sched.eval(x, target=y, losses=losses)
    assert emb.weight.grad is None and all(p.grad is None for s in mine for p in mods[s].parameters())
    with torch.no_grad():
        h = x
        for mod in ref_mods:
            h = mod(h)
        ref_eval = [_loss(ref_head(hc), yc) for hc, yc in zip(h.chunk(m), y.chunk(m))]
    for seed in (3, 4):
        x, y = _batch(m, seed)
        _reference(ref_mods, ref_head, x, y, m)
        sched.step(x, target=y)
    b, e = emb.shard_range
    assert _rel(emb.weight.grad, ref_mods[0][0].weight.grad[b:e]) <= TOL
    for s in mine:
        for (n, p), q in zip(mods[s].named_parameters(), ref_mods[s].parameters()):
            if not (s == 0 and n.startswith("0.")):
                assert _rel(p.grad, q.grad) <= TOL
    if program.stage_to_rank[-1] == rank:
        assert [round(v.item(), 5) for v in losses] == [round(v.item(), 5) for v in ref_eval]
    return True


def test_eval_and_steps_accumulate(spawn_world):
    assert spawn_world(2).run(_eval_and_two_steps, timeout_s=120) == [True, True]


# ---- DDP stages: pp 2 x dp 2 in the 4-rank world --------------------------------------------

def _ddp(rank, size, name):
    from torch.nn.parallel import DistributedDataParallel as DDP

    pp_group, dp_group, pp_rank, dp_rank = pp2_dp2_grid()
    m = 4
    program = zbpipe.compile(name, 2, m)
    mods, head = _lm(program.num_stages)
    ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    x, y = _batch(2 * m)  # the global batch: 2 replicas x m microbatches of 2 rows
    _reference(ref_mods, ref_head, x, y, 2 * m)
    rows = slice(dp_rank * 2 * m, (dp_rank + 1) * 2 * m)
    mine = local_stages(program, pp_rank)
    modules = {s: nn.Sequential(*list(mods[s])[1:]) if s == 0 else mods[s] for s in mine}
    stages = [zbpipe.PipelineStage(DDP(modules[s], process_group=dp_group), s, program.num_stages, "cpu",
                                   group=pp_group) for s in mine]
    out = zbpipe.VocabParallelOutput(head, group=pp_group, data_parallel_group=dp_group)
    emb = zbpipe.VocabParallelEmbedding(mods[0][0], group=pp_group, data_parallel_group=dp_group)
    _schedule(name, stages, m, output=out, input_embedding=emb).step(x[rows], target=y[rows])
    for s in mine:
        for p, q in zip(modules[s].parameters(), [q for n, q in ref_mods[s].named_parameters()
                                                  if not (s == 0 and n.startswith("0."))]):
            assert _rel(p.grad, q.grad) <= TOL, f"{name}: stage {s}"
    b, e = emb.shard_range
    assert _rel(emb.weight.grad, ref_mods[0][0].weight.grad[b:e]) <= TOL, f"{name} replica {dp_rank}"
    return emb.weight.grad.flatten().tolist()


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_ddp_stages_with_data_parallel_replicas(spawn_world, name):
    grads = spawn_world(4).run(_ddp, name, timeout_s=180)
    assert grads[0] == grads[2] and grads[1] == grads[3]  # the replicas of a shard agree
