"""Programs from the schedule core: schedule_names(), compile() and simulate() (costs as scalars
or per-stage lists), schedule_options(). The classes that run a program are in schedules.py."""

from __future__ import annotations

from collections.abc import Sequence

from . import _C, _door

Cost = float | Sequence[float]


def _given(name: str, value: Cost | None) -> list[float] | None:
    return None if value is None else _door.costs("compile", name, value)


def _costs(function: str, name: str, value: Cost | None) -> list[float]:
    """A cost argument where None means "not given": the empty list the core reads so."""
    return [] if value is None else _door.costs(function, name, value)


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
    exhaustive_search: bool = False,
    search_threads: int | None = None,
    refine: bool | None = None,
    vocab_parallel: bool = False,
    s: Cost | None = None,
    t: Cost | None = None,
    collective: float | None = None,
    mem_s: Cost | None = None,
    backlog: int | None = None,
    lookahead: int | None = None,
) -> _C.Program:
    """Builds, lowers (SEND/RECV) and validates a schedule; raises ScheduleError on bad input.

    The costs (f, b, w, comm; unit costs when not given), the memory model (``mem_f`` held from
    an F's start, of which ``mem_w`` waits from I to W; see ``simulate``) and ``memory_cap``
    (memory per rank in mem_f's units: microbatches at the default mem_f=1; ``float('inf')``
    or any cap above what a rank could hold is no cap) steer the cost-driven schedules
    (``schedule_options(name)``: zb_auto, v_half, v_min). Any of them
    given to a schedule that does not use it raises ScheduleError naming the schedules that do;
    to time a program under costs and memory, pass them to ``simulate``. No schedule builds with
    ``b_full``. ``search_threads`` (the same three only) sets how many threads share their
    search grid (default: one per CPU this process may run on, at most 8); the program is the
    same for every value. ``exhaustive_search=True`` (the same three) runs every point of that
    grid to the end and scores it with ``simulate``: the reference the search is checked
    against, slower, the same program. ``refine`` (the same three, default True) runs the
    refinement pass (see ``refine``; zb_auto times 300k actions, v_half and v_min 1M) on the
    search's pick, never worse on makespan or bubble; ``refine=False`` gives the heuristics'
    pick alone, the figures the Zero Bubble paper publishes (zb_auto) and the V paper's
    reference implementation's (v_half, v_min).

    ``vocab_parallel=True`` adds vocabulary parallelism (docs/vocab_parallel.md): every rank
    gets the S and T passes of its shard of the LM head for every microbatch (``1S0``,
    ``1T0``) and the collectives between them (``BCAST_F``, ``ALLREDUCE_S``, ``REDUCE_B``),
    placed by a timed run of the program under the stage costs (``f``, ``b``, ``w``, ``b_full``,
    ``comm``: every schedule takes them then) and the head's: ``s`` and ``t`` (per rank or one value),
    ``collective`` (a collective's latency), ``mem_s`` (what an S holds until its T) and
    ``backlog`` (the most microbatches a rank holds between S and T, default 2) and
    ``lookahead`` (the forwards a rank may run ahead of the schedule's order where it would
    wait for the head, default 2; 0 keeps the order). Any of these without ``vocab_parallel``
    raises ScheduleError.
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
        mem_f=_given("mem_f", mem_f),
        mem_w=_given("mem_w", mem_w),
        memory_cap=None if memory_cap is None else _door.number("compile", "memory_cap", memory_cap),
        exhaustive_search=exhaustive_search,
        search_threads=optional_int("search_threads", search_threads),
        refine=refine,
        vocab_parallel=bool(vocab_parallel),
        s=_given("s", s),
        t=_given("t", t),
        collective=None if collective is None else _door.number("compile", "collective", collective),
        mem_s=_given("mem_s", mem_s),
        backlog=optional_int("backlog", backlog),
        lookahead=optional_int("lookahead", lookahead),
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
    s: Cost = 1.0,
    t: Cost = 1.0,
    collective: float = 0.0,
    mem_s: Cost | None = None,
) -> _C.SimResult:
    """Simulates `program`: f forward, b backward-input, w backward-weight (per stage or one
    value); a full backward B costs b + w unless b_full is given; comm is the cross-rank latency.

    Memory (``SimResult.peak_memory``, per rank, in mem_f's units): an F adds ``mem_f`` when it
    starts, a full B frees it when it ends, I frees ``mem_f - mem_w`` and W frees ``mem_w`` when
    they end (per stage or one value; ``mem_w=None`` means mem_w = mem_f: I frees nothing).
    ``peak_activations`` counts microbatches live from F to their last backward, whatever the
    model.

    A vocabulary-parallel program (``compile(..., vocab_parallel=True)``) has its S and T
    passes cost ``s`` and ``t`` (per rank or one value), each collective completes
    ``collective`` after its last rank posted it (``SimResult.collectives``: one event per
    rank's post, until the completion), a REDUCE_B waits for its ALLREDUCE_S, and an S holds
    ``mem_s`` (per rank, in mem_f's units) until its T ends."""
    if not isinstance(program, _C.Program):
        raise _door.wrong_type("simulate", "program", "a zbpipe.Program", program)
    return _C.simulate(
        program,
        _door.costs("simulate", "f", f),
        _door.costs("simulate", "b", b),
        _door.costs("simulate", "w", w),
        _costs("simulate", "b_full", b_full),
        _door.number("simulate", "comm", comm),
        _door.costs("simulate", "mem_f", mem_f),
        _costs("simulate", "mem_w", mem_w),
        _door.costs("simulate", "s", s),
        _door.costs("simulate", "t", t),
        _door.number("simulate", "collective", collective),
        _costs("simulate", "mem_s", mem_s),
    )


def _model(function, f, b, w, comm, mem_f, mem_w, memory_cap) -> tuple:
    """The cost, memory and cap arguments of _C.refine / _C.span_lower_bound, in their order."""
    return (_door.costs(function, "f", f), _door.costs(function, "b", b), _door.costs(function, "w", w),
            _door.number(function, "comm", comm), _door.costs(function, "mem_f", mem_f),
            _costs(function, "mem_w", mem_w), _costs(function, "memory_cap", memory_cap))


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
    if not isinstance(program, _C.Program):
        raise _door.wrong_type("refine", "program", "a zbpipe.Program", program)
    model = _model("refine", f, b, w, comm, mem_f, mem_w, memory_cap)
    return _C.refine(program, *model, _door.text("refine", "objective", objective),
                     _door.integer("refine", "budget", budget))


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
    if not isinstance(program, _C.Program):
        raise _door.wrong_type("lower_bound", "program", "a zbpipe.Program", program)
    return _C.span_lower_bound(program, *_model("lower_bound", f, b, w, comm, mem_f, mem_w, memory_cap))
