"""A failure anywhere reaches every rank, and ranks agree on the program before running it.

pp=3 on Gloo (a middle rank sees neither the batch nor the target), every scenario on a fresh
group, with a wait timeout (60 s) far above the time a failure may take to arrive: a stage
exception, a loss error, a stage output changing shape mid-step, and a rank timing out while
its peer computes; then ranks built with another schedule or microbatch count. Every rank must
raise zbpipe.PipelineError naming the failing rank, its action and its message, well before
the timeout (the time is not a speed goal: benchmarks/bench_failure.py measures it).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from helpers.model_registry import FaultyLinear

PP = 3
TIMEOUT = 60.0  # what a peer would wait without propagation


def _bad_loss(out, y):
    if _bad_loss.calls == 1:  # the second microbatch of the second step
        raise RuntimeError("loss exploded")
    _bad_loss.calls += 1
    return F.mse_loss(out, y)


def _run(rank, cls, n, make_module, loss_fn=F.mse_loss, timeout=TIMEOUT, steps=2):
    """`steps` steps on a fresh group; (exception type, message, seconds of the failing step)."""
    import torch.distributed as dist

    import zbpipe

    group = dist.new_group(list(range(PP)), backend="gloo")
    torch.manual_seed(0)
    stage = zbpipe.PipelineStage(make_module(), rank, PP, "cpu", group=group)
    sched = cls(stage, n, loss_fn=loss_fn, timeout=timeout)
    x, y = torch.randn(2 * n, 8), torch.randn(2 * n, 8)
    for _ in range(steps):
        t0 = time.monotonic()
        try:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == PP - 1 else None)
        except Exception as e:  # noqa: BLE001 - the result is the point
            return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("ok", "", 0.0)


def _on(rank, r, **kw):
    """A module factory: FaultyLinear(**kw) on rank r, a plain one elsewhere."""
    return lambda: FaultyLinear(**(kw if rank == r else {}))


def _scenario(rank, pp, scenario):
    """A warm-up step (first use may be slow), then the scenario on a fresh group."""
    import zbpipe

    warm = _run(rank, zbpipe.Schedule1F1B, 4, _on(rank, -1), steps=1)
    assert warm[0] == "ok", warm
    if scenario == "stage_exception":  # step 2, microbatch 2's forward on rank 1 raises
        return _run(rank, zbpipe.Schedule1F1B, 4, _on(rank, 1, fail_at=7))
    if scenario == "loss_error":
        _bad_loss.calls = -4  # the first step's four microbatches pass
        return _run(rank, zbpipe.Schedule1F1B, 4, _on(rank, -1), loss_fn=_bad_loss)
    if scenario == "shape_change":
        return _run(rank, zbpipe.Schedule1F1B, 4, _on(rank, 0, shrink_at=6))
    if scenario == "timeout":  # rank 1 computes for 4 s in step 2; rank 2 (timeout 1 s) gives up on it
        return _run(rank, zbpipe.Schedule1F1B, 4, _on(rank, 1, sleep_at=6), timeout=1.0 if rank == 2 else TIMEOUT)
    if scenario == "other_schedule":  # rank 0 runs 1F1B, the others GPipe
        cls = zbpipe.Schedule1F1B if rank == 0 else zbpipe.ScheduleGPipe
        return _run(rank, cls, 4, _on(rank, -1), steps=1)
    assert scenario == "other_microbatches"  # rank 2 splits into 8
    return _run(rank, zbpipe.Schedule1F1B, 8 if rank == 2 else 4, _on(rank, -1), steps=1)


def _first_line(rank, failing_rank, action):
    """How a message's first line names the failing rank, stage and action: its own failure,
    or a peer's (which interrupted this rank's communication: it did not wait for its own
    timeout)."""
    culprit = f"rank {failing_rank} failed in stage {failing_rank} at action {action} (microbatch {action[-1]}): "
    return culprit if rank == failing_rank else "aborted because " + culprit


def _check(res, scenario, rank, *needles):
    kind, msg, seconds = res
    assert kind == "PipelineError", (scenario, rank, kind, msg)
    for n in needles:
        assert n in msg, f"{scenario}, rank {rank}: {n!r} not in:\n{msg}"
    assert seconds < TIMEOUT / 2, f"{scenario}, rank {rank}: {seconds:.1f} s, the peer's timeout"


# scenario -> (failing rank, its action, what every message names)
FAILURES = {
    "stage_exception": (1, "1F2", ["boom from inside the stage"]),
    "loss_error": (2, "2F1", ["loss exploded"]),
    "shape_change": (0, "0F1", ["(float32[2, 4]) but the pipeline agreed on (float32[2, 8])",
                                "every microbatch of a step must have the same shapes"]),
    "timeout": (2, "2F1", ["waiting for 2RECV_F1", "timeout 1 s"]),
}


@pytest.mark.parametrize("scenario", list(FAILURES))
def test_a_failure_reaches_every_rank(spawn_world, scenario):
    failing, action, needles = FAILURES[scenario]
    for rank, res in enumerate(spawn_world(PP).run(_scenario, scenario, timeout_s=300)):
        _check(res, scenario, rank, *needles)
        assert res[1].startswith(_first_line(rank, failing, action)), (scenario, rank, res[1])
        assert "), step 2\n" in res[1], (scenario, rank, res[1])
        if rank != failing:  # its pending communication was aborted: no timeout of its own
            assert "was aborted (a peer failed)" in res[1], (scenario, rank, res[1])
            assert "timeout 60" not in res[1], (scenario, rank, res[1])


def test_ranks_with_different_schedules_refuse_to_run(spawn_world):
    for rank, res in enumerate(spawn_world(PP).run(_scenario, "other_schedule", timeout_s=300)):
        _check(res, "other_schedule", rank, "the ranks run different programs", "schedule=1f1b",
               "schedule=gpipe", "microbatches=4")
        if rank != 1:  # both sides of each mismatch name their own value first
            me = "schedule=1f1b" if rank == 0 else "schedule=gpipe"
            assert f"rank {rank} runs {me}" in res[1], res[1]


def test_ranks_with_different_microbatch_counts_refuse_to_run(spawn_world):
    for rank, res in enumerate(spawn_world(PP).run(_scenario, "other_microbatches", timeout_s=300)):
        _check(res, "other_microbatches", rank, "the ranks run different programs", "microbatches=4",
               "microbatches=8")
