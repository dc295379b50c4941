"""zbpipe.VocabParallelOutput's front end: its shard of rows, its bad input (each a clear error
before any step), and a one-rank pipeline (the whole head one shard) equal to one process. One
in-process loopback world (zbpipe._C._LoopbackWorld) per case, so every case is fast; the
multi-rank runs are tests/runtime/test_vocab_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zbpipe
from zbpipe import _C

D, V = 8, 11


def _head(bias: bool = True):
    torch.manual_seed(0)
    return nn.Linear(D, V, bias=bias)


def _one_rank(width: int = D):
    """A 1-rank loopback world, a one-stage model producing [batch, seq, width] and its stage."""
    torch.manual_seed(1)
    world = _C._LoopbackWorld(1)
    body = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, width), nn.Tanh())
    stage = zbpipe.PipelineStage(body, 0, 1, "cpu", group=world.group(0))
    return world, body, stage


def test_each_rank_keeps_its_contiguous_rows_uneven_vocabularies_too():
    world = _C._LoopbackWorld(3)
    head = _head()
    shards = [zbpipe.VocabParallelOutput(head, group=world.group(r)) for r in range(3)]
    assert [s.shard_range for s in shards] == [(0, 3), (3, 7), (7, 11)]
    assert torch.equal(torch.cat([s.weight for s in shards]), head.weight)
    assert torch.equal(torch.cat([s.bias for s in shards]), head.bias)
    assert all(s.weight.requires_grad and s.weight.data_ptr() != head.weight.data_ptr() for s in shards)
    assert zbpipe.VocabParallelOutput(_head(bias=False), group=world.group(0)).bias is None


# ---- bad input ------------------------------------------------------------------------------

def test_a_head_that_is_not_a_linear():
    world = _C._LoopbackWorld(1)
    with pytest.raises(TypeError, match="head must be an nn.Linear .* got Sequential"):
        zbpipe.VocabParallelOutput(nn.Sequential(_head()), group=world.group(0))


def test_a_vocabulary_smaller_than_the_pipeline():
    world = _C._LoopbackWorld(4)
    with pytest.raises(ValueError, match="a vocabulary of 3 rows cannot be split over the pipeline's 4 ranks"):
        zbpipe.VocabParallelOutput(nn.Linear(D, 3), group=world.group(0))


def test_output_together_with_loss_fn():
    world, _, stage = _one_rank()
    out = zbpipe.VocabParallelOutput(_head(), group=world.group(0))
    with pytest.raises(ValueError, match="output= .* and loss_fn= both define the loss"):
        zbpipe.Schedule1F1B(stage, 2, loss_fn=F.cross_entropy, output=out)
    with pytest.raises(TypeError, match="output= takes a zbpipe.VocabParallelOutput, got Linear"):
        zbpipe.Schedule1F1B(stage, 2, output=_head())


def test_an_output_on_another_group_than_the_stages():
    world, _, stage = _one_rank()
    other = _C._LoopbackWorld(2)
    out = zbpipe.VocabParallelOutput(_head(), group=other.group(1))
    with pytest.raises(ValueError, match="sharded over a group of 2 ranks"):
        zbpipe.Schedule1F1B(stage, 2, output=out)


@pytest.mark.parametrize("bad", [V, -1, 1000])
def test_targets_outside_the_vocabulary(bad):
    world, body, stage = _one_rank()
    out = zbpipe.VocabParallelOutput(_head(), group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage, 2, output=out)
    x, y = torch.randint(V, (4, 5)), torch.randint(V, (4, 5))
    y[3, 2] = bad
    y[0, 0] = -100  # ignore_index is fine
    with pytest.raises(ValueError, match=f"microbatch 1 has target {bad} outside \\[0, {V}\\) \\(ignore_index=-100\\)"):
        sched.step(x, target=y)
    assert out.weight.grad is None and all(p.grad is None for p in body.parameters())  # before any action


def test_targets_are_needed_and_must_be_token_ids():
    world, _, stage = _one_rank()
    out = zbpipe.VocabParallelOutput(_head(), group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage, 2, output=out)
    x = torch.randint(V, (4, 5))
    with pytest.raises(ValueError, match="needs target= .* on every rank"):
        sched.step(x)
    with pytest.raises(ValueError, match="must be an integer tensor of token ids, got torch.float32"):
        sched.step(x, target=torch.zeros(4, 5))


def test_a_last_stage_whose_width_is_not_the_heads():
    world, body, stage = _one_rank(width=D + 1)
    out = zbpipe.VocabParallelOutput(_head(), group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage, 2, output=out)
    with pytest.raises(zbpipe.PipelineError, match=r"rank 0 failed at the start of step 1: the last stage's output "
                       r"is \(float32\[2, 5, 9\]\) but the vocabulary-parallel head takes float32\[2, 5, 8\]"):
        sched.step(torch.randint(V, (4, 5)), target=torch.randint(V, (4, 5)))
    assert out.weight.grad is None and all(p.grad is None for p in body.parameters())


# ---- one rank: the whole head is one shard ----------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zbv", "interleaved_zb"])
def test_one_rank_equals_one_process(name):
    world = _C._LoopbackWorld(1)
    program = zbpipe.compile(name, 1, 4)
    torch.manual_seed(2)
    mods = [nn.Sequential(nn.Embedding(V, D), nn.Tanh())] + [nn.Sequential(nn.Linear(D, D), nn.Tanh())
                                                             for _ in range(program.num_stages - 1)]
    head = _head()
    ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    x, y = torch.randint(V, (8, 5)), torch.randint(V, (8, 5))
    y[1, :3] = 7  # an ignore_index of our own
    h = x
    for m in ref_mods:
        h = m(h)
    ref_losses = [F.cross_entropy(ref_head(hc).flatten(0, 1), yc.flatten(), ignore_index=7)
                  for hc, yc in zip(h.chunk(4), y.chunk(4))]
    torch.stack(ref_losses).mean().backward()
    stages = [zbpipe.PipelineStage(m, s, program.num_stages, "cpu", group=world.group(0)) for s, m in enumerate(mods)]
    out = zbpipe.VocabParallelOutput(head, group=world.group(0), ignore_index=7)
    cls = zbpipe.get_schedule_class(name)
    sched = cls(stages[0] if issubclass(cls, zbpipe.PipelineScheduleSingle) else stages, 4, output=out)
    losses = []
    merged = sched.step(x, target=y, losses=losses)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses).detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(merged, h.detach(), rtol=1e-5, atol=1e-6)  # the head's input, per token
    for m, r in zip(mods, ref_mods):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.weight.grad, ref_head.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.bias.grad, ref_head.bias.grad, rtol=1e-5, atol=1e-7)


def test_inference_reports_the_losses_without_gradients():
    world, body, stage = _one_rank()
    head = _head()
    out = zbpipe.VocabParallelOutput(head, group=world.group(0))
    x, y = torch.randint(V, (4, 5)), torch.randint(V, (4, 5))
    losses = []
    zbpipe.ScheduleInference(stage, 2, output=out).step(x, target=y, losses=losses)
    with torch.no_grad():
        want = [F.cross_entropy(head(body(xc)).flatten(0, 1), yc.flatten()) for xc, yc in zip(x.chunk(2), y.chunk(2))]
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=1e-5, atol=0)
    assert out.weight.grad is None and all(p.grad is None for p in body.parameters())


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_post_accumulate_grad_hooks_run_once_per_microbatch_on_the_shard(name):
    # As autograd's AccumulateGrad runs them: after each T pass has added its microbatch's part
    # to .grad (DDP-style reducers and FSDP's mixed-precision move hook there).
    world = _C._LoopbackWorld(1)
    program = zbpipe.compile(name, 1, 4)
    torch.manual_seed(2)
    mods = [nn.Sequential(nn.Embedding(V, D), nn.Tanh())] + [nn.Sequential(nn.Linear(D, D), nn.Tanh())
                                                             for _ in range(program.num_stages - 1)]
    stages = [zbpipe.PipelineStage(m, s, program.num_stages, "cpu", group=world.group(0)) for s, m in enumerate(mods)]
    out = zbpipe.VocabParallelOutput(_head(), group=world.group(0))
    seen = {"weight": [], "bias": []}
    for pname in seen:
        getattr(out, pname).register_post_accumulate_grad_hook(
            lambda p, pname=pname: seen[pname].append(p.grad.clone()))
    cls = zbpipe.get_schedule_class(name)
    sched = cls(stages[0] if issubclass(cls, zbpipe.PipelineScheduleSingle) else stages, 4, output=out)
    sched.step(torch.randint(V, (8, 5)), target=torch.randint(V, (8, 5)))
    for pname, grads in seen.items():
        assert len(grads) == 4, (pname, len(grads))
        assert not torch.equal(grads[0], grads[-1])  # each saw the sum so far, the last the whole
        torch.testing.assert_close(grads[-1], getattr(out, pname).grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_two_ranks_posting_as_on_nccl_in_one_process(name):
    # The loopback world posting as NCCL does (stream_ordered=True): the head's collectives go
    # over a loopback world of their own, which the world's backend provides (its broadcast,
    # all-reduce and reduce), the head's actions on their lane; losses and every gradient equal
    # one process's.
    from helpers.loopback import run_threads

    world = _C._LoopbackWorld(2, store=True)
    program = zbpipe.compile(name, 2, 4)
    torch.manual_seed(2)
    mods = [nn.Sequential(nn.Embedding(V, D), nn.Tanh())] + [nn.Sequential(nn.Linear(D, D), nn.Tanh())
                                                             for _ in range(program.num_stages - 1)]
    head = _head()
    x, y = torch.randint(V, (8, 5)), torch.randint(V, (8, 5))
    ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    h = x
    for m in ref_mods:
        h = m(h)
    ref_losses = [F.cross_entropy(ref_head(hc).flatten(0, 1), yc.flatten()) for hc, yc in zip(h.chunk(4), y.chunk(4))]
    torch.stack(ref_losses).mean().backward()
    outs = [zbpipe.VocabParallelOutput(head, group=world.group(r)) for r in range(2)]

    def rank_main(r):
        mine = [s for s in range(program.num_stages) if program.stage_to_rank[s] == r]
        stages = [zbpipe.PipelineStage(mods[s], s, program.num_stages, "cpu", group=world.group(r)) for s in mine]
        cls = zbpipe.get_schedule_class(name)
        sched = cls(stages[0] if issubclass(cls, zbpipe.PipelineScheduleSingle) else stages, 4, output=outs[r],
                    stream_ordered=True, timeout=30.0)
        losses = []
        sched.step(*((x,) if 0 in mine else ()), target=y, losses=losses)
        return losses

    results = run_threads(world, rank_main, timeout=60)
    root = program.stage_to_rank[-1]
    torch.testing.assert_close(torch.stack(results[root]), torch.stack(ref_losses).detach(), rtol=1e-5, atol=0)
    for m, r in zip(mods, ref_mods):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([o.weight.grad for o in outs]), ref_head.weight.grad, rtol=1e-5, atol=1e-7)
