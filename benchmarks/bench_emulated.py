"""The goals of issue #31 measured with `zbpipe bench` (zbpipe/bench/) on emulated devices:
stages whose F, I and W take fixed times without using the CPU, so what is measured is what a
pipeline engine controls (the order of actions, the host work around them, the messages).

    PYTHONPATH=. python benchmarks/bench_emulated.py --goal schedules --pp 8 --microbatches 16
    PYTHONPATH=. python benchmarks/bench_emulated.py --goal schedules --pp 16 --microbatches 32
    PYTHONPATH=. python benchmarks/bench_emulated.py --goal ac                 # pp=4, AC on and off
    PYTHONPATH=. python benchmarks/bench_emulated.py --goal auto               # pp=4, unequal stages

Goals (docs/benchmarks.md records them with the machine and date):
- `schedules` (default 2 ms actions, every training schedule, torch's pipelining alternating
  step by step where it has the schedule): the realization gap (realized step / simulation
  under the costs the run's own trace measured, with the measured hop latency) <= 1.03, and
  zbpipe/torch <= 0.9.
- `ac`: every block under torch.utils.checkpoint (the recompute costs one more F, in I or B),
  alternating with the same schedules without it: each zero-bubble schedule's steps with and
  without AC within 2% of their simulations (|gap - 1| <= 0.02), and its AC/no-AC step ratio
  no worse than 1F1B's + 0.02.
- `auto`: ScheduleAuto on unequal stages (a heavier last stage, as an LM head), against every
  fixed candidate of its placement in the same run: its prediction within 5% of its measured
  step, and its step within 3% of the best fixed schedule that fits its budget.

Every figure is a median over --reps steps of the slowest rank (the runs alternate step by
step, so the machine's drift hits all of them alike). Printed: zbpipe bench's table, then one
line per goal with met / NOT met.
"""

from __future__ import annotations

import argparse
import math
import sys

from zbpipe.bench.command import measure
from zbpipe.bench.config import BenchConfig, training_schedules
from zbpipe.bench.report import table, write_json

ZERO_BUBBLE = ("zb_h1", "zb_h2", "zbv", "interleaved_zb", "dualpipev", "zb_auto", "v_half", "v_min")
AUTO_SCHEDULES = ("1f1b", "zb_h1", "zb_h2", "zb_auto", "auto")


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def goal_schedules(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        gap, vs = r["gap"], r["zbpipe_over_torch"]
        out.append(f"- {r['schedule']}: gap {gap:.3f} ({_met(gap <= 1.03 if gap else None)}, <= 1.03); zbpipe/torch "
                   + (f"{vs:.3f} ({_met(vs <= 0.9)}, <= 0.9)" if vs is not None else "n/a (torch lacks it)"))
    return out


def goal_ac(rows: list[dict]) -> list[str]:
    by = {(r["schedule"], r["ac"]): r for r in rows}
    ratio = {s: by[(s, True)]["realized_ms"] / by[(s, False)]["realized_ms"]
             for s, ac in by if ac and by[(s, True)]["realized_ms"] and by[(s, False)]["realized_ms"]}
    sim = {s: by[(s, True)]["sim_measured_ms"] / by[(s, False)]["sim_measured_ms"]
           for s in ratio if by[(s, True)]["sim_measured_ms"] and by[(s, False)]["sim_measured_ms"]}
    nominal = {s: by[(s, True)]["sim_nominal_ms"] / by[(s, False)]["sim_nominal_ms"] for s in ratio}
    ref = ratio.get("1f1b")
    out = [f"- 1f1b: AC/no-AC {ref:.3f} (the reference); gaps off {by[('1f1b', False)]['gap']:.3f}, "
           f"on {by[('1f1b', True)]['gap']:.3f}" if ref else "- 1f1b: n/a"]
    for s in (s for s in ratio if s != "1f1b"):
        g0, g1 = by[(s, False)]["gap"], by[(s, True)]["gap"]
        within = abs(g0 - 1) <= 0.02 and abs(g1 - 1) <= 0.02 if g0 and g1 else None
        out.append(f"- {s}: gap off {g0:.3f}, on {g1:.3f} ({_met(within)}, within 2%); AC/no-AC {ratio[s]:.3f} "
                   f"({_met(ratio[s] <= ref + 0.02 if ref else None)}, <= 1f1b's {ref:.3f} + 0.02); simulated "
                   f"AC/no-AC under the measured costs {sim.get(s, math.nan):.3f} (1f1b {sim.get('1f1b', math.nan):.3f}), "
                   f"under the nominal ones {nominal[s]:.3f} (1f1b {nominal.get('1f1b', math.nan):.3f})")
    return out


def goal_auto(rows: list[dict]) -> list[str]:
    r = next(r for r in rows if r["schedule"] == "auto")
    a = r.get("auto")
    if not a:
        return ["- auto: n/a"]
    pm, best = a["predicted_over_measured"], a.get("over_best_fitting")
    return [f"- auto chose {a['choice']}: predicted/measured {pm:.3f} ({_met(abs(pm - 1) <= 0.05)}, within 5%); "
            f"over the best fixed schedule that fits ({a.get('best_fitting')}): "
            + (f"{best:.3f} ({_met(best <= 1.03)}, <= 1.03)" if best else "n/a"), a["table"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--goal", choices=("schedules", "ac", "auto"), default="schedules")
    p.add_argument("--pp", type=int, default=None, help="default 8 (schedules) or 4 (ac, auto)")
    p.add_argument("--microbatches", type=int, default=None, help="default 2 * pp")
    p.add_argument("--ms", type=float, default=2.0, help="F = I = W of a 1F1B stage, ms")
    p.add_argument("--schedules", default=None, help="comma list (default: the goal's)")
    p.add_argument("--lib", default=None, help="default zbpipe,torch (schedules) or zbpipe")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--act", type=int, default=256 * 1024)
    p.add_argument("--json", default=None, metavar="PATH", help="write zbpipe bench's rows as JSON")
    ns = p.parse_args(argv)
    pp = ns.pp or (8 if ns.goal == "schedules" else 4)
    m = ns.microbatches or 2 * pp
    libs = (ns.lib or ("zbpipe,torch" if ns.goal == "schedules" else "zbpipe")).split(",")
    default = {"schedules": training_schedules(), "ac": ["1f1b", *ZERO_BUBBLE], "auto": list(AUTO_SCHEDULES)}
    schedules = ns.schedules.split(",") if ns.schedules else default[ns.goal]
    f = i = w = [ns.ms]
    if ns.goal == "auto":  # a heavier last stage (an LM head and its loss), a lighter W there
        f = [ns.ms] * (pp - 1) + [1.75 * ns.ms]
        i = [ns.ms] * (pp - 1) + [1.75 * ns.ms]
        w = [ns.ms] * (pp - 1) + [0.5 * ns.ms]
    cfg = BenchConfig(pp=pp, microbatches=m, schedules=schedules, f=f, i=i, w=w, act=ns.act, libs=libs,
                      reps=ns.reps, ac="both" if ns.goal == "ac" else "off", timeout_s=3600.0).check()
    result = measure(cfg)
    print(table(cfg, result), flush=True)
    if ns.json:
        write_json(ns.json, cfg, result)
    print(f"\nGoals ({ns.goal}):")
    for line in {"schedules": goal_schedules, "ac": goal_ac, "auto": goal_auto}[ns.goal](result["rows"]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
