"""Per-stage costs read from a step's trace: the F, I, W (and B) host times of every compute
action, and the memory counters a probing step adds (zbpipe/tuning/memory_probe.py), in the form
zbpipe.simulate / zbpipe.compile take them.

    costs = zbpipe.profile_from_trace(["rank0.json", "rank1.json"])   # Chrome traces
    costs = zbpipe.profile_from_trace(sched.trace())                  # records of one rank
    zbpipe.compile("zb_auto", pp, m, **zbpipe.stage_costs.compile_costs(costs, num_stages))
"""

from __future__ import annotations

import json
import re
import statistics
from typing import Iterable

# One compute action's name, "<stage><F|B|I|W><microbatch>" (not an OVERLAP_F_B pair).
COMPUTE_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
_COMPUTE = COMPUTE_ACTION  # the old private name, kept for callers outside the package
_MEMORY = re.compile(r"^stage (\d+) saved bytes$")


def _records_of(source) -> list[dict]:
    """Records as sched.trace() gives them, from such a list or a Chrome trace file's host lane."""
    if isinstance(source, dict):
        return [source]
    if not isinstance(source, str):
        return list(source)
    with open(source) as f:
        events = json.load(f)["traceEvents"]
    out: list[dict] = []
    device: dict[tuple, tuple[float, float]] = {}
    for e in events:
        if e.get("ph") == "C":
            out.append({"memory": e["name"], "args": e["args"]})
        elif e.get("ph") == "X" and e.get("tid") == 0:
            start = int(round(e["ts"] * 1000))
            out.append({"action": e["name"], "host_start_ns": start,
                        "host_end_ns": start + int(round(e["dur"] * 1000)),
                        "wait_ns": int(round(e["args"].get("wait_us", 0.0) * 1000)),
                        "entry": e["args"].get("entry"), "pid": e.get("pid")})
        elif e.get("ph") == "X" and e.get("tid") == 1:  # the device lane (device_timing)
            device[(e["pid"], e["args"].get("entry"))] = (e["ts"], e["ts"] + e["dur"])
    for r in out:  # a host record and its device twin share (rank, entry)
        if "action" in r and (r.get("pid"), r.get("entry")) in device:
            r["device_start_us"], r["device_end_us"] = device[(r.get("pid"), r.get("entry"))]
    return out


def action_seconds(r: dict, clock: str = "auto") -> float:
    """One compute record's time: its device time where the record has one and the clock allows,
    else its host time less its receive wait."""
    if clock != "host" and r.get("device_start_us", -1.0) >= 0:
        return (r["device_end_us"] - r["device_start_us"]) / 1e6
    if clock == "device":
        raise ValueError(f"profile_from_trace(clock='device'): {r['action']} has no device time "
                         "(run the schedule with device_timing=True on an accelerator)")
    return (r["host_end_ns"] - r["host_start_ns"] - r.get("wait_ns", 0)) / 1e9


_took_s = action_seconds  # the old private name, kept for callers outside the package


def action_times(records: Iterable[dict], clock: str = "auto") -> dict[int, dict[str, list[float]]]:
    """{stage: {"f", "i", "w", "b": [seconds of each such compute action]}} of sched.trace()
    records (action_seconds; negative times, a clock's rounding, count as 0)."""
    times: dict[int, dict[str, list[float]]] = {}
    for r in records:
        m = COMPUTE_ACTION.match(r.get("action", ""))
        if m:
            times.setdefault(int(m.group(1)), {}).setdefault(m.group(2).lower(), []).append(
                max(action_seconds(r, clock), 0.0))
    return times


def median_costs(times: dict[int, dict[str, list[float]]]) -> dict[int, dict[str, float | None]]:
    """{stage: {"f", "i", "w", "b": the median of its samples, None where it has none}}: the
    one rule by which every measurement of zbpipe turns action samples into a cost
    (zbpipe/tuning/measurements.py says why the median)."""
    return {s: {k: (statistics.median(kinds[k]) if kinds.get(k) else None) for k in "fiwb"}
            for s, kinds in sorted(times.items())}


def profile_from_trace(records_or_paths, clock: str = "auto") -> dict[int, dict[str, float]]:
    """{stage: {"f", "i", "w", "b": seconds (median per action kind; None where the trace has
    no such action), "mem_f", "mem_w": bytes (only where a probing step's counters are in the
    trace)}} from sched.trace() records, a list of them (one per rank), or Chrome trace paths
    (a list, or one comma-separated string). A compute action's time is, with clock="auto",
    its device time where the trace has one (a schedule run with device_timing=True on an
    accelerator; the device lane of a Chrome trace), else its host time less the time it waited
    for a receive; clock="host" always takes the latter, clock="device" requires device times.
    Raises ValueError when no compute action is found."""
    if clock not in ("auto", "host", "device"):
        raise ValueError(f"clock must be 'auto', 'host' or 'device', got {clock!r}")
    if isinstance(records_or_paths, str):
        records_or_paths = [p for p in records_or_paths.split(",") if p]
    sources: Iterable = records_or_paths
    if records_or_paths and isinstance(records_or_paths[0], dict):
        sources = [records_or_paths]
    records: list[dict] = []
    memory: dict[int, dict[str, int]] = {}
    for source in sources:
        for r in _records_of(source):
            m = _MEMORY.match(r["memory"]) if "memory" in r else None
            if m:
                memory[int(m.group(1))] = {k: int(v) for k, v in r["args"].items()}
            elif "memory" not in r:
                records.append(r)
    out = median_costs(action_times(records, clock))
    if not out:
        raise ValueError("profile_from_trace: no compute action (F, B, I, W) in the trace")
    for stage, cost in out.items():
        cost.update(memory.get(stage, {}))
    return out


def compile_costs(profile: dict[int, dict], num_stages: int) -> dict:
    """The profile as per-stage lists: f, b (I), w for simulate/compile, and mem_f, mem_w where
    every stage has them. A stage measured with a full B only has it split evenly between I and
    W. Raises ValueError for a stage the profile lacks."""
    missing = [s for s in range(num_stages) if s not in profile or profile[s]["f"] is None]
    if missing:
        raise ValueError(f"the profile has no forward time for stage(s) {missing} of {num_stages}")
    f, b, w = [], [], []
    for s in range(num_stages):
        p = profile[s]
        f.append(p["f"])
        if p["i"] is not None and p["w"] is not None:
            b.append(p["i"])
            w.append(p["w"])
        else:
            full = p["b"] if p["b"] is not None else 2 * p["f"]
            b.append(full / 2)
            w.append(full / 2)
    out = dict(f=f, b=b, w=w)
    if all("mem_f" in profile[s] for s in range(num_stages)):
        out["mem_f"] = [float(profile[s]["mem_f"]) for s in range(num_stages)]
        out["mem_w"] = [float(profile[s]["mem_w"]) for s in range(num_stages)]
    return out
