"""Runs a schedule's real step on every rank of an in-process loopback world (zbpipe._C.
_LoopbackWorld, one thread per rank) with NCCL's posting discipline (stream_ordered=True),
and returns what each rank posted and waited for, for helpers/nccl_model.py.

Boundaries: "one" sends one float tensor per message; "multi" three tensors of different
sizes, one of them integer (so gradient messages carry two).
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

import zbpipe
from zbpipe import _C

from .asserts import assert_grads_close

WIDTH = 4


class One(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        return x * self.w


class Multi(nn.Module):
    """(a, b, n) -> (a * w + b[:, :4], b * v, n + 1): [2, 4] and [2, 8] floats, an int64 [2]."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH))
        self.v = nn.Parameter(torch.randn(2 * WIDTH))

    def forward(self, a, b=None, n=None):
        if b is None:
            b, n = torch.cat([a, a], dim=1), torch.zeros(a.size(0), dtype=torch.long)
        return a * self.w + b[:, :WIDTH], b * self.v, n + 1


def _multi_loss(out, y):
    return F.mse_loss(out[0], y) + out[1].pow(2).mean()


def run_threads(world, fn, *, timeout: float) -> dict[int, object]:
    """fn(rank) on one thread per rank of `world`; rank -> its result or the exception it raised
    (a rank still running after `timeout` is reported as TimeoutError; its thread is a daemon)."""
    results: dict[int, object] = {}

    def main(r: int) -> None:
        try:
            results[r] = fn(r)
        except Exception as e:  # noqa: BLE001 - the caller looks at it
            results[r] = e

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    for r, t in enumerate(threads):
        if t.is_alive():
            results[r] = TimeoutError(f"rank {r} still running after {timeout} s")
    return results


def record(name: str, pp: int, microbatches: int, boundary: str = "one", *, program=None,
           timeout: float = 30.0, stream_ordered: bool = True, exact: bool = False,
           **schedule_kwargs) -> dict[int, list]:
    """One training step (forward only for `inference`) of schedule `name`, or of `program`
    (a lowered zbpipe.Program); returns rank -> recorded events. `exact`: also checks the
    loss and every gradient against the same step in one process (AssertionError)."""
    prog = program if program is not None else zbpipe.compile(name, pp, microbatches)
    ns = prog.num_stages
    torch.manual_seed(0)
    mods = [(One if boundary == "one" else Multi)() for _ in range(ns)]
    loss_fn = None if name == "inference" else (F.mse_loss if boundary == "one" else _multi_loss)
    world = _C._LoopbackWorld(pp)
    x, y = torch.randn(2 * microbatches, WIDTH), torch.randn(2 * microbatches, WIDTH)

    def rank_main(r: int) -> None:
        mine = [s for s in range(ns) if prog.stage_to_rank[s] == r]
        stages = [zbpipe.PipelineStage(mods[s], s, ns, "cpu", group=world.group(r)) for s in mine]
        stages = stages if len(stages) > 1 else stages[0]
        kwargs = dict(loss_fn=loss_fn, stream_ordered=stream_ordered, timeout=timeout, **schedule_kwargs)
        if program is not None:
            sched = zbpipe.PipelineSchedule.from_program(stages, program, **kwargs)
        else:
            sched = zbpipe.get_schedule_class(name)(stages, microbatches, **kwargs)
        sched.step(*((x,) if 0 in mine else ()), target=y if ns - 1 in mine and loss_fn else None)

    ref = copy.deepcopy(mods) if exact else None

    outcome = run_threads(world, rank_main, timeout=timeout + 30)
    failed = {r: f"{type(e).__name__}: {e}" for r, e in outcome.items() if isinstance(e, BaseException)}
    if failed:
        raise RuntimeError(f"{prog.schedule} pp={pp} m={microbatches} {boundary}: {failed}")
    if exact:
        out = x
        for i, mod in enumerate(ref):
            out = mod(*out) if isinstance(out, tuple) else mod(out)
        loss_fn(out, y).backward()
        assert_grads_close(mods, ref, msg=f"{prog.schedule} pp={pp} m={microbatches} {boundary}:")
    return {r: world.events(r) for r in range(pp)}


def rank_schedule(world, rank, module, microbatches, schedule=zbpipe.Schedule1F1B, stage_kwargs=None, **kwargs):
    """`rank`'s schedule on `world` for a pipeline of one stage per rank (stage index = rank)
    running `module` (PipelineStage(**stage_kwargs)), with an MSE loss, NCCL's posting
    discipline (stream_ordered) and a 30 s timeout unless given."""
    stage = zbpipe.PipelineStage(module, rank, world.size, "cpu", group=world.group(rank), **(stage_kwargs or {}))
    kwargs.setdefault("timeout", 30.0)
    kwargs.setdefault("stream_ordered", True)
    return schedule(stage, microbatches, loss_fn=F.mse_loss, **kwargs)


def rank_step(sched, world, rank, x, y, **kwargs):
    """sched.step with `x` on the first stage's rank and `y` on the last's (one stage per rank)."""
    return sched.step(*((x,) if rank == 0 else ()), target=y if rank == world.size - 1 else None, **kwargs)


def training_executor(sched):
    """The C++ executor of `sched`'s training program (built at its first use): the white-box
    tests read its handshakes, signatures and run_part."""
    return sched._runner.executor(True)
