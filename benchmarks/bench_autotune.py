"""ScheduleAuto against every fixed candidate of its placement, on deliberately unequal stages.

    PYTHONPATH=. python benchmarks/bench_autotune.py                 # one-stage, V and looped placements
    PYTHONPATH=. python benchmarks/bench_autotune.py --placements one --reps 5

pp=2, two spawned ranks joined by Gloo (zbpipe.train.launcher), one intra-op thread per rank,
fp32 CPU, 8 microbatches of 64 rows. The model: light stages (Linear(256, 256) + GELU) and a
last stage that is an LM-head-like Linear(256, VOCAB) whose loss is a cross-entropy over VOCAB
classes, about three times a light stage's work. One stage per rank: stage 0 light, stage 1
the head. V: stages 0-2 light, stage 3 the head (on rank 0, with stage 0). Looped: the same four
stages, rank r holding r and r+2 (the head on rank 1).

Every fixed candidate of the placement (ScheduleAuto's list; the cost-driven ones compiled at
unit costs, as a user without measurements would) and ScheduleAuto (tuned over its first two
steps, then running its choice) run on the same weights, alternating step by step after warm-up;
each cell is the median step time on rank 0, between barriers. Printed: each candidate's step,
ScheduleAuto's step over the best fixed one (goal <= 1.05) and over the best fixed one whose
simulated peak fits the budget (those ScheduleAuto may pick), its prediction over its measured
step (goal within 10%), and its tuning table. `--budget-fraction` (default 0.95) then tunes once
more with an activation budget that fraction of the safe default's simulated peak (zb_h1 or
zbv, 1F1B's memory): a budget that schedule does not fit; ScheduleAuto's choice, which must
fit, and the candidates that fit are printed (or its error naming the smallest need).

The machine these numbers come from is shared: compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zbpipe
from zbpipe.schedule_auto import FAMILIES
from zbpipe.train.launcher import run_local

PP, M, ROWS, D, VOCAB = 2, 8, 64, 256, 3072


def _stage_module(head: bool) -> nn.Module:
    return nn.Linear(D, VOCAB) if head else nn.Sequential(nn.Linear(D, D), nn.GELU())


def _modules(placement: str) -> tuple[list[nn.Module], int]:
    """The stage modules (same init on every rank) and their count."""
    torch.manual_seed(0)
    n = PP if placement == "one" else 2 * PP
    return [_stage_module(s == n - 1) for s in range(n)], n


def _mine(placement: str, rank: int) -> list[int]:
    if placement == "one":
        return [rank]
    return [rank, 2 * PP - 1 - rank] if placement == "v" else [rank, rank + PP]


def _stages(mods, n, mine):
    stages = [zbpipe.PipelineStage(mods[s], s, n, "cpu") for s in mine]
    return stages if len(stages) > 1 else stages[0]


def _timed(sched, x, y, first: bool, last: bool, mods) -> float:
    for m in mods:
        m.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    sched.step(*((x,) if first else ()), target=y if last else None)
    dist.barrier()
    return time.perf_counter() - t0


def _bench(rank: int, world: int, a: dict) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * ROWS, D, generator=g)
    y = torch.randint(0, VOCAB, (M * ROWS,), generator=g)
    for placement in a["placements"]:
        mods, n = _modules(placement)
        mine = _mine(placement, rank)
        first, last = 0 in mine, n - 1 in mine
        runs: dict[str, object] = {}
        for name in FAMILIES[placement][1]:
            try:
                runs[name] = zbpipe.get_schedule_class(name)(_stages(mods, n, mine), M, loss_fn=F.cross_entropy)
            except (ValueError, zbpipe.ScheduleError) as e:  # e.g. dualpipev at this size
                if rank == 0:
                    print(f"# {placement}: {name} not built: {str(e).splitlines()[0][:100]}", flush=True)
        auto = zbpipe.ScheduleAuto(_stages(mods, n, mine), M, loss_fn=F.cross_entropy)
        for _ in range(2):  # the tuning: memory (step 1), times (step 2), then the switch
            _timed(auto, x, y, first, last, mods)
        runs["auto"] = auto
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(a["warmup"]):
            for k, s in runs.items():
                _timed(s, x, y, first, last, mods)
        for _ in range(a["reps"]):
            for k, s in runs.items():
                times[k].append(_timed(s, x, y, first, last, mods))
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            fixed = {k: v for k, v in med.items() if k != "auto"}
            best = min(fixed, key=fixed.get)
            print(f"\n## placement {placement}: stages per rank {mine} on rank 0, {M} microbatches\n")
            print("| schedule | step ms |\n|---|---|")
            for k, v in sorted(fixed.items(), key=lambda kv: kv[1]):
                print(f"| {k} | {v * 1e3:.1f} |")
            print(f"| auto ({auto.choice}) | {med['auto'] * 1e3:.1f} |")
            t = auto.tuning
            fits = {c.name: c.fits for c in t.candidates}
            within = {k: v for k, v in fixed.items() if fits.get(k)}  # the fixed ones auto could pick
            best_within = min(within, key=within.get)
            print(f"\nauto / best fixed ({best}): {med['auto'] / fixed[best]:.3f} (goal <= 1.05); "
                  f"auto / best fixed within the budget ({best_within}): {med['auto'] / within[best_within]:.3f}; "
                  f"predicted / measured (median): {t.predicted_s / med['auto']:.3f} (goal 0.90-1.10)")
            print(t.table(), flush=True)
            safe = next(c for c in t.candidates if c.name == FAMILIES[placement][0])
        else:
            safe = None
        # A budget below the safe default's peak (1F1B's memory, split: zb_h1 or zbv).
        ref = [safe.peak_bytes if safe else None]
        dist.broadcast_object_list(ref, src=0)
        if ref[0]:
            budget = a["budget_fraction"] * max(ref[0])
            try:
                tight = zbpipe.ScheduleAuto(_stages(mods, n, mine), M, loss_fn=F.cross_entropy,
                                            activation_budget=budget)
                for _ in range(2):
                    _timed(tight, x, y, first, last, mods)
                if rank == 0:
                    c = next(c for c in tight.tuning.candidates if c.name == tight.choice)
                    print(f"\nbudget {budget:.0f} B/rank ({a['budget_fraction']} of {max(ref[0]):.0f}, "
                          f"{FAMILIES[placement][0]}'s peak): auto picks {tight.choice}, peak {max(c.peak_bytes):.0f} B "
                          f"(fits: {c.fits}); fixed schedules that fit: "
                          f"{[k.name for k in tight.tuning.candidates if k.fits]}", flush=True)
            except zbpipe.ScheduleError as e:
                if rank == 0:
                    print(f"\nbudget {budget:.0f} B/rank: {e}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--placements", default="one,v,looped", help="comma list of one, v, looped")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget-fraction", type=float, default=0.95)
    ns = p.parse_args(argv)
    a = vars(ns) | {"placements": ns.placements.split(",")}
    print(f"# bench_autotune: pp={PP}, {M} microbatches of {ROWS} rows, d={D}, vocab={VOCAB}, torch "
          f"{torch.__version__}, Gloo, 1 thread per rank; {ns.warmup} warm-up, {ns.reps} timed steps", flush=True)
    run_local(_bench, PP, (a,), timeout_s=1800, pg_timeout_s=300, threads=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
