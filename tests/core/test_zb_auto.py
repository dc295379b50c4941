"""zb_auto: the cap holds under the memory model, programs validate, and it matches or beats
ZB-H1 (cap p) and ZB-H2 (cap 2p-1) on the bubble rate (its objective, the longest rank span) under
random per-stage costs; the refinement never makes its pick worse."""

import random

import pytest

import zbpipe

EPS = 1e-9


def sim(prog, costs, **memory):
    return zbpipe.simulate(prog, costs["f"], costs["b"], costs["w"], costs["comm"], **memory)


def random_case(rng):
    pp, m = rng.randint(2, 6), rng.randint(1, 16)
    costs = {
        "f": [rng.uniform(0.5, 2.0) for _ in range(pp)],
        "b": [rng.uniform(0.5, 2.0) for _ in range(pp)],
        "w": [rng.uniform(0.2, 2.0) for _ in range(pp)],
        "comm": rng.choice([0.0, 0.1, 0.5]),
    }
    return pp, m, costs


CASES = [random_case(random.Random(seed)) for seed in range(30)]


@pytest.mark.parametrize("pp,m,costs", CASES)
def test_matches_or_beats_zb_h1_and_zb_h2(pp, m, costs):
    for ref_name, cap in (("zb_h1", pp), ("zb_h2", 2 * pp - 1)):
        auto = zbpipe.compile("zb_auto", pp, m, memory_cap=cap, **costs)
        got, ref = sim(auto, costs), sim(zbpipe.compile(ref_name, pp, m), costs)
        assert max(got.peak_activations) <= cap
        assert max(got.span) <= max(ref.span) + EPS, (ref_name, max(got.span), max(ref.span))
        assert got.bubble_rate <= ref.bubble_rate + EPS, (ref_name, got.bubble_rate, ref.bubble_rate)
        # 1F1B is never better either (it is one of the candidates).
        f1b = sim(zbpipe.compile("1f1b", pp, m), costs)
        assert max(got.span) <= max(f1b.span) + EPS


def memory_case(rng):
    pp, m, costs = random_case(rng)
    mem_f = [rng.uniform(1.0, 3.0) for _ in range(pp)]
    memory = {"mem_f": mem_f, "mem_w": [x * rng.uniform(0.0, 1.0) for x in mem_f]}
    return pp, m, costs, memory, rng.uniform(1.0, 2.5) * pp * max(mem_f)


MEMORY_CASES = [memory_case(random.Random(100 + seed)) for seed in range(20)]


@pytest.mark.parametrize("pp,m,costs,memory,cap", MEMORY_CASES)
def test_the_cap_holds_under_the_memory_model_and_refining_never_hurts(pp, m, costs, memory, cap):
    plain = zbpipe.compile("zb_auto", pp, m, memory_cap=cap, refine=False, **memory, **costs)
    refined = zbpipe.compile("zb_auto", pp, m, memory_cap=cap, **memory, **costs)
    before, after = sim(plain, costs, **memory), sim(refined, costs, **memory)
    for res in (before, after):
        assert max(res.peak_memory) <= cap * (1 + 1e-9)
    assert after.bubble_rate <= before.bubble_rate + EPS
    assert after.makespan <= before.makespan + EPS


def test_i_frees_memory_so_the_same_cap_holds_more_microbatches():
    # The Zero Bubble paper's 1.5B model at m=24 and a cap of 2p forwards: I frees
    # M_B - M_W of each forward's M_B (Table 1: M_B = 34h + 5as, M_W = 32h), so ranks keep more
    # than 2p microbatches in flight (W deferred, each holding M_W) and the bubble is the
    # paper's 0.0433; counting every microbatch as whole until its W, the same cap gives 0.1015.
    pp, m, h, a = 8, 24, 2304, 24
    mem = {"mem_f": 34 * h + 5 * a * 1024, "mem_w": 32 * h}
    costs = {"f": 18.522, "b": 18.086, "w": 9.337, "comm": 0.601}
    cap = 2 * pp * mem["mem_f"]
    split = zbpipe.compile("zb_auto", pp, m, memory_cap=cap, refine=False, **mem, **costs)
    whole = zbpipe.compile("zb_auto", pp, m, memory_cap=2 * pp, refine=False, **costs)
    got = sim(split, costs, **mem)
    assert max(got.peak_memory) <= cap
    assert max(got.peak_activations) > 2 * pp
    assert got.bubble_rate == pytest.approx(0.0433, abs=5e-5)
    assert sim(whole, costs).bubble_rate == pytest.approx(0.1015, abs=5e-5)


def test_the_cap_is_in_mem_f_units():
    # Scaling mem_f, mem_w and the cap together builds the same program.
    pp, m = 4, 12
    costs = dict(f=[1.0, 1.3, 0.9, 1.1], b=[1.2, 1.0, 1.1, 0.9], w=0.6, comm=0.1)
    base = zbpipe.compile("zb_auto", pp, m, mem_f=1.0, mem_w=0.4, memory_cap=6, **costs)
    scaled = zbpipe.compile("zb_auto", pp, m, mem_f=2.5e6, mem_w=1e6, memory_cap=1.5e7, **costs)
    assert [base.actions(r) for r in range(pp)] == [scaled.actions(r) for r in range(pp)]


@pytest.mark.parametrize("pp,m", [(1, 1), (1, 4), (2, 1), (3, 2), (4, 8), (5, 3), (8, 24)])
def test_cap_holds_at_every_cap(pp, m):
    for cap in range(1, 2 * pp + 2):
        prog = zbpipe.compile("zb_auto", pp, m, memory_cap=cap)
        res = zbpipe.simulate(prog, 1.0, 1.0, 1.0)
        assert max(res.peak_activations) <= cap
        kinds = {a.kind for r in range(pp) for a in prog.action_values(r) if a.is_compute}
        assert kinds == {zbpipe.Kind.F, zbpipe.Kind.I, zbpipe.Kind.W}  # I/W split
        zbpipe._C.validate(prog)


def test_default_cap_is_pp_and_uses_it_better_than_1f1b():
    pp, m = 4, 12
    auto = zbpipe.simulate(zbpipe.compile("zb_auto", pp, m), 1.0, 1.0, 1.0)
    one = zbpipe.simulate(zbpipe.compile("1f1b", pp, m), 1.0, 1.0, 1.0)
    assert max(auto.peak_activations) == pp
    # ZB-H1's bubble at equal costs: about a third of 1F1B's.
    assert auto.bubble_rate < 0.5 * one.bubble_rate


def test_cap_2p_minus_1_removes_the_bubble_at_equal_costs():
    pp, m = 4, 12
    res = zbpipe.simulate(zbpipe.compile("zb_auto", pp, m, memory_cap=2 * pp - 1), 1.0, 1.0, 1.0)
    assert res.bubble_rate == pytest.approx(0.0, abs=1e-9)


def test_unequal_stages_beat_the_fixed_schedules():
    # Rank 1 twice as slow with cheap W and real comm latency: ZB-H1's fixed W placement
    # idles around it; the search strictly shortens both makespan and bubble.
    pp, m = 4, 8
    costs = {"f": [1, 2, 1, 1], "b": [1, 2, 1, 1], "w": [0.5] * 4, "comm": 0.5}
    got = sim(zbpipe.compile("zb_auto", pp, m, **costs), costs)
    for name in ("1f1b", "zb_h1"):
        ref = sim(zbpipe.compile(name, pp, m), costs)
        assert got.makespan < ref.makespan - 1e-6, name
        assert got.bubble_rate < ref.bubble_rate - 1e-6, name


def test_tighter_cap_never_helps():
    pp, m = 4, 12
    spans = [zbpipe.simulate(zbpipe.compile("zb_auto", pp, m, memory_cap=c), 1, 1, 1).makespan
             for c in range(1, 2 * pp)]
    assert all(a >= b - EPS for a, b in zip(spans, spans[1:]))
    assert spans[0] > spans[-1]


def test_deterministic():
    costs = dict(f=[1.0, 1.5, 0.7], b=[1.2, 0.9, 1.1], w=[0.4, 0.8, 0.6], comm=0.2)
    a = zbpipe.compile("zb_auto", 3, 9, **costs)
    b = zbpipe.compile("zb_auto", 3, 9, **costs)
    assert [a.actions(r) for r in range(3)] == [b.actions(r) for r in range(3)]


def test_errors_name_the_constraint():
    with pytest.raises(zbpipe.ScheduleError, match="memory_cap"):
        zbpipe.compile("zb_auto", 4, 8, memory_cap=-1)
    with pytest.raises(zbpipe.ScheduleError, match="stages_per_rank"):
        zbpipe.compile("zb_auto", 4, 8, stages_per_rank=2)
    with pytest.raises(zbpipe.ScheduleError, match="cost 'f'"):
        zbpipe.compile("zb_auto", 4, 8, f=[1.0, 2.0])
    with pytest.raises(zbpipe.ScheduleError, match="must hold at least one microbatch of stage 0"):
        zbpipe.compile("zb_auto", 4, 8, mem_f=2.0, memory_cap=1.5)
    with pytest.raises(zbpipe.ScheduleError, match="mem_w"):
        zbpipe.compile("zb_auto", 4, 8, mem_f=1.0, mem_w=2.0)
