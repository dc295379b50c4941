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

import torch
import torch.nn as nn
import torch.nn.functional as F

from _pp_world import run_world

PP = 3
TIMEOUT = 60.0  # what a peer would wait without propagation


class Lin(nn.Module):
    def __init__(self, fail_at=None, shrink_at=None, sleep_at=None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.fail_at, self.shrink_at, self.sleep_at = fail_at, shrink_at, sleep_at

    def forward(self, x):
        self.calls += torch.is_grad_enabled()  # not the handshake's no-grad shape run
        if self.calls == self.fail_at:
            raise ValueError("boom from inside the stage")
        if self.calls == self.sleep_at:
            time.sleep(4.0)
        y = self.lin(x)
        return y[:, :4] if self.calls == self.shrink_at else y


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


def _world(rank, pp):
    import torch.distributed as dist

    import zbpipe

    def on(r, **kw):
        return lambda: Lin(**(kw if rank == r else {}))

    out = {"warmup": _run(rank, zbpipe.Schedule1F1B, 4, on(-1))}
    # Step 2, microbatch 2's forward on rank 1 raises.
    out["stage_exception"] = _run(rank, zbpipe.Schedule1F1B, 4, on(1, fail_at=7))
    _bad_loss.calls = -4  # the first step's four microbatches pass
    out["loss_error"] = _run(rank, zbpipe.Schedule1F1B, 4, on(-1), loss_fn=_bad_loss)
    out["shape_change"] = _run(rank, zbpipe.Schedule1F1B, 4, on(0, shrink_at=6))
    # Rank 1 computes for 4 s in step 2; rank 2 (timeout 1 s) gives up waiting for it.
    out["timeout"] = _run(rank, zbpipe.Schedule1F1B, 4, on(1, sleep_at=6), timeout=1.0 if rank == 2 else TIMEOUT)
    # Mismatched programs: another schedule on rank 0, another microbatch count on rank 2.
    cls = zbpipe.Schedule1F1B if rank == 0 else zbpipe.ScheduleGPipe
    out["other_schedule"] = _run(rank, cls, 4, on(-1), steps=1)
    out["other_microbatches"] = _run(rank, zbpipe.Schedule1F1B, 8 if rank == 2 else 4, on(-1), steps=1)
    dist.barrier()  # rank 0 hosts the store: it stays until every rank has its answer
    return out


def _cause(rank, failing_rank, action):
    """How a message names the failing rank and action: its own header, or a peer's report
    (which interrupted this rank's communication: it did not wait for its own timeout)."""
    if rank == failing_rank:
        return f"zbpipe: rank {rank} failed at action {action} (index"
    return f"rank {failing_rank} failed at action {action} (its step 2): "


def _check(res, scenario, rank, *needles):
    kind, msg, seconds = res[scenario]
    assert kind == "PipelineError", (scenario, rank, kind, msg)
    for n in needles:
        assert n in msg, f"{scenario}, rank {rank}: {n!r} not in:\n{msg}"
    assert seconds < TIMEOUT / 2, f"{scenario}, rank {rank}: {seconds:.1f} s, the peer's timeout"


def test_a_failure_reaches_every_rank_and_programs_are_compared():
    results, codes, leftover = run_world(PP, _world, timeout=300)
    assert not leftover and codes == [0] * PP, (leftover, codes)
    for rank in range(PP):
        assert "error" not in results[rank], results[rank].get("error")
        r = results[rank]
        assert r["warmup"][0] == "ok", r["warmup"]
        _check(r, "stage_exception", rank, f"zbpipe: rank {rank} failed at action",
               _cause(rank, 1, "1F2"), "boom from inside the stage")
        _check(r, "loss_error", rank, _cause(rank, 2, "2F1"), "loss exploded")
        _check(r, "shape_change", rank, _cause(rank, 0, "0F1"),
               "(float32[2, 4]) but the pipeline agreed on (float32[2, 8])",
               "every microbatch of a step must have the same shapes")
        _check(r, "timeout", rank, _cause(rank, 2, "2F1"), "waiting for 2RECV_F1",
               "timeout 1 s")
        for scenario, failing in (("stage_exception", 1), ("loss_error", 2), ("shape_change", 0), ("timeout", 2)):
            if rank != failing:  # its pending communication was aborted: no timeout of its own
                assert "was aborted (a peer failed)" in r[scenario][1], (scenario, rank, r[scenario][1])
                assert "timeout 60" not in r[scenario][1], (scenario, rank, r[scenario][1])
        _check(r, "other_schedule", rank, "the ranks run different programs", "schedule=1f1b", "schedule=gpipe",
               "microbatches=4")
        _check(r, "other_microbatches", rank, "the ranks run different programs", "microbatches=4",
               "microbatches=8")
        if rank != 1:  # both sides of each mismatch name their own value first
            me = "schedule=1f1b" if rank == 0 else "schedule=gpipe"
            assert f"rank {rank} runs {me}" in r["other_schedule"][1], r["other_schedule"][1]
