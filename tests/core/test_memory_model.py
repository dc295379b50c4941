"""The memory model (csrc/include/zbpipe/memory_model.h) as the simulator applies it: F adds mem_f
when it starts, a full B frees it when it ends, I frees mem_f - mem_w and W frees mem_w when they
end; mem_w=None is mem_w = mem_f. Checked against numbers derived by hand and against the runtime's
measured peaks (issue #20), not against itself."""

import pytest

import zbpipe


def one_stage(order, m):
    """A one-rank program from a compute order such as "F0 F1 I0 W0"."""
    return zbpipe.Program.from_actions([[f"0{a}" for a in order.split()]], [0], m)


def test_default_model_is_the_activation_count():
    # mem_w unset: I frees nothing, W frees all, so peak memory is the microbatch count.
    for name in zbpipe.schedule_names():
        res = zbpipe.simulate(zbpipe.compile(name, 4, 8))
        assert res.peak_memory == [float(p) for p in res.peak_activations], name


def test_zb_h1_peaks_match_the_runtimes_measured_bytes():
    # The measurement on pp=4 stages of Linear, Tanh, Linear: W frees 2/3 of a forward's
    # bytes on every stage whose input carries a gradient, all of it on stage 0 (its I does
    # nothing); the runtime peaked at 4, 3.67, 3.33, 3 units on zb_h1.
    res = zbpipe.simulate(zbpipe.compile("zb_h1", 4, 8), mem_f=1.0, mem_w=[1.0, 2 / 3, 2 / 3, 2 / 3])
    assert res.peak_memory == pytest.approx([4.0, 11 / 3, 10 / 3, 3.0])
    assert res.peak_activations == [4, 4, 4, 4]  # unchanged: microbatches live until their W


def test_i_frees_its_share_at_its_end_and_w_the_rest():
    # F0 F1 I0 F2 W0 I1 W1 I2 W2 with mem_f=2, mem_w=0.5: held 2, 4, 2.5 (I0 frees 1.5),
    # 4.5 (F2), 4, 2.5, 2, 0.5, 0.
    prog = one_stage("F0 F1 I0 F2 W0 I1 W1 I2 W2", 3)
    res = zbpipe.simulate(prog, mem_f=2.0, mem_w=0.5)
    assert res.peak_memory == pytest.approx([4.5])
    assert res.peak_activations == [3]
    # The same order with mem_w = mem_f: I frees nothing, so F2 comes on top of two units.
    assert zbpipe.simulate(prog, mem_f=2.0).peak_memory == pytest.approx([6.0])


def test_a_full_backward_frees_everything_whatever_mem_w():
    prog = zbpipe.compile("1f1b", 4, 8)
    for mem_w in (None, 0.0, 0.3):
        res = zbpipe.simulate(prog, mem_f=3.0, mem_w=mem_w)
        assert res.peak_memory == pytest.approx([3.0 * p for p in res.peak_activations])


def test_per_stage_values():
    prog = zbpipe.compile("zb_h1", 2, 4)
    res = zbpipe.simulate(prog, mem_f=[1.0, 10.0], mem_w=[0.5, 0.0])
    # Rank 1 (last stage) runs F I F I ... with I freeing all 10 of it (mem_w=0): peak 10.
    assert res.peak_memory[1] == pytest.approx(10.0)
    assert res.peak_memory[0] == pytest.approx(2.0)  # two forwards before stage 0's first I


@pytest.mark.parametrize("kwargs,match", [
    (dict(mem_f=[1.0, 2.0, 3.0]), "mem_f' needs 1 value or one per stage"),
    (dict(mem_f=0.0), "mem_f' must be positive"),
    (dict(mem_f=1.0, mem_w=1.5), r"mem_w' must lie in \[0, mem_f\]"),
    (dict(mem_f=1.0, mem_w=-0.1), r"mem_w' must lie in \[0, mem_f\]"),
])
def test_bad_memory_raises(kwargs, match):
    with pytest.raises(zbpipe.ScheduleError, match=match):
        zbpipe.simulate(zbpipe.compile("zb_h1", 2, 4), **kwargs)


@pytest.mark.parametrize("name,units", [("v_half", lambda p: 2 * ((p + 2) // 2)),
                                        ("v_min", lambda p: 2 * ((p + 4) // 3))])
def test_v_schedules_hold_their_paper_cap_or_the_one_given(name, units):
    # A V rank's cap is (its paper bound) microbatches of both its stages: units/2 * (mem_f of
    # the two), here 2.0 per stage, and I frees half a forward.
    pp, m = 4, 12
    costs = dict(f=[1.0, 1.2, 0.9, 1.1, 1.0, 0.8, 1.3, 1.0], b=1.1, w=0.5, comm=0.1)
    memory = dict(mem_f=2.0, mem_w=1.0)
    cap = units(pp) * 2.0
    prog = zbpipe.compile(name, pp, m, **memory, **costs)
    assert max(zbpipe.simulate(prog, **costs, **memory).peak_memory) <= cap
    # Its own cap, given, is the default program.
    assert zbpipe.compile(name, pp, m, memory_cap=cap, **memory, **costs).to_csv_text() == prog.to_csv_text()
    # Another cap is searched under (the block layouts seed the search where they fit): held,
    # and a lower cap never gives a shorter step.
    lower = zbpipe.compile(name, pp, m, memory_cap=cap - 2.0, **memory, **costs)
    res = zbpipe.simulate(lower, **costs, **memory)
    assert max(res.peak_memory) <= cap - 2.0
    assert res.makespan >= zbpipe.simulate(prog, **costs, **memory).makespan - 1e-9
    # One microbatch of both stages of a rank is the least a V cap can be.
    with pytest.raises(zbpipe.ScheduleError, match=r"needs memory_cap >= 4 on rank 0 \(one microbatch of both"):
        zbpipe.compile(name, pp, m, memory_cap=3.9, **memory, **costs)
