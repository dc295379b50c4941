"""How zbpipe measures stages, one recipe for its three users (ScheduleAuto, plan_partition and
`zbpipe bench`): what a step's actions cost, what crosses between ranks, and how the ranks'
numbers become one.

- **The steps** (StageTiming, measure_stages): a probing step of the split schedule (its memory
  probe: mem_f / mem_w per stage; it also warms up, so its times are not kept), then timing
  steps that alternate the split schedule (F, I, W) with the fused-B one where there is one (B
  as measured, not as I + W). ScheduleAuto runs them as the user's first steps, plan_partition
  in a loop of its own; the bench times each run's own steps and keeps their costs only.
- **The costs** (zbpipe.stage_costs.median_costs): per stage and kind, the median of every
  action's time (device time where recorded, else host time less the receive wait).
- **The gather rule** (merge_stage_costs): a stage's cost is the median over the ranks that
  measured it (plan_partition's units are measured on every rank; ScheduleAuto's and the bench's
  stages each by its owner, a median of one); bytes are the largest over those ranks (a budget
  is a bound, not an average); a step's wall time is its slowest rank's (the step ends there).
  Why the median: the hosts are shared (benchmarks.md: an executor thread waits for a CPU 7-32%
  of a step with 8 ranks on 2 cores), so action times have a long right tail that is the host's,
  not the action's; the median is the action's own cost, which is what the simulator models,
  while a mean moves with the tail. The bench reports that tail beside the gap (its run-queue
  column) instead of folding it into the costs.
- **Across ranks** (one_way_latency_s, bandwidth_probe): the one-way latency of a message of a
  given size, timed round a ring so no rank's late start counts (ScheduleAuto's comm, and the
  bench's hop); and, apart, the bandwidth: the extra time a large message takes over a 4-byte
  one. hop_s (a ping-pong after a barrier) reads about twice as long on a loaded host
  (autotune.md) and is kept only for comparison.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, TypedDict

import torch
import torch.distributed as dist

from .. import _C
from .stage_costs import profile_from_trace


class RankMeasurements(TypedDict):
    """One rank's measurements of a tuning, as all_gather_object sends them."""
    rank: int
    num_stages: int
    microbatches: int
    costs: dict   # {stage: {"f", "i", "w", "b": seconds or None}} (profile_from_trace), local stages
    deltas: dict  # {stage: {"mem_f", "mem_w": bytes}} (memory_profile()), local stages
    comm_s: float  # one hop of a boundary-sized message (one_way_latency_s), the same on every rank
    walls: list[float]  # each timing step's wall time on this rank


@dataclasses.dataclass
class Measured:
    """The pipeline's measurements, merged over its ranks: what zbpipe.auto_plan.plan takes."""
    costs: dict    # {stage: {"f", "i", "w", "b"}} seconds, every stage
    deltas: dict   # {stage: {"mem_f", "mem_w"}} bytes, every stage
    comm_s: float  # the largest rank's P2P hop
    walls: list[float]  # each timing step's wall time at its slowest rank


def sync_device(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the steps ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StageTiming:
    """The recipe's state after its probing step, a value: each timing step gives a new one."""
    split: Any                  # the split schedule (it probed memory, and times F, I, W)
    fused: Any | None           # the fused-B schedule every second timing step runs, if any
    deltas: dict                # {stage: {"mem_f", "mem_w"}} of the probing step (memory_profile())
    records: tuple = ()         # the timing steps' traces, pooled
    walls: tuple[float, ...] = ()  # each timing step's wall time
    ran: tuple = ()             # the program each timing step ran

    def next_schedule(self):
        """The next timing step's: the split schedule first, then every second step the fused
        one (where there is one)."""
        odd = len(self.walls) % 2 == 1
        return self.fused if odd and self.fused is not None else self.split

    def after_step(self, wall: float, trace: list, program) -> StageTiming:
        return dataclasses.replace(self, records=self.records + tuple(trace), walls=self.walls + (wall,),
                                   ran=self.ran + (program,))

    def costs(self, clock: str) -> dict:
        """{stage: {"f", "i", "w", "b"}} seconds: the median of each kind over every timing step
        (zbpipe.stage_costs.profile_from_trace)."""
        return profile_from_trace(list(self.records), clock=clock)


def probe_memory(split, run_step: Callable[[Any], Any]):
    """Runs the recipe's probing step (run_step(split) with the memory probe on); returns what
    run_step returned and the probe's {stage: {"mem_f", "mem_w"}} (memory_profile())."""
    split.measure_memory = True
    try:
        out = run_step(split)
    finally:
        split.measure_memory = False
    return out, split.memory_profile()


def measure_stages(split, fused, run_step: Callable[[Any], Any], timing_steps: int, *,
                   warm_fused: bool = True) -> StageTiming:
    """The whole recipe where the caller owns the steps (plan_partition): the probing step, one
    untimed step of `fused` (warm_fused: so its first timed step is not its setup), then
    `timing_steps` timing steps, alternating as StageTiming.next_schedule says. run_step(s)
    runs one step of schedule s."""
    _, deltas = probe_memory(split, run_step)
    if warm_fused and fused is not None:
        run_step(fused)
    timing = StageTiming(split, fused, deltas)
    for _ in range(timing_steps):
        sched = timing.next_schedule()
        start = time.perf_counter()
        run_step(sched)
        timing = timing.after_step(time.perf_counter() - start, sched.trace(), sched.program)
    return timing


# ---- across ranks ---------------------------------------------------------------------------

# The tag of one_way_latency_s's token: the executor's messages on the pipeline group never use
# it (they are tagged by action), and none is in flight between steps, when a tuning measures.
RING_TAG = 77


def one_way_latency_s(nbytes: int, device: torch.device, group: Any = None, loops: int = 5) -> float:
    """The one-way latency of a message of `nbytes` between neighbouring ranks of the pipeline
    `group` (None: the world): group rank 0 passes a token round the ring (each rank receives,
    then sends on) and times the loop, so no rank's late start is counted; the median of `loops`
    loops after one to warm up, over pp hops. Group rank 0's value on every rank, 0.0 in a
    group of one. (hop_s's ping-pong between two ranks, each try after a barrier, reads about
    twice as long on a 2-core host: docs/autotune.md.)"""
    group = group if group is not None else dist.group.WORLD
    pp, rank = group.size(), group.rank()
    if pp < 2:
        return 0.0
    buf = torch.zeros(nbytes // 4 + 1, device=device)
    nxt, prv = (rank + 1) % pp, (rank - 1) % pp
    times = []
    for _ in range(loops + 1):
        sync_device(device)
        start = time.perf_counter()
        if rank == 0:
            group.send([buf], nxt, RING_TAG).wait()
            group.recv([buf], prv, RING_TAG).wait()
        else:
            group.recv([buf], prv, RING_TAG).wait()
            group.send([buf], nxt, RING_TAG).wait()
        sync_device(device)
        times.append(time.perf_counter() - start)
    hop = [statistics.median(times[1:]) / pp]
    dist.broadcast_object_list(hop, src=dist.get_global_rank(group, 0), group=group)
    return hop[0]


ring_hop_s = one_way_latency_s  # the name ScheduleAuto's measurements had


def bandwidth_probe(device: torch.device, group: Any = None, nbytes: int = 4 << 20, loops: int = 5) -> dict:
    """The link apart from the hop: {"latency_s": one-way time of 4 bytes, "large_s": of
    `nbytes` (one_way_latency_s both), "bandwidth_Bps": the bytes beyond 4 over the time they
    add}, the same on every rank; zeros in a group of one. A large message (4 MiB) so the
    transfer stands above a loaded host's wake-up noise; where it still does not,
    bandwidth_Bps is nbytes / large_s, a lower bound."""
    latency = one_way_latency_s(4, device, group, loops)
    large = one_way_latency_s(nbytes, device, group, loops)
    if large <= 0:
        return {"latency_s": latency, "large_s": large, "bandwidth_Bps": 0.0}
    extra = large - latency
    return {"latency_s": latency, "large_s": large,
            "bandwidth_Bps": (nbytes - 4) / extra if extra > 0 else nbytes / large}


def hop_s(nbytes: int, device: torch.device, group: Any = None, reps: int = 20) -> float:
    """One-way time of a message of `nbytes` between ranks 0 and 1 of `group` (None: the world),
    kept for comparison (zbpipe measures with one_way_latency_s): half the median round trip
    of `reps` ping-pongs after two to warm up, each after a barrier
    of the group; group rank 0's value on every rank, 0.0 in a group of one."""
    if dist.get_world_size(group) < 2:
        return 0.0
    rank = dist.get_rank(group)
    t = torch.zeros(max(1, nbytes // 4), device=device)
    times = []
    for _ in range(reps + 2):
        dist.barrier(group=group)
        if rank > 1:
            continue
        sync_device(device)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, group=group, group_dst=1)
            dist.recv(t, group=group, group_src=1)
        else:
            dist.recv(t, group=group, group_src=0)
            dist.send(t, group=group, group_dst=0)
        sync_device(device)
        times.append(time.perf_counter() - t0)
    shared = [statistics.median(times[2:]) / 2 if times else 0.0]
    dist.broadcast_object_list(shared, group=group, group_src=0)  # one value everywhere
    return shared[0]


def boundary_bytes(schedule, stages) -> int:
    """The largest message this rank's stages send forward at `schedule`'s last step: the bytes
    of every output tensor of a local stage but the last (PipelineSchedule.output_specs)."""
    nbytes = 0
    for s in stages:
        if not s.is_last:
            specs = schedule.output_specs(s.stage_index)
            nbytes = max(nbytes, sum(
                torch.empty(0, dtype=d).element_size() * int(torch.Size(shape).numel()) for shape, d in specs))
    return nbytes


def gather(value: Any, group: Any) -> list:
    """`value` of every rank of the pipeline group, in group rank order."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def merge_stage_costs(every: list[dict]) -> dict:
    """The gather rule: {stage: {key: value}} of every rank (each rank's stages it measured) as
    one {stage: {key: value}}: per stage, a time ("f", "i", "w", "b" and any other key) is the
    median over the ranks that measured it, a byte count ("mem_*", "static_bytes") the largest;
    None where none of them has a value. Why the median: this module's docstring."""
    out: dict = {}
    for stage in sorted({s for m in every for s in m}):
        rows = [m[stage] for m in every if stage in m]
        merged = {}
        for key in dict.fromkeys(k for r in rows for k in r):
            values = [r[key] for r in rows if r.get(key) is not None]
            if not values:
                merged[key] = None
            else:
                is_bytes = key.startswith("mem_") or key.endswith("bytes")
                merged[key] = max(values) if is_bytes else statistics.median(values)
        out[stage] = merged
    return out


def merge(every: list[RankMeasurements], num_stages: int, microbatches: int, rank: int) -> Measured:
    """The records of every rank (gather) as the pipeline's measurements; `rank` is this one.
    ScheduleError where the ranks disagree: other stage or microbatch counts, a stage measured
    by two ranks, in part, or by none."""
    costs, deltas = {}, {}
    for m in every:
        if m["num_stages"] != num_stages or m["microbatches"] != microbatches:
            raise _C.ScheduleError(
                f"ScheduleAuto: rank {m['rank']} measured num_stages={m['num_stages']}, "
                f"microbatches={m['microbatches']}; rank {rank} has {num_stages}, {microbatches}")
        for s in set(m["costs"]) | set(m["deltas"]):
            if s in costs:
                raise _C.ScheduleError(f"ScheduleAuto: stage {s} was measured by two ranks")
            if s not in m["costs"] or s not in m["deltas"]:
                raise _C.ScheduleError(f"ScheduleAuto: rank {m['rank']} measured stage {s} only in part")
            costs[s], deltas[s] = m["costs"][s], m["deltas"][s]
    if sorted(costs) != list(range(num_stages)):
        raise _C.ScheduleError(
            f"ScheduleAuto: the ranks measured stages {sorted(costs)}, want 0..{num_stages - 1}")
    # Each stage has one owner here, so the gather rule keeps its numbers as they are.
    costs = merge_stage_costs([m["costs"] for m in every])
    deltas = merge_stage_costs([m["deltas"] for m in every])
    return Measured(costs, deltas, max(m["comm_s"] for m in every),
                    [max(w) for w in zip(*(m["walls"] for m in every))])
