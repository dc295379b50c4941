"""Bubble rate and peak activation memory of every schedule under a few (pp, microbatches,
costs) settings, from the simulator, plus zb_auto's build time against compiling 1f1b.

    PYTHONPATH=. python benchmarks/bench_schedules.py [--reps 5]

Costs are per 1F1B stage (1/pp of the model); a schedule with k stages per rank runs each
slice as k stages costing 1/k of it, so every row simulates the same model. Peak memory is the
largest per-rank peak, in (stage, microbatch) units and in 1F1B-stage microbatches (units / k).
"makespan x" is the makespan relative to 1f1b in the same setting. The cost-driven schedules
(zb_auto, v_half, v_min) are built under the setting's costs.

The "zb-1.5B" setting is the Zero Bubble paper's 1.5B model (p=8, m=24) with its profiled times
(ICLR 2024 version, Table 6): T_F=18.522, T_B=18.086, T_W=9.337, T_comm=0.601.
tests/core/test_paper_bubble_rates.py checks that the simulator reproduces the paper's Table 5
bubble rates for 1F1B, ZB-H1 and ZB-H2 from those times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import zbpipe

SETTINGS = [
    # name, pp, microbatches, f, b, w, comm (per 1F1B stage)
    ("unit p4 m8", 4, 8, 1.0, 1.0, 1.0, 0.0),
    ("unit p8 m24", 8, 24, 1.0, 1.0, 1.0, 0.0),
    ("zb-1.5B p8 m24", 8, 24, 18.522, 18.086, 9.337, 0.601),
    ("lm-head p4 m16", 4, 16, [1, 1, 1, 1.6], [1, 1, 1, 1.6], [1, 1, 1, 0.6], 0.1),
]


def per_stage(value, prog):
    k = prog.num_stages // prog.pp
    if isinstance(value, (int, float)):
        return [value / k]
    return [value[s // k] / k for s in range(prog.num_stages)]


def run_setting(name, pp, m, f, b, w, comm):
    rows = []
    entries = [(n, None) for n in zbpipe.schedule_names()] + [("zb_auto", 2 * pp - 1)]
    for sched, cap in entries:
        try:
            prog = zbpipe.compile(sched, pp, m)
            costs = {"f": per_stage(f, prog), "b": per_stage(b, prog), "w": per_stage(w, prog)}
            if "f" in zbpipe.schedule_options(sched):  # cost-driven: build under these costs
                extra = {} if cap is None else {"memory_cap": cap}
                prog = zbpipe.compile(sched, pp, m, comm=comm, **extra, **costs)
            res = zbpipe.simulate(prog, comm=comm, **costs)
        except ValueError as exc:
            rows.append((sched, None, str(exc).splitlines()[0]))
            continue
        label = sched if cap is None else f"{sched}(cap={cap})"
        k = prog.num_stages // prog.pp
        peak = max(res.peak_activations)
        rows.append((label, (k, res.makespan, res.bubble_rate, res.idle_rate, peak, peak / k), None))
    base = next(r[1][1] for r in rows if r[0] == "1f1b")
    print(f"\n== {name}: pp={pp}, microbatches={m}, f={f} b={b} w={w} comm={comm}")
    print(f"{'schedule':<20}{'k':>3}{'makespan':>11}{'makespan x':>12}{'bubble':>9}{'idle':>9}"
          f"{'peak units':>12}{'peak 1F1B-mb':>14}")
    for label, vals, err in rows:
        if vals is None:
            print(f"{label:<20}  skipped: {err[:90]}")
            continue
        k, ms, br, ir, peak, mb = vals
        print(f"{label:<20}{k:>3}{ms:>11.3f}{ms / base:>12.3f}{br:>9.4f}{ir:>9.4f}{peak:>12}{mb:>14.2f}")


def time_build(reps):
    """Median wall time of compile() for zb_auto (pp=8, m=24, paper costs) and for 1f1b."""
    costs = dict(f=18.522, b=18.086, w=9.337, comm=0.601)

    def median(fn):
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    auto = median(lambda: zbpipe.compile("zb_auto", 8, 24, **costs))
    peer = median(lambda: zbpipe.compile("1f1b", 8, 24))
    print(f"\nbuild time, pp=8 m=24, median of {reps}: zb_auto {auto * 1e3:.1f} ms, "
          f"1f1b {peer * 1e3:.2f} ms (ratio {auto / peer:.0f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    for setting in SETTINGS:
        run_setting(*setting)
    time_build(args.reps)


if __name__ == "__main__":
    main()
