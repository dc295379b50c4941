"""Bad input fails fast and hangs nothing: a batch that does not split into the microbatches, a
stage whose output shape differs from what the next stage expects (declared, and changing at
run time), an exception inside a stage, and a peer that dies mid-step. Every surviving rank
gets a clear error (naming the rank and the failing action, with the program grid) in bounded
time, and no process is left behind. One spawned world per scenario family (pp=3, so a
middle rank sees neither the input nor the target)."""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from _pp_world import run_world

PP = 3
WAIT_S = 2.0  # the executor's wait timeout in these tests


class Lin(nn.Module):
    def __init__(self, fail_at_call: int | None = None, die_at_call: int | None = None, shrink_at_call: int | None = None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.fail_at_call, self.die_at_call, self.shrink_at_call = fail_at_call, die_at_call, shrink_at_call

    def forward(self, x):
        self.calls += torch.is_grad_enabled()  # not the handshake's no-grad shape run
        if self.calls == self.fail_at_call:
            raise ValueError("boom from inside the stage")
        if self.calls == self.die_at_call:
            os._exit(3)
        y = self.lin(x)
        return y[:, :4] if self.calls == self.shrink_at_call else y


def _attempt(rank, make_stage, batch=8, n=4, timeout=WAIT_S):
    """One step on a fresh group; returns (exception type, message, seconds) or ok."""
    import torch.distributed as dist

    import zbpipe

    group = dist.new_group(list(range(PP)), backend="gloo")
    torch.manual_seed(0)
    stage = make_stage(group)
    sched = zbpipe.Schedule1F1B(stage, n, loss_fn=F.mse_loss, timeout=timeout)
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    t0 = time.monotonic()
    try:
        if rank == 0:
            sched.step(x)
        elif rank == PP - 1:
            sched.step(target=y)
        else:
            sched.step()
    except Exception as e:  # noqa: BLE001 - the result is the point
        return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("ok", "", time.monotonic() - t0)


def _errors_world(rank, pp):
    import torch.distributed as dist

    import zbpipe

    def plain(group, **kw):
        return zbpipe.PipelineStage(Lin(**(kw if rank == 1 else {})), rank, PP, "cpu", group=group)

    out = {"warmup": _attempt(rank, plain, timeout=60)}  # first use (imports, lazy init) may be slow
    out["indivisible"] = _attempt(rank, plain, batch=10)
    out["declared_shape"] = _attempt(rank, lambda g: zbpipe.PipelineStage(
        Lin(), rank, PP, "cpu", group=g, input_args=torch.empty(2, 5) if rank == 1 else None))
    out["runtime_shape"] = _attempt(rank, lambda g: plain(g, shrink_at_call=3))
    out["stage_exception"] = _attempt(rank, lambda g: plain(g, fail_at_call=2))
    out["recovered"] = _attempt(rank, plain)  # a new group and schedule work again
    # Stages placed as a loop where the schedule wants a V: refused before any message.
    mods = [Lin() for _ in range(2 * PP)]
    wrong = [zbpipe.PipelineStage(mods[s], s, 2 * PP, "cpu") for s in (rank, rank + PP)]
    try:
        zbpipe.ScheduleZBVZeroBubble(wrong, 4, loss_fn=F.mse_loss, timeout=WAIT_S).step(
            *((torch.randn(8, 8),) if rank == 0 else ()), target=torch.randn(8, 8))
        out["placement"] = ("ok", "", 0.0)
    except Exception as e:  # noqa: BLE001
        out["placement"] = (type(e).__name__, str(e), 0.0)
    dist.barrier()  # rank 0 hosts the store: it stays until every rank has its answer
    return out


def _dying_world(rank, pp):
    import zbpipe

    def make(group):
        # Rank 1 dies in its second forward: after the handshake, mid-step.
        return zbpipe.PipelineStage(Lin(die_at_call=2 if rank == 1 else None), rank, PP, "cpu", group=group)

    def plain(group):
        return zbpipe.PipelineStage(Lin(), rank, PP, "cpu", group=group)

    warmup = _attempt(rank, plain, timeout=60)  # first use (imports, lazy init) may be slow
    return {"warmup": warmup, "died": _attempt(rank, make)}


def _check_failure(res, rank, *needles):
    kind, msg, seconds = res
    assert kind in ("PipelineError", "ValueError"), (rank, kind, msg)
    for n in needles:
        assert n in msg, f"rank {rank}: {n!r} not in:\n{msg}"
    assert seconds < 10 * WAIT_S + 10, f"rank {rank} took {seconds:.1f}s"  # bounded, not a hang


def test_bad_input_fails_every_rank_cleanly():
    results, codes, leftover = run_world(PP, _errors_world, timeout=180)
    assert not leftover and codes == [0] * PP, (leftover, codes)
    for rank in range(PP):
        assert "error" not in results[rank], results[rank].get("error")
        r = results[rank]
        assert r["warmup"][0] == "ok", r["warmup"]
        # Indivisible batch: the ranks holding the batch / target say so at once; the middle
        # rank learns it from them (through the store) instead of waiting for its timeout.
        if rank in (0, PP - 1):
            assert r["indivisible"][0] == "ValueError"
            _check_failure(r["indivisible"], rank, "not divisible by n_microbatches=4")
        else:
            _check_failure(r["indivisible"], rank, "rank 1 failed at action", "(before the step)",
                           "not divisible by n_microbatches=4")
            assert "rank 0 failed at action" in r["indivisible"][1] or "rank 2 failed at action" in r["indivisible"][1]
            assert "timeout" not in r["indivisible"][1] and " within " not in r["indivisible"][1]  # told, not timed out
        # Declared input shape differs: the handshake tells every rank the same thing.
        _check_failure(r["declared_shape"], rank, "stage 1", "input_args", "float32[2, 5]", "float32[2, 8]")
        assert r["declared_shape"][0] == "PipelineError"
        # Output shape changing after the first microbatch: the sender names it.
        if rank == 1:
            _check_failure(r["runtime_shape"], rank, "rank 1 failed at action 1F2", "(float32[2, 4]) but the pipeline agreed on (float32[2, 8])", ">>1F2<<")
        else:
            _check_failure(r["runtime_shape"], rank, f"rank {rank} failed at action")
        # An exception inside the stage: its traceback and the marked action.
        if rank == 1:
            _check_failure(r["stage_exception"], rank, "rank 1 failed at action 1F1", "boom from inside the stage",
                           "Traceback", ">>1F1<<")
        else:
            _check_failure(r["stage_exception"], rank, f"rank {rank} failed at action")
        assert r["recovered"][0] == "ok", r["recovered"]
        if rank != 1:  # rank 1 holds stages 1 and 4 in both layouts: it is told
            assert r["placement"][0] == "ScheduleError", r["placement"]
            _check_failure((("ValueError",) + r["placement"][1:]), rank,
                           f"places stages [{rank}, {2 * PP - 1 - rank}] on rank {rank}",
                           f"given stages [{rank}, {rank + PP}]")
        else:
            _check_failure(r["placement"], rank, "rank 1 failed at action", "(building the executor)",
                           "places stages [", "but this rank was given stages [")
            assert r["placement"][1].count("rank 0 failed") + r["placement"][1].count("rank 2 failed") == 1


def test_dead_peer_fails_survivors_in_bounded_time():
    results, codes, leftover = run_world(PP, _dying_world, timeout=120)
    assert not leftover, leftover
    assert codes[1] == 3 and 1 not in results
    for rank in (0, 2):
        assert "error" not in results[rank], results[rank].get("error")
        assert results[rank]["warmup"][0] == "ok", results[rank]["warmup"]
        _check_failure(results[rank]["died"], rank, f"zbpipe: rank {rank} failed at action", "rank 1")
        assert codes[rank] == 0
