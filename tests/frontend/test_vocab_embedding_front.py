"""zbpipe.VocabParallelEmbedding's front end: its shard of rows, its bad input (each a clear
error before any step), and a one-rank pipeline (the whole embedding one shard) equal to one
process, with and without the vocabulary-parallel head. One in-process loopback world
(zbpipe._C._LoopbackWorld) per case; the multi-rank runs are
tests/runtime/test_vocab_embedding.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zbpipe
from zbpipe import _C

D, V = 8, 11


def _embedding(**kw):
    torch.manual_seed(0)
    return nn.Embedding(V, D, **kw)


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _one_rank(name="1f1b", **schedule_kw):
    """A 1-rank loopback world, its stage (the body after the embedding plus a head) and a
    schedule with input_embedding=."""
    world = _C._LoopbackWorld(1)
    emb = _embedding()
    torch.manual_seed(1)
    body = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
    stage = zbpipe.PipelineStage(body, 0, 1, "cpu", group=world.group(0))
    shard = zbpipe.VocabParallelEmbedding(emb, group=world.group(0))
    sched = zbpipe.get_schedule_class(name)(stage, 2, loss_fn=_loss, input_embedding=shard, **schedule_kw)
    return world, emb, body, shard, sched


def test_each_rank_keeps_its_contiguous_rows_uneven_vocabularies_too():
    world = _C._LoopbackWorld(3)
    emb = _embedding()
    shards = [zbpipe.VocabParallelEmbedding(emb, group=world.group(r)) for r in range(3)]
    assert [s.shard_range for s in shards] == [(0, 3), (3, 7), (7, 11)]
    assert torch.equal(torch.cat([s.weight for s in shards]), emb.weight)
    assert all(s.weight.requires_grad and s.weight.data_ptr() != emb.weight.data_ptr() for s in shards)


# ---- bad input ------------------------------------------------------------------------------

def test_an_embedding_that_is_not_an_nn_embedding():
    world = _C._LoopbackWorld(1)
    with pytest.raises(TypeError, match="embedding must be an nn.Embedding .* got Linear"):
        zbpipe.VocabParallelEmbedding(nn.Linear(V, D), group=world.group(0))


def test_a_vocabulary_smaller_than_the_pipeline():
    world = _C._LoopbackWorld(4)
    with pytest.raises(ValueError, match="a vocabulary of 3 rows cannot be split over the pipeline's 4 ranks"):
        zbpipe.VocabParallelEmbedding(nn.Embedding(3, D), group=world.group(0))


@pytest.mark.parametrize("kw,what", [(dict(max_norm=1.0), "max_norm=1.0"),
                                     (dict(scale_grad_by_freq=True), "scale_grad_by_freq=True"),
                                     (dict(sparse=True), "sparse=True")])
def test_embeddings_it_cannot_split_are_refused(kw, what):
    world = _C._LoopbackWorld(1)
    with pytest.raises(ValueError, match=f"{what.replace('.', '[.]')} .*is not supported"):
        zbpipe.VocabParallelEmbedding(_embedding(**kw), group=world.group(0))


def test_an_input_embedding_that_is_not_one():
    world = _C._LoopbackWorld(1)
    stage = zbpipe.PipelineStage(nn.Linear(D, V), 0, 1, "cpu", group=world.group(0))
    with pytest.raises(TypeError, match="input_embedding= takes a zbpipe.VocabParallelEmbedding, got Embedding"):
        zbpipe.Schedule1F1B(stage, 2, loss_fn=_loss, input_embedding=_embedding())


def test_an_embedding_on_another_group_than_the_stages():
    world, other = _C._LoopbackWorld(1), _C._LoopbackWorld(2)
    stage = zbpipe.PipelineStage(nn.Linear(D, V), 0, 1, "cpu", group=world.group(0))
    shard = zbpipe.VocabParallelEmbedding(_embedding(), group=other.group(1))
    with pytest.raises(ValueError, match="sharded over a group of 2 ranks"):
        zbpipe.Schedule1F1B(stage, 2, loss_fn=_loss, input_embedding=shard)


def test_a_program_without_the_embedding_actions():
    world = _C._LoopbackWorld(1)
    stage = zbpipe.PipelineStage(nn.Linear(D, V), 0, 1, "cpu", group=world.group(0))
    shard = zbpipe.VocabParallelEmbedding(_embedding(), group=world.group(0))
    with pytest.raises(ValueError, match="input_embedding= needs a program with the embedding's actions"):
        zbpipe.PipelineSchedule.from_program(stage, zbpipe.compile("1f1b", 1, 2), _loss, input_embedding=shard)
    sched = zbpipe.PipelineSchedule.from_program(stage, zbpipe.compile("1f1b", 1, 2, vocab_embedding=True), _loss,
                                                 input_embedding=shard)
    sched.step(torch.randint(V, (4, 5)), target=torch.randint(V, (4, 5)))
    assert shard.weight.grad is not None


@pytest.mark.parametrize("bad", [V, -1, 100])
def test_token_ids_outside_the_vocabulary(bad):
    world, _, body, shard, sched = _one_rank()
    x = torch.randint(V, (4, 5))
    x[3, 2] = bad
    with pytest.raises(ValueError, match=f"microbatch 1 has token id {bad} outside \\[0, {V}\\)"):
        sched.step(x, target=torch.randint(V, (4, 5)))
    assert shard.weight.grad is None and all(p.grad is None for p in body.parameters())  # before any step


def test_token_ids_are_needed_and_must_be_integers():
    world, _, _, _, sched = _one_rank()
    with pytest.raises(ValueError, match="needs the token ids as the first positional argument"):
        sched.step(target=torch.randint(V, (4, 5)))
    with pytest.raises(ValueError, match="must be an integer tensor, got torch.float32"):
        sched.step(torch.rand(4, 5), target=torch.randint(V, (4, 5)))


# ---- one rank: the whole embedding is one shard ---------------------------------------------

def _reference(emb, body, x, y, m, head=None):
    losses = []
    for xc, yc in zip(x.chunk(m), y.chunk(m)):
        out = body(emb(xc))
        out = head(out) if head is not None else out
        losses.append(_loss(out, yc))
    torch.stack(losses).mean().backward()
    return [loss.detach() for loss in losses]


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "gpipe"])
def test_one_rank_equals_one_process(name, head):
    world = _C._LoopbackWorld(1)
    emb = _embedding(padding_idx=4)
    torch.manual_seed(1)
    body = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    lm_head = nn.Linear(D, V)
    ref_emb, ref_body, ref_head = copy.deepcopy(emb), copy.deepcopy(body), copy.deepcopy(lm_head)
    x = torch.randint(V, (4, 5), generator=torch.Generator().manual_seed(2))
    x[0, :3] = 4  # the padding row: no gradient
    y = torch.randint(V, (4, 5), generator=torch.Generator().manual_seed(3))
    ref_losses = _reference(ref_emb, ref_body, x, y, 2, ref_head)
    module = body if head else nn.Sequential(body, lm_head)
    stage = zbpipe.PipelineStage(module, 0, 1, "cpu", group=world.group(0))
    shard = zbpipe.VocabParallelEmbedding(emb, group=world.group(0))
    kw = dict(output=zbpipe.VocabParallelOutput(lm_head, group=world.group(0))) if head else dict(loss_fn=_loss)
    sched = zbpipe.get_schedule_class(name)(stage, 2, input_embedding=shard, **kw)
    losses = []
    sched.step(x, target=y, losses=losses)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(shard.weight.grad, ref_emb.weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(shard.weight.grad[4]) == 0
    for p, q in zip(body.parameters(), ref_body.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    assert emb.weight.grad is None  # the user's nn.Embedding is not used; its shard is


def test_eval_runs_the_lookups_without_gradients():
    world, emb, body, shard, sched = _one_rank()
    x, y = torch.randint(V, (4, 5)), torch.randint(V, (4, 5))
    losses = []
    out = sched.eval(x, target=y, losses=losses)
    with torch.no_grad():
        want = body(emb(x))
    torch.testing.assert_close(out, want)
    assert len(losses) == 2 and shard.weight.grad is None


def test_post_accumulate_grad_hooks_run_once_per_microbatch_on_the_shard():
    world, _, _, shard, sched = _one_rank("zb_h1")
    calls = []
    shard.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    sched.step(torch.randint(V, (4, 5)), target=torch.randint(V, (4, 5)))
    assert len(calls) == 2 and torch.equal(calls[-1], shard.weight.grad)
