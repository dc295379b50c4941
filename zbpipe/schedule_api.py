"""Python face of the schedule core: compile() and simulate() with scalar-or-list costs."""

from __future__ import annotations

from collections.abc import Sequence

from . import _C

Cost = float | Sequence[float]


def _as_list(name: str, value: Cost | None) -> list[float]:
    if value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    values = [float(v) for v in value]
    if not values:
        raise _C.ScheduleError(f"cost '{name}' needs at least one value")
    return values


def schedule_names() -> list[str]:
    """Every schedule the core can build, in a stable order."""
    return _C.schedule_names()


def compile(
    schedule: str,
    pp: int,
    microbatches: int,
    stages_per_rank: int | None = None,
    *,
    f: Cost = 1.0,
    b: Cost = 1.0,
    w: Cost = 1.0,
    b_full: Cost | None = None,
    comm: float = 0.0,
    memory_cap: int | None = None,
) -> _C.Program:
    """Builds, lowers (SEND/RECV) and validates a schedule; raises ScheduleError on bad input.

    The costs only matter to cost-driven schedules (``zb_auto``); ``memory_cap`` is the
    per-rank activation cap in microbatches where a schedule takes one.
    """
    return _C.compile(
        schedule,
        pp,
        microbatches,
        stages_per_rank or 0,
        _as_list("f", f),
        _as_list("b", b),
        _as_list("w", w),
        _as_list("b_full", b_full),
        float(comm),
        memory_cap or 0,
    )


def simulate(
    program: _C.Program,
    f: Cost = 1.0,
    b: Cost = 1.0,
    w: Cost = 1.0,
    comm: float = 0.0,
    *,
    b_full: Cost | None = None,
) -> _C.SimResult:
    """Simulates `program`: f forward, b backward-input, w backward-weight (per stage or one
    value); a full backward B costs b + w unless b_full is given; comm is the cross-rank latency."""
    return _C.simulate(
        program,
        _as_list("f", f),
        _as_list("b", b),
        _as_list("w", w),
        _as_list("b_full", b_full),
        float(comm),
    )
