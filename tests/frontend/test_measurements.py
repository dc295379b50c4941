"""zbpipe/tuning/measurements.py: merge() of the ranks' records (the pipeline's costs and deltas, the
largest hop, each timing step's slowest wall time, ScheduleAuto's errors where ranks disagree)
and boundary_bytes() without processes; hop_s() and gather() over a group of three Gloo ranks
(rank 2 only joins the barriers, yet gets rank 0's value), ScheduleAuto's ring_hop_s() over the
same group, and both in a group of one; the measuring recipe: the gather rule
(merge_stage_costs: median over the ranks, bytes the largest), the per-action median
(stage_costs.median_costs), the steps' order (StageTiming) and the bandwidth probe."""

from __future__ import annotations

import pytest

import zbpipe
from zbpipe.measurements import RankMeasurements, boundary_bytes, merge


def _record(rank, stages, num_stages=2, microbatches=4, comm_s=1e-4, walls=(1.0, 2.0)) -> RankMeasurements:
    return RankMeasurements(rank=rank, num_stages=num_stages, microbatches=microbatches,
                            costs={s: {"f": s + 1.0} for s in stages},
                            deltas={s: {"mem_f": 10 * (s + 1)} for s in stages}, comm_s=comm_s, walls=list(walls))


def test_the_gather_rule_is_the_median_over_ranks_and_the_largest_bytes():
    from zbpipe.measurements import merge_stage_costs

    every = [{0: {"f": 1.0, "b": None, "mem_f": 10}, 1: {"f": 7.0}},
             {0: {"f": 9.0, "b": None, "mem_f": 30}},
             {0: {"f": 2.0, "b": 4.0, "mem_f": 20}}]
    # Stage 0 by three ranks: the median time (a mean would give 4.0), the largest bytes, None
    # only where no rank has a value; stage 1 by its one owner, as it measured it.
    assert merge_stage_costs(every) == {0: {"f": 2.0, "b": 4.0, "mem_f": 30}, 1: {"f": 7.0}}


def test_action_costs_are_medians_so_one_slow_action_moves_nothing():
    from zbpipe.stage_costs import action_times, median_costs

    def rec(action, ms, wait_ms=0.0):
        return {"action": action, "host_start_ns": 0, "host_end_ns": int(ms * 1e6), "wait_ns": int(wait_ms * 1e6)}

    records = [rec("0F0", 2.0), rec("0F1", 2.0, wait_ms=1.0), rec("0F2", 3.0, wait_ms=1.0), rec("0F3", 40.0),
               rec("1B0", 5.0), rec("0SEND_F0", 9.0), rec("1F0+1B1", 9.0)]  # neither of the last two is one compute
    times = action_times(records)
    assert times == {0: {"f": [0.002, 0.001, 0.002, 0.04]}, 1: {"b": [0.005]}}
    assert median_costs(times) == {0: {"f": 0.002, "i": None, "w": None, "b": None},
                                   1: {"f": None, "i": None, "w": None, "b": 0.005}}


class _Sched:
    def __init__(self, name):
        self.name, self.measure_memory, self.probed = name, False, False

    def memory_profile(self):
        return {0: {"mem_f": 8, "mem_w": 4}} if self.probed else {}

    def trace(self):
        return [{"action": f"0{'B' if self.name == 'fused' else 'I'}0", "host_start_ns": 0, "host_end_ns": 1000}]

    @property
    def program(self):
        return self.name


def test_measure_stages_probes_then_alternates_split_and_fused():
    from zbpipe.measurements import measure_stages

    split, fused, ran = _Sched("split"), _Sched("fused"), []

    def run(sched):
        sched.probed |= sched.measure_memory
        ran.append((sched.name, sched.measure_memory))

    timing = measure_stages(split, fused, run, 4)
    assert ran == [("split", True), ("fused", False), ("split", False), ("fused", False), ("split", False),
                   ("fused", False)]  # the probe, the fused warm-up, four timed steps
    assert timing.deltas == {0: {"mem_f": 8, "mem_w": 4}} and timing.ran == ("split", "fused", "split", "fused")
    assert len(timing.walls) == 4 and not split.measure_memory
    assert timing.costs("host") == {0: {"f": None, "i": 1e-6, "w": None, "b": 1e-6}}
    ran.clear()
    measure_stages(split, None, run, 2)  # no fused schedule: every timed step is the split one
    assert ran == [("split", True), ("split", False), ("split", False)]


def test_merge_takes_every_stage_the_largest_hop_and_the_slowest_rank_per_step():
    m = merge([_record(0, [0], comm_s=1e-4, walls=(1.0, 5.0)), _record(1, [1], comm_s=3e-4, walls=(2.0, 4.0))],
              2, 4, rank=0)
    assert m.costs == {0: {"f": 1.0}, 1: {"f": 2.0}} and m.deltas == {0: {"mem_f": 10}, 1: {"mem_f": 20}}
    assert m.comm_s == 3e-4 and m.walls == [2.0, 5.0]


@pytest.mark.parametrize("records, message", [
    ([_record(0, [0]), _record(1, [1], num_stages=3)],
     "ScheduleAuto: rank 1 measured num_stages=3, microbatches=4; rank 0 has 2, 4"),
    ([_record(0, [0]), _record(1, [1], microbatches=8)],
     "ScheduleAuto: rank 1 measured num_stages=2, microbatches=8; rank 0 has 2, 4"),
    ([_record(0, [0, 1]), _record(1, [1])], "ScheduleAuto: stage 1 was measured by two ranks"),
    ([_record(0, [0]), {**_record(1, [1]), "deltas": {}}], "ScheduleAuto: rank 1 measured stage 1 only in part"),
    ([_record(0, [0]), _record(1, [])], "ScheduleAuto: the ranks measured stages [0], want 0..1"),
])
def test_merge_refuses_ranks_that_disagree(records, message):
    with pytest.raises(zbpipe.ScheduleError) as e:
        merge(records, 2, 4, rank=0)
    assert str(e.value) == message


def test_boundary_bytes_is_the_largest_output_of_a_local_stage_but_the_last():
    import torch

    class Stage:
        def __init__(self, index, last):
            self.stage_index, self.is_last = index, last

    class Sent:  # PipelineSchedule.output_specs: (shape, dtype) of each tensor a stage sent on
        def output_specs(self, stage_index):
            return {0: [((4, 8), torch.float32), ((2,), torch.int64)], 1: [((16, 8), torch.bfloat16)],
                    3: [((1000, 1000), torch.float32)]}[stage_index]

    assert boundary_bytes(Sent(), [Stage(0, False), Stage(1, False)]) == max(4 * 8 * 4 + 2 * 8, 16 * 8 * 2)
    assert boundary_bytes(Sent(), [Stage(0, False), Stage(3, True)]) == 4 * 8 * 4 + 2 * 8  # the last sends nothing on
    assert boundary_bytes(Sent(), [Stage(3, True)]) == 0


def _hops(rank, size):
    import torch
    import torch.distributed as dist

    from zbpipe.measurements import bandwidth_probe, gather, hop_s, ring_hop_s

    group = dist.new_group(list(range(size)), backend="gloo")
    singles = [dist.new_group([r], backend="gloo") for r in range(size)]
    hop = hop_s(1 << 16, torch.device("cpu"), group, reps=3)
    return dict(hop=hop, small=hop_s(4, torch.device("cpu"), group, reps=3),
                single=hop_s(1 << 16, torch.device("cpu"), singles[rank]), gathered=gather(rank * 10, group),
                ring=ring_hop_s(1 << 16, torch.device("cpu"), group),
                ring_single=ring_hop_s(1 << 16, torch.device("cpu"), singles[rank]),
                probe=bandwidth_probe(torch.device("cpu"), group),
                probe_single=bandwidth_probe(torch.device("cpu"), singles[rank]))


def test_hop_s_is_one_value_on_every_rank(spawn_world):
    results = spawn_world(3).run(_hops, timeout_s=120)
    assert all(r["hop"] == results[0]["hop"] > 0 and r["small"] == results[0]["small"] > 0 for r in results), results
    assert all(r["single"] == 0.0 for r in results), results  # a group of one: no hop
    assert all(r["gathered"] == [0, 10, 20] for r in results), results
    # ScheduleAuto's ring: one value everywhere too (rank 0's), none in a group of one.
    assert all(r["ring"] == results[0]["ring"] > 0 and r["ring_single"] == 0.0 for r in results), results


def test_the_bandwidth_probe_is_one_value_on_every_rank(spawn_world):
    results = spawn_world(3).run(_hops, timeout_s=120)
    probe = results[0]["probe"]
    assert all(r["probe"] == probe for r in results), results
    assert probe["large_s"] > 0 and probe["latency_s"] > 0 and 0 < probe["bandwidth_Bps"] < float("inf"), probe
    # The bandwidth is the bytes over the time they add to 4 bytes' (a lower bound where noise hides it).
    extra = probe["large_s"] - probe["latency_s"]
    want = ((4 << 20) - 4) / extra if extra > 0 else (4 << 20) / probe["large_s"]
    assert probe["bandwidth_Bps"] == pytest.approx(want), probe
    assert all(r["probe_single"] == {"latency_s": 0.0, "large_s": 0.0, "bandwidth_Bps": 0.0} for r in results)
