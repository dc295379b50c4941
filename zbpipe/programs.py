"""Programs from the schedule core: schedule_names(), compile() and simulate() (costs as scalars
or per-stage lists), schedule_options(). The classes that run a program are in schedules.py."""

from __future__ import annotations

from collections.abc import Sequence

from . import _C, _door

Cost = float | Sequence[float]


def _given(name: str, value: Cost | None) -> list[float] | None:
    return None if value is None else _door.costs("compile", name, value)


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
    def optional_int(name, value):
        return None if value is None else _door.integer("compile", name, value, bits=32)

    return _C.compile(
        _door.text("compile", "schedule", schedule),
        _door.integer("compile", "pp", pp),
        _door.integer("compile", "microbatches", microbatches),
        0 if stages_per_rank is None else _door.integer("compile", "stages_per_rank", stages_per_rank),
        f=_given("f", f),
        b=_given("b", b),
        w=_given("w", w),
        b_full=_given("b_full", b_full),
        comm=None if comm is None else _door.number("compile", "comm", comm),
        memory_cap=optional_int("memory_cap", memory_cap),
        search_threads=optional_int("search_threads", search_threads),
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
    if not isinstance(program, _C.Program):
        raise _door.wrong_type("simulate", "program", "a zbpipe.Program", program)
    return _C.simulate(
        program,
        _door.costs("simulate", "f", f),
        _door.costs("simulate", "b", b),
        _door.costs("simulate", "w", w),
        [] if b_full is None else _door.costs("simulate", "b_full", b_full),
        _door.number("simulate", "comm", comm),
    )
