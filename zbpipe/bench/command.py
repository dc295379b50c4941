"""`zbpipe bench`: its options and what runs them (add_arguments, run_command: a subcommand of
zbpipe/cli.py), `run(...)` (the rows, for Python callers) and `main(argv)` (`python -m zbpipe.bench`).

    zbpipe bench --pp 8 --microbatches 16 --f 2 --i 2 --w 2          # every training schedule, vs torch
    zbpipe bench --pp 4 --schedules 1f1b,zbv --lib zbpipe --json out.json --draw zbv.png
    torchrun --nproc-per-node 4 -m zbpipe.bench --pp 4 --device cuda   # torchrun's world
"""

from __future__ import annotations

import argparse
import sys

from .. import _C
from ..cli import Subcommand
from ..cli import main_of as cli_main_of
from .config import AC_MODES, DEVICES, LIBRARIES, MODELS, BenchConfig, BenchError
from .. import torchrun
from .launch import launch


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or comma-separated numbers, got '{text}'") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None


def _bytes(text: str) -> int:
    """'262144', '256K', '1M' (binary units)."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (like 262144, 256K, 1M), got '{text}'") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `zbpipe bench`."""
    d = BenchConfig()
    p.add_argument("--pp", type=_int, default=None,
                   help=f"pipeline ranks (processes); default {d.pp}, or WORLD_SIZE under torchrun")
    p.add_argument("--microbatches", "-m", type=_int, default=d.microbatches)
    p.add_argument("--schedules", default=None,
                   help="comma list (default: every training schedule); 'auto' is zbpipe.ScheduleAuto")
    for kind, what in (("f", "forward"), ("i", "backward-input"), ("w", "backward-weight")):
        p.add_argument(f"--{kind}", type=_floats, default=[2.0],
                       help=f"{what} ms of one 1F1B stage: one value or one per stage (default 2)")
    p.add_argument("--act", type=_bytes, default=d.act, help="bytes of one microbatch's activation (default 256K)")
    p.add_argument("--model", default=d.model, help=f"one of {', '.join(MODELS)}")
    p.add_argument("--lib", default=",".join(LIBRARIES), help="comma list of zbpipe, torch (alternating step by step)")
    p.add_argument("--reps", type=_int, default=d.reps, help="timed steps per run (medians)")
    p.add_argument("--warmup", type=_int, default=d.warmup)
    p.add_argument("--device", default=d.device, help=f"one of {', '.join(DEVICES)} (cuda: NCCL)")
    p.add_argument("--ac", default=d.ac, help=f"checkpoint every emulated block: {', '.join(AC_MODES)}")
    p.add_argument("--budget", type=float, default=None, help="ScheduleAuto's activation budget, bytes per rank")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds the whole run may take")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    p.add_argument("--draw", default=None, metavar="PATH",
                   help="PNG of one step's realized timeline above its simulation (PATH_SCHEDULE.png for several)")


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    d = BenchConfig()
    try:
        env = torchrun.torchrun_env()
    except ValueError as e:
        raise BenchError(str(e)) from None
    pp = ns.pp if ns.pp is not None else (env.world_size if env is not None else d.pp)
    return BenchConfig(pp=pp, microbatches=ns.microbatches,
                       schedules=ns.schedules.split(",") if ns.schedules else d.schedules,
                       f=ns.f, i=ns.i, w=ns.w, act=ns.act, model=ns.model,
                       libs=[v for v in ns.lib.split(",") if v], reps=ns.reps, warmup=ns.warmup,
                       device=ns.device, ac=ns.ac, budget=ns.budget, timeout_s=ns.timeout).check()


def check_optional(ns: argparse.Namespace) -> None:
    """BenchError, before any process starts, for an option whose optional dependency is
    missing (--draw: matplotlib), rather than a traceback after the whole run."""
    if ns.draw:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError("--draw needs matplotlib (pip install matplotlib); nothing was run") from None


def measure(cfg: BenchConfig) -> dict | None:
    """Checks `cfg` (BenchError before any process starts), runs it, and returns {"hop",
    "rows", "gathered"} (None on torchrun's ranks other than 0)."""
    from .report import rows

    cfg.check()
    gathered = launch(cfg)
    if gathered is None:
        return None
    return {"hop": gathered["hop"], "rows": rows(cfg, gathered), "gathered": gathered,
            "timeouts": gathered.get("timeouts"), "hosts": gathered.get("hosts")}


def run(**options) -> list[dict] | None:
    """Runs the benchmark with BenchConfig's fields as keywords (pp=, microbatches=,
    schedules=, f=, i=, w=, act=, model=, libs=, reps=, device=, ac=, budget=) and returns
    its rows (report.COLUMNS and details). BenchError for bad input, before any process starts."""
    result = measure(BenchConfig(**options).check())
    return result["rows"] if result is not None else None


def _draw(path: str, cfg: BenchConfig, result: dict, out) -> None:
    from .draw import draw_row, paths_for

    gathered = result["gathered"]
    drawable = [r for r in result["rows"] if r["realized_ms"] is not None and r.get("sim_measured_ms")]
    names = [r["schedule"] + ("_ac" if r["ac"] and cfg.ac == "both" else "") for r in drawable]
    for name, (target, row) in zip(names, zip(paths_for(path, names).values(), drawable)):
        key = (row["schedule"], "zbpipe", row["ac"])
        program = _C.Program.from_csv_text(gathered["programs"][key])
        draw_row(target, program, gathered, key, row)
        print(f"wrote {target}", file=out)


_EPILOG = """Per schedule: the realized step (median over --reps of the slowest rank's step), its
simulation under the nominal costs and under the costs its own trace measured (per-stage F/I/W/B,
receive waits excluded) with the measured hop latency, the gap (realized / measured-cost
simulation), zbpipe/torch (torch's pipelining on the same stages, on its best group, alternating step by
step; n/a where torch lacks the schedule), host time per action and the peak saved-activation
bytes, measured / predicted. Spawns --pp local processes (Gloo on 127.0.0.1; NCCL with
--device cuda), or joins torchrun's world when WORLD_SIZE is set. See docs/benchmarks.md."""


def run_command(ns: argparse.Namespace) -> int:
    """`zbpipe bench`: the table, and --json, --draw (BenchError before any process starts)."""
    from .report import table, write_json

    cfg = config_from_args(ns)
    check_optional(ns)
    result = measure(cfg)
    if result is None:  # torchrun, not rank 0
        return 0
    out = sys.stdout
    print(table(cfg, result), file=out, flush=True)
    if ns.json:
        write_json(ns.json, cfg, result)
        print(f"wrote {ns.json}", file=out)
    if ns.draw:
        _draw(ns.draw, cfg, result, out)
    return 0


COMMAND = Subcommand(add_arguments, run_command, error_prog="zbpipe bench",
                     help="microbenchmark on emulated devices: realized vs simulated step, vs torch (zbpipe.bench)",
                     description="Microbenchmark on emulated devices: realized vs simulated step, vs torch.",
                     epilog=_EPILOG)
main = cli_main_of("bench")  # `python -m zbpipe.bench ...`: `zbpipe bench ...`
