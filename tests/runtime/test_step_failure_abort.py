"""A failing rank aborts its own communicators: on a stream-ordered backend (NCCL) its compute
stream may already wait on a receive that will never come, so every later kernel -- the
recovery recipe's included -- would block until NCCL's watchdog kills the process. The
pipeline group is aborted on every rank whose step fails, and the data-parallel groups of a
stage whose gradient sync was running when it failed; then a new group and schedule run
again. Runs the accelerator path of P2P on the loopback world with stream-like waits (no GPU
here), counting ProcessGroup::abort calls per rank (csrc/runtime/loopback.h)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers.loopback import run_threads
from helpers.model_registry import Stops
from helpers.sync_adapters import CollectiveSync

import zbpipe
import zbpipe.stage
from zbpipe import _C

PP, M = 2, 4


def _step(world, r, module, timeout, **kw):
    x, y = torch.randn(2 * M, 4), torch.randn(2 * M, 4)
    stage = zbpipe.PipelineStage(module, r, PP, "cpu", group=world.group(r))
    sched = zbpipe.Schedule1F1B(stage, M, loss_fn=F.mse_loss, timeout=timeout, stream_ordered=True, **kw)
    try:
        sched.step(*((x,) if r == 0 else ()), target=y if r == PP - 1 else None)
    except zbpipe.PipelineError as e:
        return str(e)
    return "ok"


def test_a_failing_rank_aborts_its_group_and_a_new_one_runs():
    world = _C._LoopbackWorld(PP, stream_waits=True)

    def rank_main(r):
        assert _step(world, r, Stops(), 30.0) == "ok"  # warm-up: first use is slow
        return _step(world, r, Stops(2 if r == 1 else None), 1.0)

    out = run_threads(world, rank_main, timeout=60)
    assert out[1].startswith("rank 1 failed in stage 1 at action 1F1"), out[1]
    assert out[0].startswith("rank 0 failed"), out[0]  # its receive from rank 1 missed its deadline
    # Each failing rank aborted its own group once: the culprit (before the fix: never) and
    # the rank that timed out.
    assert [world.aborts(r) for r in range(PP)] == [1, 1]
    # The recovery recipe: a new group and schedule on the same device run a step.
    fresh = _C._LoopbackWorld(PP, stream_waits=True)
    again = run_threads(fresh, lambda r: _step(fresh, r, Stops(), 30.0), timeout=60)
    assert again == {0: "ok", 1: "ok"}, again
    assert [fresh.aborts(r) for r in range(PP)] == [0, 0]


class _FailingSync(CollectiveSync):
    """A data-parallel adapter whose gradient sync runs a collective on `group` and fails inside
    it when `fails`."""

    def __init__(self, module, group, fails):
        super().__init__(module, group)
        self._fails = fails

    def sync_end(self):
        if self._fails:
            raise RuntimeError("the data-parallel all-reduce failed")


def test_a_failure_inside_the_gradient_sync_aborts_the_data_parallel_group(monkeypatch):
    world = _C._LoopbackWorld(PP, stream_waits=True)
    replicas = [_C._LoopbackWorld(1) for _ in range(PP)]  # each stage's data-parallel group
    monkeypatch.setattr(zbpipe.stage, "adapter_for",
                        lambda module, deferred: _FailingSync(module, replicas[module.rank].group(0), module.rank == 1))

    def rank_main(r):
        module = Stops()
        module.rank = r
        return _step(world, r, module, 5.0)

    out = run_threads(world, rank_main, timeout=60)
    assert "the data-parallel all-reduce failed" in out[1], out[1]
    # Rank 1 failed inside its sync: its data-parallel group is aborted with its pipeline
    # group; rank 0's sync completed (its failure came later, waiting for rank 1).
    assert [replicas[r].aborts(0) for r in range(PP)] == [0, 1]
    assert world.aborts(1) == 1
