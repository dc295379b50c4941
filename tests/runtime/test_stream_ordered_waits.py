"""Every wait honours the schedule's timeout on stream-ordered backends (NCCL), where a wait
only orders the compute stream and the host runs one wait ahead: a peer that stops mid-step
fails the others with PipelineError naming the rank, the action and the receive, within a few
timeouts. Runs the accelerator path of P2P on the loopback world with stream-like waits (no
GPU here), one thread per rank; the Gloo version is in test_executor_errors.py."""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import run_threads
from helpers.model_registry import Stops

import zbpipe
from zbpipe import _C

TIMEOUT_S = 1.0


def test_a_stopped_peer_fails_the_others_within_the_timeout():
    pp, m = 3, 4
    world = _C._LoopbackWorld(pp, stream_waits=True)

    def rank_main(r):
        x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
        args, target = (x,) if r == 0 else (), y if r == pp - 1 else None

        def schedule(module, timeout):
            stage = zbpipe.PipelineStage(module, r, pp, "cpu", group=world.group(r))
            return zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, timeout=timeout, stream_ordered=True)

        schedule(Stops(), 30.0).step(*args, target=target)  # warm-up: first use is slow
        sched = schedule(Stops(2 if r == 1 else None), TIMEOUT_S)
        t0 = time.monotonic()
        try:
            sched.step(*args, target=target)
        except Exception as e:  # noqa: BLE001 - the result is the point
            return type(e).__name__, str(e), time.monotonic() - t0
        return "ok", "", time.monotonic() - t0

    out = run_threads(world, rank_main, timeout=30)
    assert out[1][0] == "PipelineError" and "this rank stops here" in out[1][1], out[1]
    for r in (0, 2):
        kind, msg, seconds = out[r]
        assert kind == "PipelineError", (r, out[r])
        assert msg.startswith(f"rank {r} failed in stage {r} at action") and "from rank 1" in msg, msg
        assert "not complete by its deadline" in msg and "backend custom" in msg, msg
        assert seconds < 3 * TIMEOUT_S + 5, f"rank {r} took {seconds:.1f} s"
    # Rank 0 runs ahead of its device: the receive that timed out is one it waited on before
    # the action that failed (run-ahead of one wait), named in the message.
    assert ">>" in out[0][1]


def test_prepost_receives_is_refused_where_messages_do_not_complete_on_the_host():
    pp, m = 2, 2
    world = _C._LoopbackWorld(pp, stream_waits=True)

    def rank_main(r):
        x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
        args, target = (x,) if r == 0 else (), y if r == pp - 1 else None
        out = []
        for prepost in (True, None):  # refused, then the default (off there) runs
            stage = zbpipe.PipelineStage(Stops(), r, pp, "cpu", group=world.group(r))
            sched = zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, timeout=30.0,
                                        stream_ordered=True, prepost_receives=prepost)
            try:
                sched.step(*args, target=target)
                out.append(("ok", ""))
            except Exception as e:  # noqa: BLE001 - the result is the point
                out.append((type(e).__name__, str(e)))
        return out

    out = run_threads(world, rank_main, timeout=30)
    assert sorted(out) == list(range(pp)), out
    for r, (refused, default) in sorted(out.items()):
        assert refused[0] == "ScheduleError" and "prepost_receives=True" in refused[1], (r, refused)
        assert "stream-ordered" in refused[1], refused
        assert default == ("ok", ""), (r, default)
