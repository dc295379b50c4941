"""`zbpipe plan`, `zbpipe simulate` and `zbpipe draw`: a schedule as a slot grid, under the
simulator's cost and memory model, or as a picture (subcommands of zbpipe/cli.py)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from . import _C
from .cli import CliError, Subcommand
from .programs import compile as compile_schedule
from .programs import schedule_names, schedule_options, simulate
from .timeline_text import slot_grid

COSTS_HELP = """costs: --f/--b/--w/--b-full are the forward, backward-input (I), backward-weight (W)
and full-backward (B, default b + w) times of one 1F1B stage, i.e. 1/pp of the model: a scalar
or one comma-separated value per 1F1B stage. A schedule with k stages per rank runs each slice
as k stages costing 1/k of it, so every schedule simulates the same model. A list of one value
per schedule stage is used as is; --raw-costs applies all values to each stage unchanged (as
zbpipe.simulate does). --comm is the latency of one cross-rank transfer.
"""
MEMORY_HELP = """memory: peak activations count (stage, microbatch) units, the simulator's; with k stages per
rank one unit is 1/k of a 1F1B stage's activations, shown as "1F1B-mb". --mem-f is the memory
one F holds (default 1) and --mem-w the part of it that waits from I to W (default all of it:
I frees nothing), per 1F1B stage and split over a schedule's stages as the costs are; peak
memory and --memory-cap are in --mem-f's units (at the defaults, 1F1B-mb; with --raw-costs,
per schedule stage as zbpipe.compile and zbpipe.simulate take them).
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _costs(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or comma-separated numbers, got '{text}'") from None
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"costs must be finite numbers, got '{text}'")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"costs must be non-negative, got '{text}'")
    return values


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'")
    return value


def _latency(text: str) -> float:
    if "," in text:
        raise argparse.ArgumentTypeError(f"expected one number, got '{text}'")
    return _costs(text)[0]


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, got '{text}'") from None
    if w < 100 or h < 100:
        raise argparse.ArgumentTypeError(f"size must be at least 100x100, got '{text}'")
    return w, h


def _schedule_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("schedule", nargs="?", metavar="SCHEDULE",
                   help="schedule name (see `zbpipe simulate --compare` for all), or "
                        "PyTorch's class name (ZBVZeroBubble, ScheduleInterleaved1F1B, ...)")
    p.add_argument("--pp", type=_positive_int, help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=_positive_int, help="microbatches per step")
    p.add_argument("--stages-per-rank", type=_positive_int, default=None,
                   help="stages per rank where the schedule takes it")


def _cost_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--f", type=_costs, default=[1.0], help="forward time (default 1)")
    p.add_argument("--b", type=_costs, default=[1.0], help="backward-input time (default 1)")
    p.add_argument("--w", type=_costs, default=[1.0], help="backward-weight time (default 1)")
    p.add_argument("--b-full", type=_costs, default=None, help="full backward time (default b+w)")
    p.add_argument("--comm", type=_latency, default=0.0, help="cross-rank latency (default 0)")
    p.add_argument("--raw-costs", action="store_true",
                   help="apply cost and memory values to each schedule stage unchanged")


def _memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mem-f", type=_costs, default=[1.0],
                   help="memory one forward holds until its backward (default 1)")
    p.add_argument("--mem-w", type=_costs, default=None,
                   help="the part of --mem-f held from I to W (default: all of it)")
    p.add_argument("--memory-cap", type=_positive_number, default=None,
                   help="memory per rank in --mem-f's units (schedules that take a cap; in "
                        "--compare, those that take this one)")


def _vocab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab-parallel", action="store_true",
                   help="split the LM head over every rank: each rank's S and T passes and their "
                        "collectives in the program (docs/vocab_parallel.md)")
    p.add_argument("--s", type=_costs, default=[1.0], help="with --vocab-parallel: S pass time per rank (default 1)")
    p.add_argument("--t", type=_costs, default=[1.0], help="with --vocab-parallel: T pass time per rank (default 1)")
    p.add_argument("--collective", type=_latency, default=0.0,
                   help="with --vocab-parallel: a collective's latency (default 0)")
    p.add_argument("--mem-s", type=_costs, default=None,
                   help="with --vocab-parallel: memory an S holds until its T, per rank (default 0)")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    _schedule_arguments(p)
    _memory_arguments(p)
    _vocab_arguments(p)
    p.add_argument("--from-trace", default=None, metavar="RANK0.json,RANK1.json,...",
                   help="plan from the per-stage costs (and memory deltas, bytes) measured in "
                        "saved Chrome traces (zbpipe.profile_from_trace); --memory-cap is then in bytes")


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    for group in (_schedule_arguments, _cost_arguments, _memory_arguments, _vocab_arguments):
        group(p)
    p.add_argument("--compare", action="store_true",
                   help="one table over every schedule that accepts (pp, microbatches)")


def add_draw_arguments(p: argparse.ArgumentParser) -> None:
    for group in (_schedule_arguments, _cost_arguments, _memory_arguments, _vocab_arguments):
        group(p)
    p.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf)")
    p.add_argument("--trace", help="draw a runtime Chrome-trace JSON instead of a schedule")
    p.add_argument("--trace-tid", type=int, default=None,
                   help="with --trace: the tid lane to draw where ranks have several "
                        "(zbpipe's runtime: 0 host, the default; 1 device)")
    p.add_argument("--size", type=_size, default=None, help="WIDTHxHEIGHT in pixels")


def _check_schedule(args) -> None:
    if args.schedule is None:
        raise CliError("a SCHEDULE is required")
    names = schedule_names()
    if args.schedule not in names:
        # PyTorch's names, as zbpipe.get_schedule_class takes them ("ZBVZeroBubble", ...).
        from .schedules import get_schedule_class

        valid = f"valid: {', '.join(names)}, or PyTorch's class names such as ZBVZeroBubble"
        try:
            cls = get_schedule_class(args.schedule)
        except ValueError:
            raise CliError(f"unknown schedule '{args.schedule}' ({valid})") from None
        if not cls.schedule:
            raise CliError(f"'{args.schedule}' is a base class, not a schedule ({valid})")
        args.schedule = cls.schedule
    for opt in ("pp", "microbatches"):
        if getattr(args, opt) is None:
            raise CliError(f"--{opt} is required")


def _stage_costs(values: list[float] | None, num_stages: int, pp: int, raw: bool, name: str):
    """Per-stage costs for a program of `num_stages` from CLI values given per 1F1B stage
    (see COSTS_HELP)."""
    if values is None:
        return None
    k = num_stages // pp
    if raw or (len(values) == num_stages and k > 1):
        return values
    if len(values) == 1:
        return [values[0] / k]
    if len(values) != pp:
        raise CliError(f"--{name} needs 1 value or one per 1F1B stage ({pp}), got {len(values)}")
    return [values[s // k] / k for s in range(num_stages)]


def _stage_count(name: str, args) -> int:
    """Stages of the program the request builds. The core has no topology query without a
    builder run; a one-microbatch build is the cheapest one (the topology does not depend on
    the microbatch count)."""
    return _C.build(name, args.pp, 1, args.stages_per_rank or 0).num_stages


def _per_stage(args, names: tuple[str, ...], num_stages: int) -> dict:
    """The request's values of `names` per schedule stage (see COSTS_HELP); `plan` has unit
    costs and no --raw-costs."""
    raw = getattr(args, "raw_costs", False)
    return {n: _stage_costs(getattr(args, n, None), num_stages, args.pp, raw, n.replace("_", "-"))
            for n in names}


def _sim_costs(num_stages: int, args) -> dict:
    return {**_per_stage(args, ("f", "b", "w", "b_full"), num_stages), "comm": args.comm}


def _compile(name: str, args, memory_cap: float | None) -> _C.Program:
    """Compiles `name` for the CLI request. A cost-driven schedule (one that takes costs, see
    zbpipe.schedule_options) is built under the costs (simulate, draw; plan: unit costs) and
    the memory model it will be simulated with, split over its stages; b_full is the
    simulator's alone (no builder runs a B)."""
    kw = {} if memory_cap is None else {"memory_cap": memory_cap}
    if getattr(args, "vocab_parallel", False):  # placed under the costs it is simulated with
        costs = _sim_costs(_stage_count(name, args), args) if hasattr(args, "f") else {}
        kw.update(vocab_parallel=True, s=args.s, t=args.t, collective=args.collective,
                  **{n: costs[n] for n in ("f", "b", "w", "comm") if n in costs})
    if "f" in schedule_options(name):
        stages = _stage_count(name, args)
        kw.update(_per_stage(args, ("mem_f", "mem_w"), stages))
        if hasattr(args, "f"):
            costs = _sim_costs(stages, args)
            kw.update({n: costs[n] for n in ("f", "b", "w", "comm")})
    return compile_schedule(name, args.pp, args.microbatches, args.stages_per_rank, **kw)


def _simulated(prog: _C.Program, args) -> tuple[dict, _C.SimResult]:
    """The request's costs for `prog` (unit costs for `plan`) and the simulator's result under
    them and its memory model."""
    costs = _sim_costs(prog.num_stages, args) if hasattr(args, "f") else \
        dict(f=[1.0], b=[1.0], w=[1.0], b_full=None, comm=0.0)
    memory = _per_stage(args, ("mem_f", "mem_w"), prog.num_stages)
    if getattr(args, "vocab_parallel", False):
        memory.update(s=args.s, t=args.t, collective=args.collective, mem_s=args.mem_s)
    res = simulate(prog, costs["f"], costs["b"], costs["w"], costs["comm"], b_full=costs["b_full"],
                   **memory)
    return costs, res


def _compile_in_compare(name: str, args) -> tuple[_C.Program, bool]:
    """--compare: --memory-cap goes to every schedule that takes a cap; one that refuses this
    one (a V cap below one microbatch of a rank's stages) runs at its own. Returns (program,
    whether it took the cap)."""
    if args.memory_cap and "memory_cap" in schedule_options(name):
        try:
            return _compile(name, args, args.memory_cap), True
        except _C.ScheduleError:
            pass
    return _compile(name, args, None), False


def _memory_line(prog: _C.Program, res: _C.SimResult) -> str:
    k = prog.num_stages // prog.pp
    units = list(res.peak_activations)
    line = f"peak activations per rank: {units} (stage, microbatch) units"
    if k > 1:
        line += f" = {[round(u / k, 2) for u in units]} 1F1B-mb"
    return line + f"\npeak memory per rank: {[round(v, 4) for v in res.peak_memory]} (--mem-f's units)"


def _header(prog: _C.Program) -> str:
    k = prog.num_stages // prog.pp
    topo = "v" if k == 2 and prog.stage_to_rank[-1] == 0 and prog.pp > 1 else "loop"
    return (f"{prog.schedule}: pp={prog.pp}, stages={prog.num_stages} ({k} per rank, {topo}), "
            f"microbatches={prog.microbatches}")


def _plan_from_trace(args, out) -> int:
    """plan --from-trace: compile under the traced costs and deltas, report the simulated step."""
    from .tuning.stage_costs import compile_costs, profile_from_trace

    try:
        profile = profile_from_trace(args.from_trace)
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"--from-trace: {e}") from None
    num_stages = _stage_count(args.schedule, args)
    try:
        model = compile_costs(profile, num_stages)
    except ValueError as e:
        raise CliError(f"--from-trace: {e}") from None
    kw = dict(model) if "f" in schedule_options(args.schedule) else {}
    if args.memory_cap is not None:
        kw["memory_cap"] = args.memory_cap
    prog = compile_schedule(args.schedule, args.pp, args.microbatches, args.stages_per_rank, **kw)
    res = simulate(prog, model["f"], model["b"], model["w"], 0.0,
                   mem_f=model.get("mem_f", 1.0), mem_w=model.get("mem_w"))
    print(_header(prog), file=out)
    for s in range(num_stages):
        print(f"stage {s}: F {model['f'][s] * 1e3:.3f} ms, I {model['b'][s] * 1e3:.3f} ms, "
              f"W {model['w'][s] * 1e3:.3f} ms" + (f", mem_f {model['mem_f'][s]:.0f} B, mem_w "
                                                  f"{model['mem_w'][s]:.0f} B" if "mem_f" in model else ""), file=out)
    print(f"simulated step: {res.makespan * 1e3:.3f} ms; bubble rate: {res.bubble_rate:.4f}", file=out)
    unit = "bytes" if "mem_f" in model else "(stage, microbatch) units"
    print(f"peak memory per rank: {[round(p) for p in res.peak_memory]} {unit}", file=out)
    return 0


def run_plan(args, out=None) -> int:
    out = out or sys.stdout
    _check_schedule(args)
    if args.from_trace:
        return _plan_from_trace(args, out)
    prog = _compile(args.schedule, args, args.memory_cap)
    _, res = _simulated(prog, args)
    print(_header(prog), file=out)
    k = prog.num_stages // prog.pp
    labels = {1: "", 2: "; lowercase = a rank's second stage"}.get(k, "; labels are stage+kind+mb")
    print(f"unit costs (F = I = W = 1 slot, B = 2), no comm latency{labels}", file=out)
    print(slot_grid(prog, res), file=out)
    print(f"makespan: {res.makespan:g} slots; bubble rate: {res.bubble_rate:.4f} "
          f"(span-based); idle rate: {res.idle_rate:.4f}", file=out)
    print(_memory_line(prog, res), file=out)
    return 0


def run_simulate(args, out=None) -> int:
    out = out or sys.stdout
    if args.compare:
        return _compare(args, out)
    _check_schedule(args)
    prog = _compile(args.schedule, args, args.memory_cap)
    costs, res = _simulated(prog, args)
    print(_header(prog), file=out)
    print(f"costs per stage: f={costs['f']} b={costs['b']} w={costs['w']}"
          + (f" b_full={costs['b_full']}" if costs["b_full"] else "") + f" comm={args.comm:g}",
          file=out)
    print(f"makespan: {res.makespan:.4f}", file=out)
    print(f"bubble rate: {res.bubble_rate:.4f} (span-based, the Zero Bubble paper's)", file=out)
    print(f"idle rate: {res.idle_rate:.4f} (1 - busy / (pp * makespan))", file=out)
    print(f"busy per rank: {[round(b, 4) for b in res.busy]}", file=out)
    print(_memory_line(prog, res), file=out)
    return 0


def _compare(args, out) -> int:
    for opt in ("pp", "microbatches"):
        if getattr(args, opt) is None:
            raise CliError(f"--{opt} is required")
    if args.schedule is not None:
        raise CliError("--compare runs every schedule; give no SCHEDULE")
    rows, skipped, capped = [], [], []
    for name in schedule_names():
        try:
            prog, took_cap = _compile_in_compare(name, args)
            _, res = _simulated(prog, args)
        except ValueError as exc:
            skipped.append(f"{name} ({str(exc).splitlines()[0]})")
            continue
        if took_cap:
            capped.append(name)
        k = prog.num_stages // prog.pp
        rows.append((name, k, res.makespan, res.bubble_rate, res.idle_rate,
                     max(res.peak_activations), max(res.peak_memory)))
    cap = f", memory_cap={args.memory_cap:g} for {'/'.join(capped) or 'no schedule'}" if args.memory_cap else ""
    mem_w = "" if args.mem_w is None else f" mem_w={args.mem_w}"
    print(f"pp={args.pp}, microbatches={args.microbatches}, f={args.f} b={args.b} w={args.w} "
          f"comm={args.comm:g} mem_f={args.mem_f}{mem_w}{cap}", file=out)
    print(f"{'schedule':<18}{'stages/rank':>12}{'makespan':>11}{'bubble':>9}{'idle':>9}"
          f"{'peak units':>12}{'peak memory':>13}", file=out)
    for name, k, ms, br, ir, peak, mem in rows:
        print(f"{name:<18}{k:>12}{ms:>11.3f}{br:>9.4f}{ir:>9.4f}{peak:>12}{mem:>13.2f}", file=out)
    for line in skipped:
        print(f"skipped: {line}", file=out)
    return 0


def run_draw(args, out=None) -> int:
    out = out or sys.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("draw needs matplotlib (pip install matplotlib)") from None
    from . import plot

    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise CliError(f"cannot write '{args.output}': no directory '{folder}'")
    if args.trace:
        if args.schedule is not None:
            raise CliError("give either SCHEDULE or --trace, not both")
        try:
            boxes = plot.load_trace(args.trace, args.trace_tid)
        except OSError as exc:
            raise CliError(f"cannot read trace '{args.trace}': {exc.strerror}") from None
        except ValueError as exc:
            raise CliError(str(exc)) from None
        pp = max(b.rank for b in boxes) + 1
        size = args.size or (1600, 120 + 60 * pp)
        try:
            plot.draw(boxes, [], pp, args.output, size=size, title=f"trace {args.trace}",
                      time_unit="ms")
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot write '{args.output}': {getattr(exc, 'strerror', None) or exc}") from None
    else:
        _check_schedule(args)
        prog = _compile(args.schedule, args, args.memory_cap)
        _, res = _simulated(prog, args)
        print(_memory_line(prog, res), file=out)
        boxes, arrows = plot.program_boxes(prog, res, args.comm)
        size = args.size or (1600, 120 + 60 * prog.pp)
        title = (f"{_header(prog)}; bubble {res.bubble_rate:.3f}, "
                 f"peak {max(res.peak_activations)} units, memory {max(res.peak_memory):g}")
        try:
            plot.draw(boxes, arrows, prog.pp, args.output, size=size, title=title)
        except (OSError, ValueError) as exc:  # unwritable file, unknown image format
            raise CliError(f"cannot write '{args.output}': {getattr(exc, 'strerror', None) or exc}") from None
    print(f"wrote {args.output}", file=out)
    return 0


_ERRORS = (_C.ScheduleError,)  # a schedule that cannot be built for the request: a user error
COMMANDS = {
    "plan": Subcommand(add_plan_arguments, run_plan, "print the per-rank program as a slot grid at unit costs",
                       description="The schedule as a grid: ranks as rows, one column per time slot "
                                   "at unit costs (F = I = W = 1, B = 2), then its bubble rate and "
                                   "peak memory per rank.", epilog=MEMORY_HELP, handles=_ERRORS),
    "simulate": Subcommand(add_simulate_arguments, run_simulate, "the simulator's numbers under a cost model",
                           epilog=COSTS_HELP + MEMORY_HELP, handles=_ERRORS),
    "draw": Subcommand(add_draw_arguments, run_draw, "a timeline picture (needs matplotlib)",
                       epilog=COSTS_HELP + MEMORY_HELP, handles=_ERRORS),
}
