"""What a tuning measures, per rank and over the pipeline group (zbpipe.ScheduleAuto): one
rank's record (its stages' action times from the timing steps' traces, their memory deltas,
the P2P hop, each timing step's wall time), the one-way time of a message between two ranks
(also `zbpipe bench`'s hop), and the gather and merge of the records over the group, so every
rank plans from identical inputs (zbpipe/auto_plan.py).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from . import _C


class RankMeasurements(TypedDict):
    """One rank's measurements of a tuning, as all_gather_object sends them."""
    rank: int
    num_stages: int
    microbatches: int
    costs: dict   # {stage: {"f", "i", "w", "b": seconds or None}} (profile_from_trace), local stages
    deltas: dict  # {stage: {"mem_f", "mem_w": bytes}} (memory_profile()), local stages
    comm_s: float  # one hop of a boundary-sized message (ring_hop_s), the same on every rank
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


def hop_s(nbytes: int, device: torch.device, group: Any = None, reps: int = 20) -> float:
    """One-way time of a message of `nbytes` between ranks 0 and 1 of `group` (None: the world):
    half the median round trip of `reps` ping-pongs after two to warm up, each after a barrier
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


# The tag of ring_hop_s's token: the executor's messages on the pipeline group never use it
# (they are tagged by action), and none is in flight between steps, when a tuning measures.
RING_TAG = 77


def ring_hop_s(nbytes: int, device: torch.device, group: Any, loops: int = 5) -> float:
    """One hop of a message of `nbytes` on the pipeline `group`: group rank 0 passes a token
    round the ring (each rank receives, then sends on) and times the loop, so no rank's late
    start is counted; the median of `loops` loops after one to warm up, over pp hops. Group
    rank 0's value on every rank, 0.0 in a group of one. ScheduleAuto's comm (hop_s's
    ping-pong between two ranks, each try after a barrier, reads about twice as long on a
    2-core host: docs/autotune.md)."""
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
    return Measured(costs, deltas, max(m["comm_s"] for m in every),
                    [max(w) for w in zip(*(m["walls"] for m in every))])
