"""The measuring recipe's rules on `zbpipe bench`'s realization gap (issue 43): one run of the
bench, and from the same timed steps the measured-cost simulation under the old rule (each
stage's mean action time) and the recipe's (the median: zbpipe/tuning/measurements.py), each with the
hop measured inside the steps (what the bench uses on one host) and with the ring's one-way
latency (measurements.one_way_latency_s, what it uses across hosts).

    PYTHONPATH=. python benchmarks/bench_measuring.py --pp 4 --microbatches 8
    PYTHONPATH=. python benchmarks/bench_measuring.py --pp 8 --microbatches 16

Printed: one row per schedule (realized ms: median over --reps of the slowest rank's step; the
gap = realized / simulated under each rule and hop), then the medians of each gap column and
the hops. Every figure of one row comes from the same steps, so the columns differ by the rule
alone, not by the machine's drift between runs.
"""

from __future__ import annotations

import argparse
import statistics

from zbpipe import _C
from zbpipe.bench.command import measure
from zbpipe.bench.config import BenchConfig, training_schedules
from zbpipe.bench.report import step_hop
from zbpipe.measurements import merge_stage_costs
from zbpipe.programs import simulate
from zbpipe.stage_costs import COMPUTE_ACTION, compile_costs


def _costs(steps: list, rule) -> dict:
    """{stage: {"f", "i", "w", "b"}} of one rank's timed steps (host time less the receive wait)."""
    times: dict = {}
    for step in steps:
        for action, start, end, wait in step:
            m = COMPUTE_ACTION.match(action)
            if m:
                times.setdefault(int(m.group(1)), {}).setdefault(m.group(2).lower(), []).append(
                    max((end - start - wait) / 1e9, 0.0))
    return {s: {k: (rule(v[k]) if v.get(k) else None) for k in "fiwb"} for s, v in times.items()}


def _simulated(program: _C.Program, profile: dict, comm_s: float) -> float | None:
    try:
        c = compile_costs(profile, program.num_stages)
    except ValueError:
        return None
    b_full = [profile[s]["b"] if profile[s].get("b") is not None else c["b"][s] + c["w"][s]
              for s in range(program.num_stages)]
    return simulate(program, f=c["f"], b=c["b"], w=c["w"], b_full=b_full, comm=comm_s).makespan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    # torch alternates step by step too, as in `zbpipe bench`'s default run (the same load).
    cfg = BenchConfig(pp=a.pp, microbatches=a.microbatches, reps=a.reps, schedules=training_schedules()).check()
    gathered = measure(cfg)["gathered"]
    ranks, ring = gathered["ranks"], gathered["hop"]["hop_s"]
    print(f"pp={cfg.pp} microbatches={cfg.microbatches} reps={cfg.reps}; ring one-way latency at {cfg.act} B "
          f"{ring * 1e6:.0f} us, 4 B {gathered['hop']['latency_s'] * 1e6:.0f} us\n")
    print("| schedule | realized ms | in-step hop us | gap, mean costs | gap, median costs | gap, median, ring hop |")
    print("|---|---|---|---|---|---|")
    cols: list[list[float]] = [[], [], []]
    for schedule in cfg.schedules:
        key = (schedule, "zbpipe", False)
        if key not in gathered["programs"]:
            continue
        program = _C.Program.from_csv_text(gathered["programs"][key])
        walls = [r[key]["walls"] for r in ranks]
        realized = statistics.median(max(w[i] for w in walls) for i in range(len(walls[0])))
        hop = step_hop(program, ranks, key)
        hop = hop if hop is not None else ring
        gaps = []
        for rule, comm in ((statistics.fmean, hop), (statistics.median, hop), (statistics.median, ring)):
            profile = merge_stage_costs([_costs(r[key]["steps"], rule) for r in ranks])
            sim = _simulated(program, profile, comm)
            gaps.append(realized / sim if sim else None)
        for c, g in zip(cols, gaps):
            if g is not None:
                c.append(g)
        cells = " | ".join(f"{g:.3f}" if g is not None else "n/a" for g in gaps)
        print(f"| {schedule} | {realized * 1e3:.1f} | {hop * 1e6:.0f} | {cells} |")
    print("\nmedian gap: " + ", ".join(f"{name} {statistics.median(c):.3f}" for name, c in
                                        zip(("mean costs", "median costs", "median, ring hop"), cols) if c))


if __name__ == "__main__":
    main()
