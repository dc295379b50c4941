"""v_half / v_min: V topology, 2 stages per rank, I/W split, peak activations within the
paper's bounds, the memory/bubble trade-off against zbv and 1f1b in the simulator, the
reference implementation's figures reproduced (the paper's post-passes over the block, with
refine=False), and the default build's refinement below them.

Units: the simulator counts (stage, microbatch); a V chunk holds half a 1F1B stage's
activations, so a V schedule's peak in 1F1B microbatches is units / 2."""

import pathlib
import random
import sys

import pytest

import zbpipe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
# The reference's figures, the block as laid out, and the paper's memory bounds (1F1B
# microbatches times 2 chunks) live with the benchmark that prints them.
from bench_v_reference import (  # noqa: E402
    CAP_UNITS as BOUND_UNITS, COSTS_1_5B, REFERENCE, REFERENCE_SWEEP, block_layout, v_costs)


def sim_model(prog, f=1.0, b=1.0, w=1.0, comm=0.0):
    """Simulates the same model under every schedule: a stage of a k-stages-per-rank schedule
    costs 1/k of a 1F1B stage. Returns the result and the peak in 1F1B microbatches."""
    k = prog.num_stages // prog.pp
    res = zbpipe.simulate(prog, f / k, b / k, w / k, comm)
    return res, max(res.peak_activations) / k


@pytest.mark.parametrize("name", ["v_half", "v_min"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6, 8, 12])
def test_shape_and_memory_bound(name, pp):
    for m in (1, pp, 2 * pp + 1, 3 * pp):
        prog = zbpipe.compile(name, pp, m)
        assert prog.num_stages == 2 * pp
        assert prog.stage_to_rank == list(range(pp)) + list(reversed(range(pp)))
        kinds = {a.kind for r in range(pp) for a in prog.action_values(r) if a.is_compute}
        assert kinds <= {zbpipe.Kind.F, zbpipe.Kind.I, zbpipe.Kind.W}
        res = zbpipe.simulate(prog, 1.0, 1.0, 1.0)
        assert max(res.peak_activations) <= BOUND_UNITS[name](pp), (m, res.peak_activations)


@pytest.mark.parametrize("pp,m", [(4, 12), (6, 18), (8, 24)])
def test_memory_bubble_trade_off(pp, m):
    r = {n: sim_model(zbpipe.compile(n, pp, m)) for n in ("1f1b", "zbv", "v_half", "v_min")}
    peak = {n: v[1] for n, v in r.items()}
    bubble = {n: v[0].bubble_rate for n, v in r.items()}
    # Memory: v_min < v_half < zbv == 1f1b (= pp 1F1B microbatches).
    assert peak["1f1b"] == pp and peak["zbv"] == pp
    assert peak["v_min"] < peak["v_half"] < peak["zbv"]
    assert peak["v_half"] <= (pp + 2) // 2 and peak["v_min"] <= (pp + 4) // 3
    # Bubble: zbv <= v_half <= v_min, and both V schedules below 1F1B's.
    assert bubble["zbv"] <= bubble["v_half"] + 1e-9 <= bubble["v_min"] + 2e-9
    assert bubble["v_min"] < bubble["1f1b"]


def test_bubble_shrinks_with_microbatches():
    # The block repeats without a steady-state bubble: the bubble is warm-up/cool-down only.
    for name in ("v_half", "v_min"):
        rates = [sim_model(zbpipe.compile(name, 8, m))[0].bubble_rate for m in (16, 32, 64)]
        assert rates[0] > rates[1] > rates[2]
        assert rates[2] < 0.1


def test_random_costs_keep_the_bound_and_validate():
    rng = random.Random(0)
    for _ in range(10):
        pp, m = rng.randint(2, 6), rng.randint(1, 12)
        costs = {k: [rng.uniform(0.3, 2.0) for _ in range(2 * pp)] for k in ("f", "b", "w")}
        for name in ("v_half", "v_min"):
            prog = zbpipe.compile(name, pp, m, comm=0.2, **costs)
            zbpipe._C.validate(prog)
            res = zbpipe.simulate(prog, costs["f"], costs["b"], costs["w"], 0.2)
            assert max(res.peak_activations) <= BOUND_UNITS[name](pp)


def test_fixed_parameters_are_rejected():
    with pytest.raises(zbpipe.ScheduleError, match="stages_per_rank"):
        zbpipe.compile("v_half", 4, 8, stages_per_rank=3)
    # A cap below one microbatch of both of a rank's stages (here 2 units) is refused.
    with pytest.raises(zbpipe.ScheduleError, match="needs memory_cap >= 2 on rank 0"):
        zbpipe.compile("v_min", 4, 8, memory_cap=1.5)
    # Its own cap is the default program.
    own = zbpipe.compile("v_min", 4, 8, memory_cap=BOUND_UNITS["v_min"](4))
    assert own.to_csv_text() == zbpipe.compile("v_min", 4, 8).to_csv_text()


# The controllable-memory paper's summary (Qi et al. 2024, at T_F = T_B = T_W): activation
# memory (p+2)//2 (V-Half) and (p+4)//3 (V-Min) microbatches against 1F1B's p, and bubbles of
# about p/(2m) and 2p/(3m), read as bubble time over the work m(T_F+T_B+T_W) (1F1B's (p-1)/m).
@pytest.mark.parametrize("pp", [4, 6, 8, 12, 16])
def test_paper_memory_is_reached_exactly(pp):
    for name, bound in (("v_half", (pp + 2) // 2), ("v_min", (pp + 4) // 3)):
        _, peak = sim_model(zbpipe.compile(name, pp, 3 * pp))
        assert peak == bound, name


def bubble_over_work(name, pp, m):
    res, _ = sim_model(zbpipe.compile(name, pp, m))
    return (max(res.span) - 3 * m) / (3 * m)


@pytest.mark.parametrize("pp", [3, 4, 6, 8, 12, 16, 24, 32])
def test_paper_bubble_figures(pp):
    for m in (2 * pp, 4 * pp):
        assert bubble_over_work("1f1b", pp, m) == pytest.approx((pp - 1) / m)
        # Both at or below the paper's figure everywhere. V-Half needs the warm-up / cool-down
        # reordering for it: the block laid out as is misses p/(2m) by up to a sixth.
        assert bubble_over_work("v_min", pp, m) <= 2 * pp / (3 * m) + 1e-9
        assert bubble_over_work("v_half", pp, m) <= pp / (2 * m) + 1e-9


# docs/schedules.md's unit-cost table: (p, m) -> bubble over work of v_half, v_min, to 3
# decimals, and their peaks in 1F1B microbatches.
UNIT_COST_TABLE = {(4, 16): (0.052, 0.115, 3, 2), (8, 32): (0.089, 0.141, 5, 4),
                   (16, 64): (0.107, 0.154, 9, 6), (32, 128): (0.116, 0.160, 17, 12)}


@pytest.mark.parametrize("pp,m", sorted(UNIT_COST_TABLE))
def test_unit_cost_table(pp, m):
    half, low, half_mb, low_mb = UNIT_COST_TABLE[(pp, m)]
    assert bubble_over_work("v_half", pp, m) == pytest.approx(half, abs=5e-4)
    assert bubble_over_work("v_min", pp, m) == pytest.approx(low, abs=5e-4)
    assert sim_model(zbpipe.compile("v_half", pp, m))[1] == half_mb
    assert sim_model(zbpipe.compile("v_min", pp, m))[1] == low_mb


def test_v_min_under_the_zb_paper_costs_trails_1f1b():
    # Unequal pass times (the Zero Bubble paper's 1.5B model: W about half of F and B) leave
    # V-Min's chain no slack, so its repeating block stretches: its makespan is 14% above
    # 1F1B's at p=8, m=24 and the gap grows with m. V-Half keeps ahead of 1F1B (0.91x at m=24).
    # The README says when to pick which; this pins the numbers it gives.
    f, b, w, c = 18.522, 18.086, 9.337, 0.601
    one = {m: zbpipe.simulate(zbpipe.compile("1f1b", 8, m), f, b, w, c).makespan for m in (24, 64)}
    for name, lo, hi in (("v_min", 1.13, 1.15), ("v_half", 0.91, 0.92)):
        costs = dict(f=f / 2, b=b / 2, w=w / 2, comm=c)
        got = zbpipe.simulate(zbpipe.compile(name, 8, 24, **costs), **costs).makespan
        assert lo < got / one[24] < hi, name
    costs = dict(f=f / 2, b=b / 2, w=w / 2, comm=c)
    at_64 = zbpipe.simulate(zbpipe.compile("v_min", 8, 64, **costs), **costs).makespan
    assert at_64 / one[64] > 1.19
    # At equal costs V-Min is ahead of 1F1B (the paper's setting).
    assert sim_model(zbpipe.compile("v_min", 8, 24))[0].makespan < \
        zbpipe.simulate(zbpipe.compile("1f1b", 8, 24)).makespan


# --- The reference implementation's figures (benchmarks/bench_v_reference.py says where they
# come from: sail-sg's V-Half / V-Min greedy with its reordering and squeeze, under the Zero
# Bubble paper's Table 6 costs). The block laid out as is (zbpipe before its post-passes) gives
# 0.2011 / 0.1592 / 0.0879 / 0.1902 (V-Half) and 0.3361 / 0.3110 / 0.2761 / 0.2933 (V-Min) on
# the four Table 6 rows.


def built_under(name, pp, m, costs, **options):
    prog = zbpipe.compile(name, pp, m, **costs, **options)
    return prog, zbpipe.simulate(prog, **costs)


@pytest.mark.parametrize("name,pp,m,row,reference", REFERENCE)
def test_reference_figures_are_reproduced(name, pp, m, row, reference):
    # The post-passes rebuild the reference's program: the same bubble to float noise, at the
    # paper's memory (the reference counts memory as the simulator does: F +1, W -1).
    _, res = built_under(name, pp, m, v_costs(row), refine=False)
    assert res.bubble_rate == pytest.approx(reference, abs=1e-6)
    assert max(res.peak_activations) == BOUND_UNITS[name](pp)


# The default build (refined inside compile, 1M actions) to 4 decimals where it beats the
# reference; every other reference cell it equals (bench_v_reference.py prints them all).
REFINED = {("v_half", 8, 24, "1.5B m=24"): 0.1687, ("v_half", 8, 32, "1.5B m=32"): 0.1328,
           ("v_min", 8, 24, "1.5B m=24"): 0.3323, ("v_min", 8, 32, "1.5B m=32"): 0.3085,
           ("v_half", 8, 32, COSTS_1_5B): 0.1322, ("v_min", 8, 32, COSTS_1_5B): 0.3071,
           ("v_min", 16, 48, COSTS_1_5B): 0.3476}


@pytest.mark.parametrize("name,pp,m,row,reference", REFERENCE)
def test_refined_inside_compile_never_worse_and_below_the_reference(name, pp, m, row, reference):
    # compile()'s refinement (refine=True, the default) on its own pick: never behind it on
    # makespan or bubble, within the paper's memory, and below the reference on the cells of
    # REFINED (V-Half at p=8, m=24: 0.1687 < 0.1702, issue #20's target).
    costs = v_costs(row)
    _, plain = built_under(name, pp, m, costs, refine=False)
    prog, res = built_under(name, pp, m, costs)
    zbpipe._C.validate(prog)
    assert res.makespan <= plain.makespan + 1e-9
    assert res.bubble_rate <= plain.bubble_rate + 1e-9
    assert max(res.peak_activations) <= BOUND_UNITS[name](pp)
    expected = REFINED.get((name, pp, m, row), reference)
    assert res.bubble_rate == pytest.approx(expected, abs=5e-5)
    if (name, pp, m, row) in REFINED:
        assert res.bubble_rate < reference - 5e-4


@pytest.mark.parametrize("name", ["v_half", "v_min"])
@pytest.mark.parametrize("pp", sorted(REFERENCE_SWEEP["v_half"]))
def test_at_or_below_the_reference(name, pp):
    for m, reference in zip((pp, 2 * pp, 3 * pp), REFERENCE_SWEEP[name][pp]):
        _, res = built_under(name, pp, m, v_costs(COSTS_1_5B))
        assert res.bubble_rate <= reference + 1e-6, m


@pytest.mark.parametrize("pp", range(4, 33))
def test_post_passes_beat_the_block_for_every_size(pp):
    # Valid, within the paper's memory, never behind the block laid out as is (zbpipe's program
    # before the post-passes), and V-Half clearly ahead of it (V-Min gains less: its block
    # leaves its ramps few free slots).
    costs = v_costs(COSTS_1_5B)
    for name in ("v_half", "v_min"):
        prog, res = built_under(name, pp, 2 * pp, costs)
        zbpipe._C.validate(prog)
        assert max(res.peak_activations) <= BOUND_UNITS[name](pp)
        block = zbpipe.simulate(block_layout(name, pp, 2 * pp), **costs)
        assert res.makespan <= block.makespan + 1e-9 and res.bubble_rate <= block.bubble_rate + 1e-9
        if name == "v_half":
            assert res.bubble_rate < block.bubble_rate - 0.005, (pp, res.bubble_rate, block.bubble_rate)


@pytest.mark.parametrize("name", ["v_half", "v_min"])
def test_under_a_budget_zbv_fits_never_behind_zbv(name):
    # ScheduleAuto and plan_partition plan v_half / v_min under a budget of zbv's own peak: on
    # uneven measured costs the blocks' search alone landed up to 3.9% behind zbv (this seed's
    # worst); with zbv's order among its seeds it never is.
    rng = random.Random(0)
    for _ in range(60):
        pp, m = rng.choice([2, 3, 4]), rng.choice([4, 6, 8])
        f = [rng.uniform(0.5, 3) for _ in range(2 * pp)]
        mem = [rng.uniform(0.5, 3) for _ in range(2 * pp)]
        model = dict(f=f, b=[x * rng.uniform(0.8, 1.5) for x in f], w=[x * rng.uniform(0.3, 1.2) for x in f],
                     comm=0.05, mem_f=mem, mem_w=[x / 2 for x in mem])
        zbv = zbpipe.simulate(zbpipe.compile("zbv", pp, m, 2), **model)
        cap = max(zbv.peak_memory)
        planned = zbpipe.simulate(zbpipe.compile(name, pp, m, 2, memory_cap=cap, **model), **model)
        assert planned.makespan <= zbv.makespan * (1 + 1e-9), (pp, m, planned.makespan, zbv.makespan)
        assert max(planned.peak_memory) <= cap * (1 + 1e-9)
