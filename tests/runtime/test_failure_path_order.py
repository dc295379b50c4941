"""The failure path on a stream-ordered backend, in order (csrc/runtime/executor_failure.cpp,
p2p.cpp), on the in-process loopback world, which models NCCL's communicators (pp=2, 1F1B with
NCCL's posting discipline, a store for the failure watch):

- the failing rank publishes its failure before it aborts its communicators: with a group
  abort that takes 5 s (a slow ncclCommAbort), the peer still hears of the failure at once;
- the abort is the group's (ProcessGroupNCCL's abort is bounded), never a Work's (on NCCL a
  synchronous ncclCommAbort on the calling thread, unbounded): no Work::abort on any rank;
- the watcher never aborts while the rank's thread is inside a coalesced post (between
  startCoalescing and endCoalescing, where PG-NCCL keeps thread-local group state that would go
  stale for the recovery's new group): an abort that comes then is done when the post ends."""

from __future__ import annotations

import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import run_threads
from helpers.model_registry import Stops

import zbpipe
from zbpipe import _C

M, WIDTH = 4, 4
# The failing rank's abort this slow; its peer hears of the failure well inside half of it when
# published first.
SLOW_ABORT_S = 5.0


def _schedule(world, r, module):
    stage = zbpipe.PipelineStage(module, r, 2, "cpu", group=world.group(r))
    return zbpipe.Schedule1F1B(stage, M, loss_fn=F.mse_loss, stream_ordered=True, timeout=30.0)


def _step(sched, r):
    x, y = torch.randn(2 * M, WIDTH), torch.randn(2 * M, WIDTH)
    try:
        sched.step(*((x,) if r == 0 else ()), target=y if r == 1 else None)
    except zbpipe.PipelineError as e:
        return time.monotonic(), str(e).splitlines()[0]
    return time.monotonic(), "ok"


class _StopsAt(nn.Module):
    """Linear(4, 4) whose second training forward of the second step records the time and raises."""

    def __init__(self, stop):
        super().__init__()
        self.lin, self.calls, self.stop, self.stopped_at = nn.Linear(WIDTH, WIDTH), 0, stop, None

    def forward(self, x):
        self.calls += torch.is_grad_enabled()
        if self.stop and self.calls == M + 2:
            self.stopped_at = time.monotonic()
            raise RuntimeError("this rank stops here")
        return self.lin(x)


def test_the_failing_rank_publishes_before_a_slow_abort():
    world = _C._LoopbackWorld(2, stream_waits=True, store=True)
    modules = [_StopsAt(False), _StopsAt(True)]
    barrier = threading.Barrier(2)

    def rank_main(r):
        sched = _schedule(world, r, modules[r])
        assert _step(sched, r)[1] == "ok"  # agreement, shapes: then aborts get slow
        barrier.wait(30)
        # Rank 1's abort only: rank 0's step may end only once its own abort has (its stream
        # waits on a receive the abort ends), which would time that abort, not the news.
        if r == 1:
            world.slow_aborts(1, SLOW_ABORT_S)
        barrier.wait(30)
        return _step(sched, r)

    out = run_threads(world, rank_main, timeout=90)
    (_, culprit), (told, first) = out[1], out[0]
    assert culprit.startswith("rank 1 failed in stage 1 at action 1F1"), out
    assert first.startswith("aborted because rank 1 failed in stage 1 at action 1F1"), out
    # Published first: rank 0 did not wait for rank 1's abort to hear of it.
    assert told - modules[1].stopped_at < SLOW_ABORT_S / 2, (told - modules[1].stopped_at, out)
    assert [world.aborts(r) for r in range(2)] == [1, 1]


def test_communicators_end_by_the_groups_abort_never_a_works():
    world = _C._LoopbackWorld(2, stream_waits=True, store=True)

    def rank_main(r):
        sched = _schedule(world, r, Stops(2 if r == 1 else None))
        return _step(sched, r)[1]

    out = run_threads(world, rank_main, timeout=90)
    assert out[1].startswith("rank 1 failed in stage 1 at action 1F1"), out
    assert out[0].startswith("aborted because rank 1 failed"), out
    assert [world.aborts(r) for r in range(2)] == [1, 1]  # the failing rank's, and its peer's watcher's
    assert [world.work_aborts(r) for r in range(2)] == [0, 0]


class _RaisesDuringPeersPost(nn.Module):
    """Stage 0: its second training forward waits until rank 1 is inside a coalesced post (its
    RECV_F0, held open by the world), then raises."""

    def __init__(self, world):
        super().__init__()
        self.lin, self.calls, self.world = nn.Linear(WIDTH, WIDTH), 0, world

    def forward(self, x):
        self.calls += torch.is_grad_enabled()
        if self.calls == M + 1:
            deadline = time.monotonic() + 20
            while not self.world.in_coalescing(1) and time.monotonic() < deadline:
                time.sleep(0.005)
            raise RuntimeError("fails while rank 1 posts")
        return self.lin(x)


def test_no_abort_inside_a_coalesced_post():
    world = _C._LoopbackWorld(2, store=True)
    barrier = threading.Barrier(2)

    def rank_main(r):
        sched = _schedule(world, r, _RaisesDuringPeersPost(world) if r == 0 else nn.Linear(WIDTH, WIDTH))
        assert _step(sched, r)[1] == "ok"
        barrier.wait(30)
        if r == 1:
            world.hold_coalesced_posts(1, 1.0)  # rank 1's next post stays open 1 s
        barrier.wait(30)
        return _step(sched, r)[1]

    out = run_threads(world, rank_main, timeout=90)
    assert out[0].startswith("rank 0 failed in stage 0 at action 0F0"), out
    assert out[1].startswith("aborted because rank 0 failed"), out
    assert world.aborts(1) == 1, world.aborts(1)  # rank 1's watcher aborted its group ...
    assert world.aborts_in_coalescing(1) == 0  # ... once its post had ended
