"""The core's partition planner (csrc/core/partition.cpp) on its own: even bounds, one split
scored (stage sums, the first stage's backward all in W, static bytes on the rank that holds
each stage), bad input refused."""

from __future__ import annotations

import pytest

import zbpipe
from zbpipe import _C


def _units(n, static=None, **over):
    vals = dict(f=[1.0] * n, i=[1.0] * n, w=[1.0] * n, b=[], mem_f=[1.0] * n, mem_w=[0.5] * n,
                static_bytes=static or [0.0] * n)
    vals.update(over)
    return _C.UnitProfile(**vals)


def test_even_bounds_give_the_first_stages_the_remainder():
    assert _C.even_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert _C.even_bounds(4, 4) == [0, 1, 2, 3, 4]
    with pytest.raises(zbpipe.ScheduleError, match="3 units cannot fill 4 stages"):
        _C.even_bounds(3, 4)


def test_a_split_scores_as_the_simulator_on_summed_stages():
    prog = zbpipe.compile("zbv", 2, 4)
    f = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    units = _units(6, static=[0, 0, 0, 0, 0, 100.0], f=f)
    score = _C.score_split(prog, units, [0, 1, 3, 4, 6])
    # stage 0 takes the microbatch, which needs no gradient: no I there, W does it all
    res = zbpipe.simulate(prog, f=[1.0, 5.0, 4.0, 11.0], b=[0, 2, 1, 2], w=[2, 2, 1, 2],
                          mem_f=[1, 2, 1, 2], mem_w=[1, 1, 0.5, 1])
    assert score.makespan == pytest.approx(res.makespan)
    # zbv puts stage 3 (which holds the last unit's static bytes) on rank 0, with stage 0
    assert prog.stage_to_rank[3] == 0
    assert score.peak_bytes == pytest.approx([res.peak_memory[0] + 100.0, res.peak_memory[1]])
    assert not _C.score_split(prog, units, [0, 1, 3, 4, 6], memory_budget=50.0).fits


def test_bad_bounds_and_units_are_refused():
    prog = zbpipe.compile("1f1b", 2, 2)
    with pytest.raises(zbpipe.ScheduleError, match="stage 1 is empty"):
        _C.score_split(prog, _units(3), [0, 3, 3])
    with pytest.raises(zbpipe.ScheduleError, match="3 bounds for 2 stages"):
        _C.score_split(prog, _units(3), [0, 3])
    with pytest.raises(zbpipe.ScheduleError, match="finite and >= 0"):
        _C.plan_partition([prog], _units(3, f=[1.0, -1.0, 1.0]))
    with pytest.raises(zbpipe.ScheduleError, match="every unit field needs 3 values"):
        _C.plan_partition([prog], _units(3, i=[1.0]))
    with pytest.raises(zbpipe.ScheduleError, match="4 stages but there are only 3 units"):
        _C.plan_partition([zbpipe.compile("zbv", 2, 2)], _units(3))
