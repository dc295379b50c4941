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
    mem_f: Cost | None = None,
    mem_w: Cost | None = None,
    memory_cap: float | None = None,
    search_threads: int | None = None,
    refine: bool | None = None,
) -> _C.Program:
    """Builds, lowers (SEND/RECV) and validates a schedule; raises ScheduleError on bad input.

    The costs (f, b, w, comm; unit costs when not given), the memory model (``mem_f`` held from
    an F's start, of which ``mem_w`` waits from I to W; see ``simulate``) and ``memory_cap``
    (memory per rank in mem_f's units: microbatches at the default mem_f=1) steer the
    cost-driven schedules (``schedule_options(name)``: zb_auto, v_half, v_min). Any of them
    given to a schedule that does not use it raises ScheduleError naming the schedules that do;
    to time a program under costs and memory, pass them to ``simulate``. No schedule builds with
    ``b_full``. ``search_threads`` (the same three only) sets how many threads share their
    search grid (default: one per CPU this process may run on, at most 8); the program is the
    same for every value. ``refine`` (zb_auto only, default True) runs the refinement pass
    (see ``refine``) on the search's pick; ``refine=False`` gives the heuristics' pick alone,
    the figures the Zero Bubble paper publishes.
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
        mem_f=_given_list("mem_f", mem_f),
        mem_w=_given_list("mem_w", mem_w),
        memory_cap=None if memory_cap is None else float(memory_cap),
        search_threads=search_threads,
        refine=refine,
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
    mem_f: Cost = 1.0,
    mem_w: Cost | None = None,
) -> _C.SimResult:
    """Simulates `program`: f forward, b backward-input, w backward-weight (per stage or one
    value); a full backward B costs b + w unless b_full is given; comm is the cross-rank latency.

    Memory (``SimResult.peak_memory``, per rank, in mem_f's units): an F adds ``mem_f`` when it
    starts, a full B frees it when it ends, I frees ``mem_f - mem_w`` and W frees ``mem_w`` when
    they end (per stage or one value; ``mem_w=None`` means mem_w = mem_f: I frees nothing).
    ``peak_activations`` counts microbatches live from F to their last backward, whatever the
    model."""
    return _C.simulate(
        program,
        _as_list("f", f),
        _as_list("b", b),
        _as_list("w", w),
        _as_list("b_full", b_full),
        float(comm),
        _as_list("mem_f", mem_f),
        _as_list("mem_w", mem_w),
    )


def _model(f, b, w, comm, mem_f, mem_w, memory_cap) -> tuple:
    """The cost, memory and cap arguments of _C.refine / _C.span_lower_bound, in their order."""
    caps = [] if memory_cap is None else _as_list("memory_cap", memory_cap)
    return (_as_list("f", f), _as_list("b", b), _as_list("w", w), float(comm),
            _as_list("mem_f", mem_f), _as_list("mem_w", mem_w), caps)


def refine(
    program: _C.Program,
    f: Cost = 1.0,
    b: Cost = 1.0,
    w: Cost = 1.0,
    comm: float = 0.0,
    *,
    mem_f: Cost = 1.0,
    mem_w: Cost | None = None,
    memory_cap: Cost | None = None,
    objective: str = "span",
    budget: int = 3_000_000,
) -> _C.Program:
    """The refinement pass on any program: a local search over each rank's order, timed by the
    simulator, that keeps a move only when the program stays valid and within ``memory_cap``
    (per rank or one value, in mem_f's units; default: the program's own peak memory) and its
    longest span (``objective="span"``, the bubble rate) or makespan drops without the other
    one rising. Stops at a local optimum, at the lower bound, or after timing ``budget``
    actions. Returns the lowered program; costs and memory as in ``simulate``."""
    model = _model(f, b, w, comm, mem_f, mem_w, memory_cap)
    return _C.refine(program, *model, objective, int(budget))


def lower_bound(
    program: _C.Program,
    f: Cost = 1.0,
    b: Cost = 1.0,
    w: Cost = 1.0,
    comm: float = 0.0,
    *,
    mem_f: Cost = 1.0,
    mem_w: Cost | None = None,
    memory_cap: Cost | None = None,
) -> _C.SpanBound:
    """Lower bounds of every rank's span, and of the bubble rate, over all valid programs with
    ``program``'s topology and microbatch count under these costs and this memory cap (per rank
    or one value, in mem_f's units; default: the program's own peak memory): no order does
    better (see csrc/include/zbpipe/span_bound.h for the arguments)."""
    return _C.span_lower_bound(program, *_model(f, b, w, comm, mem_f, mem_w, memory_cap))
