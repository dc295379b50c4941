"""zb_auto: the cap holds, programs validate, and it matches or beats ZB-H1 (cap p) and ZB-H2
(cap 2p-1) on both makespan and bubble under random per-stage costs."""

import random

import pytest

import zbpipe

EPS = 1e-9


def sim(prog, costs):
    return zbpipe.simulate(prog, costs["f"], costs["b"], costs["w"], costs["comm"])


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
        assert got.makespan <= ref.makespan + EPS, (ref_name, got.makespan, ref.makespan)
        assert got.bubble_rate <= ref.bubble_rate + EPS, (ref_name, got.bubble_rate, ref.bubble_rate)
        # 1F1B is never better either (it is one of the candidates).
        f1b = sim(zbpipe.compile("1f1b", pp, m), costs)
        assert got.makespan <= f1b.makespan + EPS


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
