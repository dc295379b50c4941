"""Whether the host is the bottleneck of a `zbpipe bench` run: each rank's run-queue delay (the
time its threads were ready to run but waited for a CPU) during the timed steps, and the CPUs
the ranks may run on.

Linux reports a task's run-queue delay in /proc/<task>/schedstat (its second field, in ns;
CONFIG_SCHED_INFO, on in common kernels). Two figures per rank and step:

- the executor's thread (the thread that calls step(): zbpipe's executor and the stages'
  forwards run on it): its delay lengthens the rank's own path through the step directly, so
  it is the figure compared with the step;
- the whole process (every thread of /proc/self/task: the overlap worker, the backend's
  transport threads, the failure watcher): a transport thread's delay lengthens a message's
  latency rather than the rank's compute.

Elsewhere (no /proc) the figures are None. The simulation carries neither: a gap that comes
with a delay of a few percent of the step is partly the host's, not the engine's.
"""

from __future__ import annotations

import glob
import os
import socket

WARN_FRACTION = 0.03  # a delay above this share of the step is reported as host contention


def _wait_ns(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def thread_wait_ns() -> int | None:
    """Run-queue delay of the calling thread so far (ns), None where the kernel does not say."""
    return _wait_ns("/proc/thread-self/schedstat")


def process_wait_ns() -> int | None:
    """Run-queue delay of every live thread of this process so far (ns), None where unknown.
    Threads that ended in between drop out of the sum: compare readings of one step only."""
    total, found = 0, False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        ns = _wait_ns(path)
        if ns is not None:
            total, found = total + ns, True
    return total if found else None


def cpus_in_use() -> list[int]:
    """The CPUs this process may run on (its affinity; every CPU where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


class RunQueue:
    """Per-step run-queue delays of this rank: begin() before a step, end() after it."""

    def __init__(self):
        self.thread_ns: list[int] = []   # per measured step: the executor's thread
        self.process_ns: list[int] = []  # per measured step: every thread of the process
        self._start: tuple[int | None, int | None] = (None, None)

    def begin(self) -> None:
        self._start = (thread_wait_ns(), process_wait_ns())

    def end(self) -> None:
        (t0, p0), t1, p1 = self._start, thread_wait_ns(), process_wait_ns()
        if t0 is not None and t1 is not None:
            self.thread_ns.append(t1 - t0)
        if p0 is not None and p1 is not None:
            self.process_ns.append(max(p1 - p0, 0))


def host_info() -> dict:
    """This rank's host name and CPUs in use (gathered by every rank)."""
    return {"host": socket.gethostname(), "cpus": cpus_in_use()}


def crowding(hosts: list[dict]) -> list[dict]:
    """Per host: its ranks and the CPUs they may run on together (the union of their
    affinities), {"host", "ranks", "cpus"}; a host whose ranks outnumber its CPUs is crowded."""
    by_host: dict[str, dict] = {}
    for rank, h in enumerate(hosts):
        entry = by_host.setdefault(h["host"], {"host": h["host"], "ranks": [], "cpus": set()})
        entry["ranks"].append(rank)
        entry["cpus"].update(h["cpus"])
    return [{"host": e["host"], "ranks": e["ranks"], "cpus": len(e["cpus"])} for e in by_host.values()]


def warnings_for(rows: list[dict], hosts: list[dict]) -> list[str]:
    """The report's host warnings: one line per host whose ranks outnumber its CPUs, and one
    line for the runs whose executor thread waited for a CPU more than WARN_FRACTION of the
    step (how many, and the worst)."""
    out = []
    for h in crowding(hosts):
        if len(h["ranks"]) > h["cpus"]:
            out.append(f"warning: {len(h['ranks'])} ranks share {h['cpus']} CPU(s) on {h['host']}: ranks wait for a "
                       "core, which the simulation does not carry")
    measured = [r for r in rows if r.get("runq_fraction") is not None]
    high = [r for r in measured if r["runq_fraction"] > WARN_FRACTION]
    if high:
        worst = max(high, key=lambda r: r["runq_fraction"])
        name = worst["schedule"] + (" (AC)" if worst.get("ac") else "")
        out.append(f"warning: in {len(high)} of {len(measured)} runs an executor thread waited for a CPU more than "
                   f"{WARN_FRACTION:.0%} of the step (the most: {name}, rank {worst['runq_rank']}, "
                   f"{worst['runq_ms']:.2f} ms per step, {worst['runq_fraction']:.1%}): their gaps are partly the "
                   "host's, not the engine's")
    return out
