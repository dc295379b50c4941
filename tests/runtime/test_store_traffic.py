"""Steady steps ask nothing of the shared store (csrc/runtime/control_group.h): on the in-process
loopback world, whose store counts the requests made to it, a step after the first (which
agrees on the program, negotiates shapes and opens the control groups) makes no store request
on any rank -- neither for the step's input signature (it travels over the pipeline's control
group), nor for the data-parallel replicas' meetings at the step's start and before the
gradient sync (over each data-parallel group's control group), nor for failures (the watcher
blocks on its inbox). Before, each rank made 5 to 13 requests per step (the signature through
the store, the replicas' meetings, the watcher's polls, a heartbeat every 0.2 s). pp=2 with
NCCL's posting discipline, and pp=2 x dp=2 with a data-parallel adapter whose gradient sync is
an all-reduce on the replicas' loopback group."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import run_threads
from helpers.sync_adapters import CollectiveSync

import zbpipe
import zbpipe.stage
from zbpipe import _C

M, WIDTH, STEADY = 4, 4, 6


def _requests(worlds) -> int:
    return sum(sum(w.store_requests().values()) for w in worlds)


def _x_y(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * M, WIDTH, generator=g), torch.randn(2 * M, WIDTH, generator=g)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_steady_steps_make_no_store_request(name):
    world = _C._LoopbackWorld(2, store=True)
    prog = zbpipe.compile(name, 2, M)
    barrier = threading.Barrier(2)
    counts = {}

    def rank_main(r):
        mine = [s for s in range(prog.num_stages) if prog.stage_to_rank[s] == r]
        stages = [zbpipe.PipelineStage(nn.Linear(WIDTH, WIDTH), s, prog.num_stages, "cpu", group=world.group(r))
                  for s in mine]
        sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=F.mse_loss,
                                                stream_ordered=True, timeout=30.0)
        x, y = _x_y(0)
        args, target = ((x,) if 0 in mine else ()), (y if prog.num_stages - 1 in mine else None)
        sched.step(*args, target=target)  # agreement, shapes, control group
        barrier.wait(30)
        if r == 0:
            counts["after setup"] = _requests([world])
        barrier.wait(30)
        for _ in range(STEADY):
            sched.step(*args, target=target)
        barrier.wait(30)
        if r == 0:
            counts["after steady"] = _requests([world])
        barrier.wait(30)  # no rank drops its schedule (a request) before the count
        return "ok"

    out = run_threads(world, rank_main, timeout=120)
    assert out == {0: "ok", 1: "ok"}, out
    assert counts["after setup"] > 0, counts  # the first step did use the store
    assert counts["after steady"] == counts["after setup"], (counts, world.store_requests())


class _AllReduceSync(CollectiveSync):
    """A data-parallel adapter whose gradient sync sums the stage's gradients over `group` (a
    loopback all-reduce) and averages them."""

    def sync_end(self):
        for p in self._module.parameters():
            self._group.allreduce([p.grad]).wait()
            p.grad /= self._group.size()


def test_replicas_meet_over_their_control_groups_not_the_store(monkeypatch):
    pp, dp = 2, 2
    pipes = [_C._LoopbackWorld(pp, store=True) for _ in range(dp)]      # replica d's pipeline
    replicas = [_C._LoopbackWorld(dp, store=True) for _ in range(pp)]   # stage s's replicas
    monkeypatch.setattr(zbpipe.stage, "adapter_for",
                        lambda module, deferred: _AllReduceSync(module, replicas[module.stage].group(module.replica)))
    worlds = pipes + replicas
    barrier = threading.Barrier(pp * dp)
    counts, grads = {}, {}

    class Rank:  # run_threads wants a world: pp * dp ranks, rank = d * pp + s
        size = pp * dp

    def rank_main(rank):
        d, s = divmod(rank, pp)
        torch.manual_seed(s)
        module = nn.Linear(WIDTH, WIDTH)
        module.stage, module.replica = s, d
        stage = zbpipe.PipelineStage(module, s, pp, "cpu", group=pipes[d].group(s))
        sched = zbpipe.Schedule1F1B(stage, M, loss_fn=F.mse_loss, stream_ordered=True, timeout=30.0)
        x, y = _x_y(d)
        args, target = ((x,) if s == 0 else ()), (y if s == pp - 1 else None)
        sched.step(*args, target=target)
        barrier.wait(30)
        if rank == 0:
            counts["after setup"] = _requests(worlds)
        barrier.wait(30)
        for _ in range(STEADY):
            sched.step(*args, target=target)
        barrier.wait(30)
        if rank == 0:
            counts["after steady"] = _requests(worlds)
        barrier.wait(30)  # no rank drops its schedule (a request) before the count
        grads[rank] = module.weight.grad.clone()
        return "ok"

    out = run_threads(Rank, rank_main, timeout=180)
    assert out == {r: "ok" for r in range(pp * dp)}, out
    assert counts["after setup"] > 0, counts
    assert counts["after steady"] == counts["after setup"], (counts, [w.store_requests() for w in worlds])
    for s in range(pp):  # the replicas' sync ran: both replicas of a stage hold the same gradient
        torch.testing.assert_close(grads[s], grads[pp + s])
