"""A failure reaches a peer that is no longer in a step: the watcher keeps waiting for failures
between steps, and on one aborts the rank's communicators of the pipeline group, so a
collective of the trainer's own blocked on that group (an all-reduce after the step, a
gradient-norm clip, a log) raises instead of waiting for NCCL's watchdog. On the in-process
loopback world, which models NCCL's abort (a group's abort ends its unfinished all-reduce with
an error): pp=2, zb_h1 with NCCL's posting discipline; rank 1 ends its step and enters an
all-reduce on the pipeline group, rank 0 fails in its trailing W (0W3, its last action). Rank
1's all-reduce must raise within 2 s of rank 0's failure (its wait's own bound is 30 s)."""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import run_threads

import zbpipe
from zbpipe import _C

M, WIDTH = 4, 4
BOUND_S = 2.0


def test_a_collective_after_the_step_ends_when_a_peer_fails_in_its_trailing_w():
    world = _C._LoopbackWorld(2, store=True)
    barrier = threading.Barrier(2)
    failed_at, out = {}, {}

    def failing_w(action, ctx):
        if action.microbatch == M - 1:  # 0W3: rank 1 has ended its step meanwhile
            while not out.get("blocked"):
                time.sleep(0.01)
            time.sleep(0.2)  # rank 1 is inside its all-reduce by now
            failed_at["t"] = time.monotonic()
            raise RuntimeError("W failed")
        ctx.run(action)

    def rank_main(r):
        stage = zbpipe.PipelineStage(nn.Linear(WIDTH, WIDTH), r, 2, "cpu", group=world.group(r))
        sched = zbpipe.ScheduleZBH1(stage, M, loss_fn=F.mse_loss, stream_ordered=True, timeout=30.0)
        x, y = torch.randn(2 * M, WIDTH), torch.randn(2 * M, WIDTH)
        step = lambda: sched.step(*((x,) if r == 0 else ()), target=y if r == 1 else None)  # noqa: E731
        step()  # a good step first
        barrier.wait(30)
        if r == 0:
            sched.register_custom_function(zbpipe.Kind.W, failing_w)
            try:
                step()
            except zbpipe.PipelineError as e:
                return str(e).splitlines()[0]
            return "no error"
        step()  # rank 1's part of the step ends before rank 0's last W
        out["blocked"] = True
        try:  # the trainer's own collective on the pipeline group, bounded by 30 s here
            world.group(1).allreduce([torch.ones(1)]).wait(datetime.timedelta(seconds=30))
        except Exception as e:  # noqa: BLE001 - the point
            return time.monotonic(), f"{type(e).__name__}: {e}"
        return time.monotonic(), "the all-reduce completed"

    res = run_threads(world, rank_main, timeout=90)
    assert res[0].startswith("rank 0 failed in stage 0 at action 0W3 (microbatch 3): RuntimeError: W failed"), res
    ended, what = res[1]
    assert "aborted" in what, res[1]
    assert ended - failed_at["t"] < BOUND_S, (ended - failed_at["t"], what)
    assert world.aborts(1) == 1, world.aborts(1)  # the watcher aborted rank 1's pipeline group
