"""Shapes may change between steps: a batch of 8 rows, then 12, then 8 again, then sequences of
length 5 and 7. Each new input signature of the first stage renegotiates every stage's shapes
(the handshake runs once per distinct signature: a signature seen before is reused), and every
step's loss and the accumulated gradients equal a single-process run of the same batches. With
static_shapes=True the first step's shapes stay, and a changed input fails every rank, saying so.

pp=3 on Gloo, 1f1b (one stage per rank) and zbv (rank 0 holds the first and the last stage);
every case in the module's one spawned world, each on a group of its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.asserts import assert_close, assert_grads_close
from helpers.model_registry import MODELS, build, call_chain
from helpers.schedule_registry import rank_schedule

import zbpipe

PP = 3
M = 4
SHAPES = [(8, 8), (12, 8), (8, 8), (4, 5, 8), (4, 7, 8), (12, 8)]  # 4 distinct signatures


def _renegotiating(rank, pp, name):
    """Every step's loss and the accumulated gradients against one process; returns the
    number of handshakes the executor ran."""
    import torch.distributed as dist

    group = dist.new_group(list(range(PP)))
    num_stages = zbpipe.compile(name, PP, M).num_stages
    loss_fn = MODELS["mlp"][2]
    mods = build("mlp", num_stages)
    ref = copy.deepcopy(mods)
    sched, mine = rank_schedule(name, mods, rank, PP, M, group=group, loss_fn=loss_fn, timeout=60)
    for k, shape in enumerate(SHAPES):
        g = torch.Generator().manual_seed(10 + k)
        x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        ref_loss = loss_fn(call_chain(ref, x), y)
        ref_loss.backward()
        losses = []
        sched.step(*((x,) if 0 in mine else ()), target=y if num_stages - 1 in mine else None, losses=losses)
        if num_stages - 1 in mine:
            assert_close(torch.stack(losses).mean(), ref_loss, msg=f"{name} step {k} {shape}: loss")
    assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine], msg=f"{name} rank {rank}")
    return sched._runner.last.handshakes


def _static(rank, pp):
    """Three steps (8, 8, then 12 rows) with static_shapes=True: (outcome, message, handshakes)."""
    import torch.distributed as dist

    group = dist.new_group(list(range(PP)))
    mods = build("mlp", PP)
    stage = zbpipe.PipelineStage(mods[rank], rank, PP, "cpu", group=group)
    sched = zbpipe.Schedule1F1B(stage, M, loss_fn=MODELS["mlp"][2], timeout=60, static_shapes=True)
    out = []
    for rows in (8, 8, 12):
        x, y = torch.randn(rows, 8), torch.randn(rows, 8)
        try:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == PP - 1 else None)
            out.append(("ok", "", sched._runner.last.handshakes))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e), sched._runner.last.handshakes))
    return out


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_shapes_renegotiate_between_steps(spawn_world, name):
    handshakes = spawn_world(PP).run(_renegotiating, name, timeout_s=240)
    assert handshakes == [4] * PP, handshakes


def test_static_shapes_keep_the_first_steps_and_refuse_a_change(spawn_world):
    results = spawn_world(PP).run(_static, timeout_s=240)
    for rank, (first, second, changed) in enumerate(results):
        assert first == ("ok", "", 1) and second == ("ok", "", 1), (first, second)
        kind, msg, handshakes = changed
        assert kind == "PipelineError" and handshakes == 1, changed
        assert "(float32[3, 8]) but the pipeline agreed on (float32[2, 8])" in msg, msg
        if rank == 0:
            assert "static_shapes=True" in msg and ">>0F0<<" in msg, msg
        else:
            assert msg.startswith("aborted because rank 0 failed in stage 0 at action 0F0 (microbatch 0): "), msg
            assert "), step 3\n" in msg, msg
