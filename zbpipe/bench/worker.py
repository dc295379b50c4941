"""One rank of `zbpipe bench`: builds every (schedule, library, AC) run on the same stages,
warms them up, times them alternating step by step (drift on a shared machine hits every run
alike), measures a hop's one-way latency and the bandwidth apart (zbpipe/tuning/measurements.py), and
gathers what rank 0 reports.

Every rank returns the gathered measurements (report.rows turns them into the table)."""

from __future__ import annotations

import os
import re
import statistics
import time

import torch
import torch.distributed as dist

from ..group_timeout import group_timeout_s
from ..tuning.measurements import bandwidth_probe, one_way_latency_s, sync_device
from ..tuning.stage_costs import action_times, median_costs
from .config import AUTO, BenchConfig, torch_has
from .emulated import SavedBytes
from .host_load import RunQueue, host_info
from .stages import Workload, nominal_costs

_PARTS = re.compile(r"(\d+)([FBIW])(\d+)")


def all_agree(ok: bool, device: torch.device) -> bool:
    """Every rank takes the same branch (a run built on some ranks only would deadlock)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def measure_hop(rank: int, world: int, nbytes: int, device: torch.device, reps: int = 5) -> dict:
    """{"hop_s": the one-way latency of a message of `nbytes` between neighbouring ranks (round a
    ring: zbpipe.measurements.one_way_latency_s, as ScheduleAuto's), "latency_s": of a 4-byte
    one, "bandwidth_Bps": the bandwidth probe's (measurements.bandwidth_probe, 4 MiB)}, the
    same on every rank; zeros in a world of one. `rank` is unused (every rank takes part)."""
    if world < 2:
        return {"hop_s": 0.0, "latency_s": 0.0, "bandwidth_Bps": 0.0}
    probe = bandwidth_probe(device, loops=reps)
    return {"hop_s": one_way_latency_s(nbytes, device, loops=reps), "latency_s": probe["latency_s"],
            "bandwidth_Bps": probe["bandwidth_Bps"]}


class Run:
    """One (schedule, library, AC) on this rank's stages and the samples of its timed steps."""

    def __init__(self, cfg: BenchConfig, schedule: str, lib: str, ac: bool, rank: int, device: torch.device,
                 group: dist.ProcessGroup | None = None):
        import zbpipe
        from ..train.pipeline import build_pipeline

        self.schedule, self.lib, self.ac, self.device = schedule, lib, ac, device
        self.walls: list[float] = []
        self.traces: list[list[dict]] = []
        self.last_start_ns = 0
        self.edges: list[tuple[float, float]] = []  # per timed step: (first record's start, after the last record's end), s
        self.saved_peak = 0
        self.runq = RunQueue()  # per timed step: how long this rank's threads waited for a CPU
        pp, m = cfg.pp, cfg.microbatches
        placement = "1f1b" if schedule == AUTO else schedule
        program = zbpipe.compile(placement, pp, m)
        self.work = Workload(cfg, program.num_stages, ac, device)
        kwargs = {}
        if lib == "zbpipe":
            # Static shapes: torch's stages are declared with their shapes too (io_examples).
            kwargs = {"timeout": cfg.schedule_timeout_s, "device_timing": device.type != "cpu", "static_shapes": True}
            if "f" in zbpipe.schedule_options(placement) and cfg.model == "emulated":
                # Cost-driven schedules plan under the nominal costs of this run, AC's recompute included.
                costs = nominal_costs(cfg, program.num_stages, ac)
                kwargs["compile_options"] = dict(f=costs["f"], b=costs["i"], w=costs["w"])
        if schedule == AUTO:
            self.sched, self.local = build_pipeline(
                "zbpipe", program, self.work.modules, rank, device, self.work.loss_fn,
                io_examples=self.work.io_examples, schedule_cls=zbpipe.ScheduleAuto,
                schedule_kwargs=dict(kwargs, activation_budget=cfg.budget))
        else:
            self.sched, self.local = build_pipeline(
                lib, program, self.work.modules, rank, device, self.work.loss_fn, group=group,
                io_examples=self.work.io_examples, schedule_kwargs=kwargs)
        self.program = self.sched.program if lib == "zbpipe" else program
        self.num_stages = program.num_stages
        self.params = [p for s in self.local for p in self.work.modules[s].parameters()]

    def step(self, timed: bool, saved: bool = False) -> None:
        """One step between barriers; timed: its wall time (and zbpipe's trace) is kept."""
        for p in self.params:
            p.grad = None
        first, last = 0 in self.local, self.num_stages - 1 in self.local
        args = (self.work.x,) if first else ()
        target = self.work.y if last else None
        extra = {"return_outputs": False} if self.lib == "zbpipe" else {}
        dist.barrier()
        sync_device(self.device)
        if timed:
            self.runq.begin()
        start_ns = time.monotonic_ns()  # the trace's clock
        t0 = time.perf_counter()
        if saved:
            with SavedBytes() as tracker:
                self.sched.step(*args, target=target, **extra)
            self.saved_peak = tracker.peak
        else:
            self.sched.step(*args, target=target, **extra)
        sync_device(self.device)
        wall = time.perf_counter() - t0
        end_ns = time.monotonic_ns()
        if timed:
            self.runq.end()
            self.walls.append(wall)
            if self.lib == "zbpipe":
                trace = self.sched.trace()
                self.traces.append(trace)
                self.last_start_ns = start_ns
                if trace:
                    self.edges.append(((min(r["host_start_ns"] for r in trace) - start_ns) / 1e9,
                                       (end_ns - max(r["host_end_ns"] for r in trace)) / 1e9))

    def host_per_action(self) -> float | None:
        """Median over timed steps of the host time this rank's records took (receive waits
        excluded, worker-thread halves of OVERLAP_F_B not counted), less the emulated time of
        their compute (for an overlapped pair, the longer half), per compute action. On CUDA
        the emulated time runs on the device: nothing is subtracted. None for the trainer."""
        per_step = []
        for trace in self.traces:
            host, actions = 0.0, 0
            for r in trace:
                if r.get("worker"):
                    continue
                host += (r["host_end_ns"] - r["host_start_ns"] - r.get("wait_ns", 0)) / 1e9
                parts = _PARTS.findall(r["action"]) if "SEND" not in r["action"] and "RECV" not in r["action"] else []
                if not parts:
                    continue
                nominal = [self.work.nominal(int(s), k, self.ac) for s, k, _ in parts]
                if any(n is None for n in nominal):
                    return None
                actions += len(parts)
                if self.device.type == "cpu":
                    host -= max(nominal) / 1e3 if len(parts) > 1 else nominal[0] / 1e3
            if actions:
                per_step.append(host / actions)
        return statistics.median(per_step) if per_step else None

    def summary(self) -> dict:
        """What rank 0 needs of this rank: wall times, per-stage costs, host time, peaks."""
        out = {"walls": self.walls, "saved_peak": self.saved_peak, "local": self.local,
               "runq_thread_ns": self.runq.thread_ns, "runq_process_ns": self.runq.process_ns}
        if self.lib == "zbpipe":
            records = [r for t in self.traces for r in t if not r.get("worker")]
            # The median per stage and kind, as ScheduleAuto and plan_partition cost their stages.
            out["profile"] = median_costs(action_times(records))
            out["host_per_action_s"] = self.host_per_action()
            out["steps"] = [[(r["action"], r["host_start_ns"], r["host_end_ns"], r.get("wait_ns", 0))
                             for r in t if not r.get("worker")] for t in self.traces]
            if self.edges:  # the step's host time outside the executor's records, at both ends
                out["lead_s"] = statistics.median(e[0] for e in self.edges)
                out["tail_s"] = statistics.median(e[1] for e in self.edges)
            if self.traces:
                out["last_trace"] = [
                    {"action": r["action"], "start_ns": r["host_start_ns"] - self.last_start_ns,
                     "end_ns": r["host_end_ns"] - self.last_start_ns, "wait_ns": r.get("wait_ns", 0)}
                    for r in self.traces[-1] if not r.get("worker")]
        if self.schedule == AUTO:
            t = self.sched.tuning
            out["auto"] = {"choice": self.sched.choice, "predicted_s": t.predicted_s,
                           "budget": list(t.budget), "table": t.table()}
        return out


def _torch_group(cfg: BenchConfig, device: torch.device) -> dist.ProcessGroup | None:
    """The group torch's pipelining runs on, each library at its best: on CPU a Gloo group of
    one device (torch's batch_isend_irecv gains nothing from a second one, which costs it a
    transport thread: benchmarks.md, step time against torch), beside the world's two, which
    zbpipe routes the two directions of a rank pair through; elsewhere the world."""
    if "torch" not in cfg.libs or device.type != "cpu":
        return None
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname is None or "," not in ifname:
        return None  # the world has one device already
    os.environ["GLOO_SOCKET_IFNAME"] = ifname.split(",")[0]  # read when the group is created
    try:
        return dist.new_group(backend="gloo")
    finally:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname


def _build_runs(cfg: BenchConfig, rank: int, device: torch.device) -> tuple[dict, dict]:
    """(runs by key, reasons for the keys that are n/a)."""
    runs, skipped = {}, {}
    torch_group = _torch_group(cfg, device)
    acs = {"off": (False,), "on": (True,), "both": (False, True)}[cfg.ac]
    for schedule in cfg.schedules:
        for ac in acs:
            for lib in cfg.libs:
                key = (schedule, lib, ac)
                if lib == "torch" and not torch_has(schedule):
                    skipped[key] = f"torch.distributed.pipelining has no {schedule} schedule"
                    continue
                try:
                    group = torch_group if lib == "torch" else None
                    run, err = Run(cfg, schedule, lib, ac, rank, device, group), None
                except (ValueError, TypeError, AttributeError, NotImplementedError, RuntimeError) as e:
                    run, err = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if all_agree(err is None, device):
                    runs[key] = run
                else:
                    skipped[key] = err or "failed to build on another rank"
    return runs, skipped


def _auto_fits(runs: dict, auto: "Run") -> dict:
    """Whether each fixed one-stage-per-rank zbpipe program fits ScheduleAuto's budget, as its
    tuning judges it (the fixed runs ScheduleAuto's choice is compared with)."""
    out = {}
    for (schedule, lib, ac), run in runs.items():
        if lib == "zbpipe" and schedule != AUTO and run.num_stages == run.program.pp and ac == auto.ac:
            out[schedule] = bool(auto.sched.tuning.predict(run.program).fits)
    return out


def bench_rank(rank: int, world: int, cfg: BenchConfig, device: torch.device) -> dict:
    """Runs the whole benchmark on this rank; returns the gathered measurements."""
    torch.manual_seed(0)
    hop = measure_hop(rank, world, cfg.act, device)
    runs, skipped = _build_runs(cfg, rank, device)
    for key, run in runs.items():  # ScheduleAuto tunes over its first steps: not timed
        if key[0] == AUTO:
            for _ in range(64):
                if run.sched.tuned:
                    break
                run.step(timed=False)
    for _ in range(cfg.warmup):
        for run in runs.values():
            run.step(timed=False)
    for _ in range(cfg.reps):
        for run in runs.values():
            run.step(timed=True)
    for run in runs.values():
        run.step(timed=False, saved=True)
    mine = {}
    for key, run in runs.items():
        mine[key] = run.summary()
        if key[0] == AUTO:
            mine[key]["auto"]["fits"] = _auto_fits(runs, run)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    programs = {key: run.program.to_csv_text() for key, run in runs.items()}
    hosts: list = [None] * world
    dist.all_gather_object(hosts, host_info())
    own = group_timeout_s(dist.group.WORLD, device)
    return {"hop": hop, "ranks": every, "programs": programs, "skipped": skipped, "world": world,
            "one_host": len({h["host"] for h in hosts}) == 1, "hosts": hosts,
            # zbpipe's wait bound and the group's own (NCCL's watchdog): the first must be below.
            "timeouts": {"schedule_s": cfg.schedule_timeout_s, "group_s": own[1] if own else None}}
