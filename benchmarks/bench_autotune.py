"""ScheduleAuto against every fixed candidate of its placement, on deliberately unequal stages.

    PYTHONPATH=. python benchmarks/bench_autotune.py                 # one-stage, V and looped placements
    PYTHONPATH=. python benchmarks/bench_autotune.py --placements one --reps 5

pp=2, two spawned ranks joined by Gloo (zbpipe.launch), one intra-op thread per rank,
fp32 CPU, 8 microbatches of 64 rows. The model: light stages (Linear(256, 256) + GELU) and a
last stage that is an LM-head-like Linear(256, VOCAB) whose loss is a cross-entropy over VOCAB
classes, about three times a light stage's work. One stage per rank: stage 0 light, stage 1
the head. V: stages 0-2 light, stage 3 the head (on rank 0, with stage 0). Looped: the same four
stages, rank r holding r and r+2 (the head on rank 1).

Every fixed candidate of the placement (ScheduleAuto's list; the cost-driven ones compiled at
unit costs, as a user without measurements would) and ScheduleAuto (tuned over its first 1 +
--timing-steps steps and, with --trial-steps K, a trial of the candidates it cannot tell apart,
then running its choice) run on the same weights, alternating step by step after warm-up;
each cell is the median step time on rank 0, between barriers. Printed: each candidate's step,
ScheduleAuto's step over the best fixed one (goal <= 1.05) and over the best fixed one whose
simulated peak fits the budget (those ScheduleAuto may pick), its prediction over its measured
step (goal within 10%), and its tuning table. Each fixed candidate's row also carries what the
tuning predicts for that very program (`Tuning.predict`: its simulated makespan under the
measured costs plus the tuning's one unmodelled time) over its measured step, and whether its
simulated peak fits the budget. `--breakdown` adds, per candidate and rank, where the step's wall
time went (medians over the timed steps, from each step's trace): compute actions (host time
less receive waits) and their count, receive waits, send records (host time of the records that
post sends) and the sends' count, and the rest (before the first record, after the last, and
between records); then, for the safe default, its simulated makespan under the timing steps'
costs against under the timed steps' own medians, and the time that simulation leaves out in
the timed steps against in the timing steps (the tuning's unmodelled time); and every
schedule's same-time prediction over its measured step: simulated under the costs of the safe
default's timed steps (B from 1f1b's, one stage per rank) plus the unmodelled time of those
steps, so the model is judged without the drift between the tuning and the timed steps (the
safe default's is 1 by construction). `--confirm R` then
runs R fresh steps each of ScheduleAuto, the best fixed candidate and the best one within the
budget, alternating, and prints the ratios from those: the best of several noisy medians is
biased low (the minimum keeps the luckiest), fresh steps of the picks are not; a pick that
runs ScheduleAuto's own program is marked A/A (its ratio is how far one program measures from
itself: the noise floor of the others). `--budget-fraction` (default 0.95) then tunes once
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
from zbpipe import schedule_auto
from zbpipe.schedule_auto import FAMILIES
from zbpipe.stage_costs import COMPUTE_ACTION, action_seconds, compile_costs, profile_from_trace
from zbpipe.launch import run_local

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


def _timed(sched, x, y, first: bool, last: bool, mods, steps: list | None = None) -> float:
    """One step between barriers (seconds); with `steps`, this rank's trace of it and its own
    start and end (the trace's clock) are appended."""
    for m in mods:
        m.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    mine0 = time.monotonic_ns()  # the trace's clock (CLOCK_MONOTONIC)
    sched.step(*((x,) if first else ()), target=y if last else None)
    mine1 = time.monotonic_ns()
    dist.barrier()
    took = time.perf_counter() - t0
    if steps is not None:
        steps.append((sched.trace(), mine0, mine1))
    return took


def _breakdown(records: list[dict], start_ns: int, end_ns: int) -> dict:
    """Where one rank's step went: compute actions (host time less receive waits; an overlapped
    backward half on the worker thread is not counted, it runs beside the host, and the host's
    wait for it falls in the rest), receive waits, records that post sends, and the rest of the
    wall time (before, between and after records)."""
    host = [r for r in records if not r.get("worker")]
    computes = [r for r in host if COMPUTE_ACTION.match(r["action"])]
    sends = [r for r in host if "SEND" in r["action"]]
    took = lambda r: action_seconds(r, "host")  # noqa: E731  host time less the receive wait
    out = dict(wall=(end_ns - start_ns) / 1e9, compute=sum(map(took, computes)), n_compute=len(computes),
               waits=sum(r["wait_ns"] for r in host) / 1e9, sends=sum(map(took, sends)),
               n_sends=sum("SEND" in a for r in sends for a in r["action"].split("+")))
    out["rest"] = out["wall"] - out["compute"] - out["waits"] - out["sends"]
    return out


def _steady_costs(steps: list) -> dict:
    """Per stage and kind, the median over the timed steps of each step's medians."""
    profiles = [profile_from_trace(records) for records, _, _ in steps]
    return {s: {k: statistics.median(p[s][k] for p in profiles) if profiles[0][s][k] is not None else None
                for k in "fiwb"} for s in profiles[0]}


def _rank_summary(steps: dict[str, list], placement: str) -> dict:
    """This rank's median breakdown per schedule, and its stages' per-action costs in the safe
    default's timed steps, with B from the placement's fused schedule's (FUSED) where it has one."""
    parts = {}
    for k, v in steps.items():
        each = [_breakdown(*step) for step in v]
        parts[k] = {f: statistics.median(b[f] for b in each) for f in each[0]}
    costs = _steady_costs(steps[FAMILIES[placement][0]])
    fused = schedule_auto.FUSED.get(placement)
    if fused in steps:
        for s, c in _steady_costs(steps[fused]).items():
            costs[s]["b"] = c["b"]
    return dict(parts=parts, costs=costs)


def _print_breakdown(every: list[dict], tuning, safe: str, programs: dict, measured: dict) -> None:
    print("\n| schedule | rank | wall ms | compute ms (actions) | waits ms | sends ms (sends) | rest ms |"
          "\n|---|---|---|---|---|---|---|")
    for k in every[0]["parts"]:
        for r, e in enumerate(every):
            p = e["parts"][k]
            print(f"| {k} | {r} | {p['wall'] * 1e3:.1f} | {p['compute'] * 1e3:.1f} ({p['n_compute']:.0f}) | "
                  f"{p['waits'] * 1e3:.1f} | {p['sends'] * 1e3:.1f} ({p['n_sends']:.0f}) | {p['rest'] * 1e3:.1f} |")
    # The timing steps against the timed steps, on the safe default: its costs, and the wall
    # time its simulation leaves out (Tuning.overhead_s, measured on those steps).
    costs: dict = {}
    for e in every:
        costs.update(e["costs"])
    steady = compile_costs(costs, len(costs))
    model = dict(tuning.model, f=steady["f"], b=steady["b"], w=steady["w"])
    model.pop("b_full", None)
    if all(costs[s]["b"] is not None for s in costs):
        model["b_full"] = [costs[s]["b"] for s in range(len(costs))]
    safe_program, safe_step_s = programs[safe], measured[safe]
    steady_s = zbpipe.simulate(safe_program, **model).makespan
    timing_s = tuning.predict(safe_program).predicted_s - tuning.overhead_s
    print(f"\n{safe}: simulated under the timing steps' costs {timing_s * 1e3:.1f} ms, under the timed steps' "
          f"{steady_s * 1e3:.1f} ms ({timing_s / steady_s:.2f}x); measured {safe_step_s * 1e3:.1f} ms: unmodelled "
          f"{(safe_step_s - steady_s) * 1e3:.1f} ms in the timed steps, {tuning.overhead_s * 1e3:.1f} ms in the timing steps")
    # The model without the drift: every schedule predicted from the costs and the unmodelled
    # time of the timed steps themselves (the steps its measured median comes from), not the tuning's.
    unmodelled = safe_step_s - steady_s
    same = {k: zbpipe.simulate(p, **model).makespan + unmodelled for k, p in programs.items()}
    print("same-time prediction / measured (costs and unmodelled time of the timed steps): " + ", ".join(
        f"{k} {same[k] / measured[k]:.3f}" for k in programs))


def _bench(rank: int, world: int, a: dict) -> None:
    torch.set_num_threads(1)
    if a["no_fused_timing"]:  # an A/B of the fused-B timing steps: every timing step runs the safe default
        schedule_auto.FUSED.clear()
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
        auto = zbpipe.ScheduleAuto(_stages(mods, n, mine), M, loss_fn=F.cross_entropy,
                                   timing_steps=a["timing_steps"], trial_steps=a["trial_steps"])
        while not auto.tuned:  # the tuning: memory (step 1), times, a trial if asked, then the switch
            _timed(auto, x, y, first, last, mods)
        runs["auto"] = auto
        times: dict[str, list[float]] = {k: [] for k in runs}
        steps: dict[str, list] | None = {k: [] for k in runs} if a["breakdown"] else None
        for _ in range(a["warmup"]):
            for k, s in runs.items():
                _timed(s, x, y, first, last, mods)
        for _ in range(a["reps"]):
            for k, s in runs.items():
                times[k].append(_timed(s, x, y, first, last, mods, steps[k] if steps is not None else None))
        every = [None] * world
        if steps is not None:
            dist.all_gather_object(every, _rank_summary(steps, placement))
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            fixed = {k: v for k, v in med.items() if k != "auto"}
            best = min(fixed, key=fixed.get)
            t = auto.tuning
            # What the tuning predicts for each fixed program (the cost-driven ones here are
            # compiled at unit costs, so they are not ScheduleAuto's programs of that name).
            judged = {k: t.predict(runs[k].program) for k in fixed}
            print(f"\n## placement {placement}: stages per rank {mine} on rank 0, {M} microbatches\n")
            print("| schedule | step ms | predicted ms | predicted / measured | fits the budget |\n|---|---|---|---|---|")
            for k, v in sorted(fixed.items(), key=lambda kv: kv[1]):
                j = judged[k]
                print(f"| {k} | {v * 1e3:.1f} | {j.predicted_s * 1e3:.1f} | {j.predicted_s / v:.3f} | "
                      f"{'yes' if j.fits else 'no'} |")
            print(f"| auto ({auto.choice}) | {med['auto'] * 1e3:.1f} | {t.predicted_s * 1e3:.1f} | "
                  f"{t.predicted_s / med['auto']:.3f} | yes |")
            if steps is not None:
                safe_name = FAMILIES[placement][0]
                _print_breakdown(every, t, safe_name, {k: runs[k].program for k in med}, med)
            within = {k: v for k, v in fixed.items() if judged[k].fits}  # the fixed ones auto could pick
            best_within = min(within, key=within.get)
            print(f"\nauto / best fixed ({best}): {med['auto'] / fixed[best]:.3f} (goal <= 1.05); "
                  f"auto / best fixed within the budget ({best_within}): {med['auto'] / within[best_within]:.3f}; "
                  f"predicted / measured (median): {t.predicted_s / med['auto']:.3f} (goal 0.90-1.10)")
            print(t.table(), flush=True)
            safe = next(c for c in t.candidates if c.name == FAMILIES[placement][0])
            picked = [best, best_within]
        else:
            safe, picked = None, [None, None]
        if a["confirm"]:
            # The best of several noisy medians is biased low (each candidate's median carries
            # the machine's noise, and the minimum keeps the luckiest): fresh steps of the two
            # picks against ScheduleAuto, alternating, measure them without that bias.
            dist.broadcast_object_list(picked, src=0)
            again = {k: runs[k] for k in dict.fromkeys(["auto", *picked])}
            fresh: dict[str, list[float]] = {k: [] for k in again}
            for _ in range(a["confirm"]):
                for k, s in again.items():
                    fresh[k].append(_timed(s, x, y, first, last, mods))
            if rank == 0:
                med2 = {k: statistics.median(v) for k, v in fresh.items()}
                # A pick running auto's very program makes its ratio an A/A comparison: how far
                # one program measures from itself here, the noise floor of the others.
                mine_text = auto.program.to_csv_text()
                same = [k for k in dict.fromkeys(picked) if runs[k].program.to_csv_text() == mine_text]
                print(f"confirmation, {a['confirm']} fresh steps each, alternating: auto / best fixed "
                      f"({picked[0]}): {med2['auto'] / med2[picked[0]]:.3f}; auto / best fixed within the "
                      f"budget ({picked[1]}): {med2['auto'] / med2[picked[1]]:.3f}; predicted / measured: "
                      f"{auto.tuning.predicted_s / med2['auto']:.3f}"
                      f"{f'; A/A (auto runs the same program as {same})' if same else ''}", flush=True)
        # A budget below the safe default's peak (1F1B's memory, split: zb_h1 or zbv).
        ref = [safe.peak_bytes if safe else None]
        dist.broadcast_object_list(ref, src=0)
        if ref[0]:
            budget = a["budget_fraction"] * max(ref[0])
            try:
                tight = zbpipe.ScheduleAuto(_stages(mods, n, mine), M, loss_fn=F.cross_entropy,
                                            activation_budget=budget, timing_steps=a["timing_steps"],
                                            trial_steps=a["trial_steps"])
                while not tight.tuned:
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
    p.add_argument("--timing-steps", type=int, default=3, help="ScheduleAuto's timing_steps (its default: 3)")
    p.add_argument("--trial-steps", type=int, default=0, help="ScheduleAuto's trial_steps")
    p.add_argument("--no-fused-timing", action="store_true",
                   help="every timing step runs the safe default (no 1f1b step to time B): an A/B")
    p.add_argument("--confirm", type=int, default=0,
                   help="fresh steps of auto and the two best fixed picks, alternating, to measure them unbiased")
    p.add_argument("--breakdown", action="store_true", help="per candidate and rank: where the step's time went")
    ns = p.parse_args(argv)
    a = vars(ns) | {"placements": ns.placements.split(",")}
    print(f"# bench_autotune: pp={PP}, {M} microbatches of {ROWS} rows, d={D}, vocab={VOCAB}, torch "
          f"{torch.__version__}, Gloo, 1 thread per rank; {ns.warmup} warm-up, {ns.reps} timed steps; "
          f"ScheduleAuto timing_steps={ns.timing_steps}, trial_steps={ns.trial_steps}"
          f"{', no fused-B timing steps' if ns.no_fused_timing else ''}", flush=True)
    run_local(_bench, PP, (a,), timeout_s=1800, pg_timeout_s=300, threads=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
