"""Programs from the schedule core: schedule_names(), compile() and simulate() (costs as scalars
or per-stage lists), schedule_options(). The classes that run a program are in schedules.py."""

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


def _given_list(name: str, value: Cost | None) -> list[float] | None:
    return None if value is None else _as_list(name, value)


def schedule_names() -> list[str]:
    """Every schedule the core can build, in a stable order."""
    return _C.schedule_names()


def compile(
    schedule: str,
    pp: int,
    microbatches: int,
    stages_per_rank: int | None = None,
    *,
    f: Cost | None = None,
    b: Cost | None = None,
    w: Cost | None = None,
    b_full: Cost | None = None,
    comm: float | None = None,
    memory_cap: int | None = None,
    search_threads: int | None = None,
) -> _C.Program:
    """Builds, lowers (SEND/RECV) and validates a schedule; raises ScheduleError on bad input.

    The costs (f, b, w, comm; unit costs when not given) and ``memory_cap`` (per-rank
    activation cap in microbatches) steer the cost-driven schedules (``schedule_options(name)``:
    zb_auto, v_half, v_min). Any of them given to a schedule that does not use it raises
    ScheduleError naming the schedules that do; to time a program under costs, pass them to
    ``simulate``. No schedule builds with ``b_full``. ``search_threads`` (the same three only)
    sets how many threads share their search grid (default: one per CPU this process may run
    on, at most 8); the program is the same for every value.
    """
    return _C.compile(
        schedule,
        pp,
        microbatches,
        stages_per_rank or 0,
        f=_given_list("f", f),
        b=_given_list("b", b),
        w=_given_list("w", w),
        b_full=_given_list("b_full", b_full),
        comm=None if comm is None else float(comm),
        memory_cap=memory_cap,
        search_threads=search_threads,
    )


def schedule_options(schedule: str) -> list[str]:
    """The compile() options (cost fields, memory_cap) that `schedule` uses; others raise."""
    return _C.schedule_options(schedule)


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
