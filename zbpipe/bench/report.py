"""The rows of `zbpipe bench` from what the ranks measured, and the table, JSON and picture.

Per (schedule, AC): realized step (median over repetitions of the slowest rank's step), the
simulation under the nominal costs and under the costs the run's own trace measured (per-stage
median F, I, W, B host times, receive waits excluded; device times on CUDA: the measuring
recipe's rule, zbpipe/tuning/measurements.py), both with the measured hop latency (inside the
steps: a waiting action's wait end less the end of its producer on the other rank, median;
across hosts, whose clocks differ, the one-way latency round a ring); the realization gap
(realized / measured-cost simulation); beside it the run-queue delay (host_load.py: how long
the rank's executor thread waited for a CPU per step, the largest over ranks, and its share of
the realized step); zbpipe/torch; host time per action;
peak saved-activation bytes measured against the simulator's prediction. Warnings follow the
table where the ranks outnumber a host's CPUs or a run's delay exceeds a few percent of its
step: its gap is then partly the host's.
"""

from __future__ import annotations

import json
import math
import statistics

from .. import _C
from ..tuning.measurements import merge_stage_costs
from ..programs import simulate
from ..tuning.stage_costs import compile_costs
import re

from .config import AUTO, BenchConfig
from .host_load import crowding, warnings_for
from .stages import nominal_costs

_ONE = re.compile(r"^(\d+)([FBIW])(\d+)$")  # one compute action (not an OVERLAP_F_B pair)
COLUMNS = ("schedule", "ac", "realized_ms", "sim_nominal_ms", "sim_measured_ms", "gap", "runq_ms", "runq_fraction",
           "torch_ms", "zbpipe_over_torch", "host_us_per_action", "saved_peak_bytes", "saved_predicted_bytes")


def _realized(ranks: list[dict], key) -> float | None:
    """Median over repetitions of the slowest rank's wall time (seconds)."""
    walls = [r[key]["walls"] for r in ranks if key in r]
    if not walls or not walls[0]:
        return None
    return statistics.median(max(w[i] for w in walls) for i in range(len(walls[0])))


def _measured_sim(program: _C.Program, ranks: list[dict], key, comm_s: float) -> tuple[float | None, dict]:
    """The program simulated under the per-stage costs the ranks' traces measured."""
    profile = merge_stage_costs([r[key].get("profile", {}) for r in ranks if key in r])
    try:
        costs = compile_costs(profile, program.num_stages)
    except ValueError:
        return None, profile
    b_full = [profile[s]["b"] if profile[s].get("b") is not None else costs["b"][s] + costs["w"][s]
              for s in range(program.num_stages)]
    res = simulate(program, f=costs["f"], b=costs["b"], w=costs["w"], b_full=b_full, comm=comm_s)
    return res.makespan, profile


def step_hop(program: _C.Program, ranks: list[dict], key) -> float | None:
    """The hop latency inside the run's own steps: for each compute action that waited for a
    message, the end of its wait less the end of the producing action on the other rank
    (one host clock), median over every such message of every timed step; None without any.
    What the simulator's comm stands for: the sender's posting, the transfer, the wake-up."""
    rank_of = program.stage_to_rank
    last = program.num_stages - 1
    samples = []
    steps = [r[key].get("steps", []) for r in ranks if key in r]
    for i in range(min((len(s) for s in steps), default=0)):
        ends, waits = {}, []
        for rank, per_step in enumerate(steps):
            for action, start, end, wait in per_step[i]:
                m = _ONE.match(action)
                if not m:
                    continue
                stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3))
                if kind != "W":  # W sends nothing
                    ends[(stage, "F" if kind == "F" else "G", mb)] = end
                if wait > 0:
                    src = stage - 1 if kind == "F" else stage + 1
                    if 0 <= src <= last and kind != "W" and rank_of[src] != rank_of[stage]:
                        waits.append(((src, "F" if kind == "F" else "G", mb), start + wait))
        samples += [(arrival - ends[k]) / 1e9 for k, arrival in waits if k in ends and arrival > ends[k]]
    return statistics.median(samples) if samples else None


def _nominal(cfg: BenchConfig, program: _C.Program, ac: bool, comm_s: float) -> tuple[float | None, float | None]:
    """(simulated makespan under the nominal costs, predicted peak saved bytes per rank):
    the recompute of AC adds one F to I (and B); AC saves nothing between F and I but the
    recompute's own buffer."""
    if cfg.model != "emulated":
        return None, None
    n = program.num_stages
    c = nominal_costs(cfg, n, ac)
    saved = 4.0 * cfg.saved_elems(n)
    mem_w = [0.0] * n
    mem_w[0] = saved  # the first stage's input path runs in W: its buffer waits for it
    res = simulate(program, f=[v / 1e3 for v in c["f"]], b=[v / 1e3 for v in c["i"]],
                   w=[v / 1e3 for v in c["w"]], comm=comm_s, mem_f=[saved] * n, mem_w=mem_w)
    predicted = saved if ac else max(res.peak_memory)  # AC: one recompute's buffer at a time
    return res.makespan, predicted


def _run_queue(ranks: list[dict], key) -> dict:
    """The largest per-rank median run-queue delay per timed step (ms): of the executor
    thread ("runq_ms", with its rank) and of the whole process ("runq_process_ms")."""
    out: dict = {"runq_ms": None, "runq_rank": None, "runq_process_ms": None}
    thread = {i: statistics.median(r[key]["runq_thread_ns"]) / 1e6 for i, r in enumerate(ranks)
              if key in r and r[key].get("runq_thread_ns")}
    process = [statistics.median(r[key]["runq_process_ns"]) / 1e6 for r in ranks
               if key in r and r[key].get("runq_process_ns")]
    if thread:
        out["runq_rank"] = max(thread, key=thread.get)
        out["runq_ms"] = thread[out["runq_rank"]]
    if process:
        out["runq_process_ms"] = max(process)
    return out


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def rows(cfg: BenchConfig, gathered: dict) -> list[dict]:
    """One dict per (schedule, AC) with COLUMNS and the details (per-stage costs, hop)."""
    ranks, hop = gathered["ranks"], gathered["hop"]
    comm = hop["hop_s"]
    out = []
    acs = {"off": (False,), "on": (True,), "both": (False, True)}[cfg.ac]
    for schedule in cfg.schedules:
        for ac in acs:
            zk, tk = (schedule, "zbpipe", ac), (schedule, "torch", ac)
            row: dict = {"schedule": schedule, "ac": ac}
            realized = _realized(ranks, zk)
            torch_s = _realized(ranks, tk)
            row["realized_ms"] = realized * 1e3 if realized is not None else None
            row["torch_ms"] = torch_s * 1e3 if torch_s is not None else None
            if "torch" in cfg.libs and tk in gathered["skipped"]:
                row["torch_note"] = "n/a: " + gathered["skipped"][tk]
            if zk in gathered["skipped"]:
                row["note"] = "n/a: " + gathered["skipped"][zk]
            program = _C.Program.from_csv_text(gathered["programs"][zk]) if zk in gathered["programs"] else None
            nominal = predicted = measured = None
            profile = {}
            if program is not None:
                # The hop inside the steps where every rank shares one clock, else the ring's (one-way latency).
                in_step = step_hop(program, ranks, zk) if gathered.get("one_host") else None
                comm_s = in_step if in_step is not None else comm
                row["hop_ms"] = comm_s * 1e3
                nominal, predicted = _nominal(cfg, program, ac, comm_s)
                measured, profile = _measured_sim(program, ranks, zk, comm_s)
            row["sim_nominal_ms"] = nominal * 1e3 if nominal is not None else None
            row["sim_measured_ms"] = measured * 1e3 if measured is not None else None
            row["gap"] = _ratio(realized, measured)
            row.update(_run_queue(ranks, zk))
            row["runq_fraction"] = _ratio(row["runq_ms"], row["realized_ms"])
            row["zbpipe_over_torch"] = _ratio(realized, torch_s)
            hosts = [r[zk]["host_per_action_s"] for r in ranks if zk in r and r[zk].get("host_per_action_s") is not None]
            row["host_us_per_action"] = statistics.fmean(hosts) * 1e6 if hosts else None
            for edge in ("lead_s", "tail_s"):  # the slowest rank's: before its first record, after its last
                values = [r[zk][edge] for r in ranks if zk in r and edge in r[zk]]
                row[edge.replace("_s", "_ms")] = max(values) * 1e3 if values else None
            peaks = [r[zk]["saved_peak"] for r in ranks if zk in r]
            # Only the emulated blocks' saved buffers are tracked.
            row["saved_peak_bytes"] = max(peaks) if peaks and cfg.model == "emulated" else None
            row["saved_predicted_bytes"] = predicted
            row["costs_ms"] = {s: {k: (v * 1e3 if v is not None else None) for k, v in p.items() if k in "fiwb"}
                               for s, p in sorted(profile.items())}
            autos = [r[zk]["auto"] for r in ranks if zk in r and "auto" in r[zk]]
            if autos:
                a = autos[0]
                row["auto"] = {k: a[k] for k in ("choice", "fits", "table")}
                row["auto"]["predicted_ms"] = a["predicted_s"] * 1e3
                row["auto"]["predicted_over_measured"] = _ratio(a["predicted_s"], realized)
            out.append(row)
    _auto_against_fixed(out)
    return out


def _auto_against_fixed(table: list[dict]) -> None:
    """ScheduleAuto's step over the best fixed schedule of this run that fits its budget."""
    for row in table:
        if row["schedule"] != AUTO or "auto" not in row or row["realized_ms"] is None:
            continue
        fits = [r for r in table if r["ac"] == row["ac"] and row["auto"]["fits"].get(r["schedule"])
                and r["realized_ms"] is not None]
        if fits:
            best = min(fits, key=lambda r: r["realized_ms"])
            row["auto"]["best_fitting"] = best["schedule"]
            row["auto"]["over_best_fitting"] = row["realized_ms"] / best["realized_ms"]


def _cell(v, fmt: str) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    return format(v, fmt)


def _hosts_line(hosts: list[dict] | None) -> str:
    if not hosts:
        return "host: n/a"
    return "host: " + "; ".join(f"{len(h['ranks'])} rank(s) on {h['cpus']} CPU(s) of {h['host']}"
                                for h in crowding(hosts))


def _runq_cell(r: dict) -> str:
    if r.get("runq_ms") is None:
        return "n/a"
    return f"{r['runq_ms']:.2f} ({_cell(r.get('runq_fraction'), '.1%')})"


def table(cfg: BenchConfig, result: dict) -> str:
    """The rows as a Markdown table, the hop and host lines, the host warnings and
    ScheduleAuto's lines."""
    hop = result["hop"]
    costs = (f" F/I/W ms per 1F1B stage {cfg.f}/{cfg.i}/{cfg.w} act {cfg.act} B" if cfg.model == "emulated" else "")
    lines = [f"pp={cfg.pp} microbatches={cfg.microbatches} model={cfg.model} device={cfg.device}{costs} reps={cfg.reps}",
             f"hop at {cfg.act} B: {hop['hop_s'] * 1e3:.3f} ms one-way, {hop['bandwidth_Bps'] / 1e9:.3f} GB/s; "
             f"latency (4 B) {hop['latency_s'] * 1e6:.1f} us",
             _hosts_line(result.get("hosts")) + "; run-queue: the most any rank's executor thread waited for a "
             "CPU per step (ms, share of the step)", "",
             "| schedule | AC | realized ms | sim nominal ms | sim measured ms | gap | run-queue ms | torch ms "
             "| zbpipe/torch | host us/action | saved peak B (measured / predicted) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        name = r["schedule"] + (f" ({r['auto']['choice']})" if "auto" in r else "")
        lines.append(
            f"| {name} | {'on' if r['ac'] else 'off'} | {_cell(r['realized_ms'], '.1f')} "
            f"| {_cell(r['sim_nominal_ms'], '.1f')} | {_cell(r['sim_measured_ms'], '.1f')} | {_cell(r['gap'], '.3f')} "
            f"| {_runq_cell(r)} | {_cell(r['torch_ms'], '.1f')} | {_cell(r['zbpipe_over_torch'], '.3f')} "
            f"| {_cell(r['host_us_per_action'], '.0f')} "
            f"| {_cell(r['saved_peak_bytes'], '.0f')} / {_cell(r['saved_predicted_bytes'], '.0f')} |")
    lines += warnings_for(result["rows"], result.get("hosts") or [])
    for r in result["rows"]:
        for note in ("note", "torch_note"):
            if note in r:
                lines.append(f"- {r['schedule']}{' (torch)' if note == 'torch_note' else ''}: {r[note]}")
        if "auto" in r:
            a = r["auto"]
            lines.append(f"- auto: chose {a['choice']}, predicted {a['predicted_ms']:.1f} ms, predicted/measured "
                         f"{_cell(a['predicted_over_measured'], '.3f')}; over the best fixed schedule that fits "
                         f"the budget ({a.get('best_fitting', 'n/a')}): {_cell(a.get('over_best_fitting'), '.3f')}")
    return "\n".join(lines)


def write_json(path: str, cfg: BenchConfig, result: dict) -> None:
    doc = {"config": {k: getattr(cfg, k) for k in ("pp", "microbatches", "schedules", "f", "i", "w", "act", "model",
                                                  "libs", "reps", "warmup", "device", "ac", "budget")},
           "hop": result["hop"], "rows": result["rows"], "timeouts": result.get("timeouts"),
           "hosts": crowding(result.get("hosts") or []),
           "warnings": warnings_for(result["rows"], result.get("hosts") or [])}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
