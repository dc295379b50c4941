"""The refinement pass (zbpipe.refine, csrc/include/zbpipe/refine.h) on any program: the result is
valid, holds the same actions, stays within the memory cap, and is never worse on makespan or
longest span; it improves programs that leave room, and the cap and the budget bind it."""

import pathlib
import random
import sys
from collections import Counter

import pytest

import zbpipe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_v_reference import CAP_UNITS, REFERENCE, v_costs  # noqa: E402

EPS = 1e-9
# The Zero Bubble paper's 1.5B costs per 1F1B stage, halved per V stage.
V_COSTS = dict(f=18.522 / 2, b=18.086 / 2, w=9.337 / 2, comm=0.601)


def random_costs(rng, stages):
    return dict(f=[rng.uniform(0.5, 2.0) for _ in range(stages)],
                b=[rng.uniform(0.5, 2.0) for _ in range(stages)],
                w=[rng.uniform(0.1, 1.5) for _ in range(stages)],
                comm=rng.choice([0.0, 0.1, 0.5]))


CASES = [(name, seed) for name in zbpipe.schedule_names() if name != "inference"
         for seed in range(3)]


@pytest.mark.parametrize("name,seed", CASES)
def test_valid_same_actions_within_the_cap_and_never_worse(name, seed):
    rng = random.Random(seed)
    pp, m = rng.randint(2, 4), rng.randint(4, 10)
    try:
        prog = zbpipe.compile(name, pp, m)
    except zbpipe.ScheduleError:
        prog = zbpipe.compile(name, pp, 2 * pp)
    costs = random_costs(rng, prog.num_stages)
    memory = dict(mem_f=1.0, mem_w=rng.choice([None, 0.3]))
    cap = rng.choice([None, 1.5 * pp])
    before = zbpipe.simulate(prog, **costs, **memory)
    if cap is not None and max(before.peak_memory) > cap:
        cap = None
    out = zbpipe.refine(prog, **costs, **memory, memory_cap=cap, budget=20_000)
    zbpipe._C.validate(out)
    after = zbpipe.simulate(out, **costs, **memory)
    for r in range(pp):
        assert Counter(out.compute_actions(r)) == Counter(prog.compute_actions(r))
        limit = before.peak_memory[r] if cap is None else cap
        assert after.peak_memory[r] <= limit + EPS
    assert after.makespan <= before.makespan + EPS
    assert max(after.span) <= max(before.span) + EPS


def test_it_lowers_v_half_below_its_search_at_the_v_papers_cap():
    # v_half's search pick at p=8, m=24 under the 1.5B costs equals the V paper's reference
    # V-Half (0.1702); refined within V-Half's cap of (p+2)//2 microbatches of both stages (10
    # units per rank) at the default budget (3M actions) it goes below it: 0.1671.
    prog = zbpipe.compile("v_half", 8, 24, refine=False, **V_COSTS)
    before = zbpipe.simulate(prog, **V_COSTS)
    out = zbpipe.refine(prog, **V_COSTS, memory_cap=10)
    after = zbpipe.simulate(out, **V_COSTS)
    assert before.bubble_rate == pytest.approx(0.1702, abs=5e-5)
    assert after.bubble_rate <= 0.1671 + 5e-5
    assert max(after.peak_activations) <= 10


def test_the_cap_binds():
    # zb_h1 at pp=4 with I freeing 3/4 of a forward: within its own peak (4) the refinement finds
    # nothing; one more unit of room lets it defer W and shorten the bubble.
    prog = zbpipe.compile("zb_h1", 4, 8)
    costs, memory = dict(f=1.0, b=1.0, w=1.0, comm=0.1), dict(mem_w=0.25)
    base = zbpipe.simulate(prog, **costs, **memory)
    tight = zbpipe.simulate(zbpipe.refine(prog, **costs, **memory), **costs, **memory)
    roomy = zbpipe.simulate(zbpipe.refine(prog, **costs, **memory, memory_cap=5), **costs, **memory)
    assert tight.bubble_rate == pytest.approx(base.bubble_rate)
    assert max(tight.peak_memory) <= 4
    assert roomy.bubble_rate < base.bubble_rate - 0.005
    assert 4 < max(roomy.peak_memory) <= 5


def test_the_budget_binds_and_the_result_is_deterministic():
    prog = zbpipe.compile("v_half", 8, 24, refine=False, **V_COSTS)
    none = zbpipe.refine(prog, **V_COSTS, memory_cap=10, budget=0)
    assert [none.actions(r) for r in range(8)] == [prog.actions(r) for r in range(8)]
    a = zbpipe.refine(prog, **V_COSTS, memory_cap=10)
    b = zbpipe.refine(prog, **V_COSTS, memory_cap=10)
    assert [a.actions(r) for r in range(8)] == [b.actions(r) for r in range(8)]


def test_makespan_objective():
    prog = zbpipe.compile("gpipe", 4, 8)
    costs = dict(f=[1.0, 1.5, 0.8, 1.2], b=1.1, w=0.7, comm=0.2)
    before = zbpipe.simulate(prog, **costs)
    after = zbpipe.simulate(zbpipe.refine(prog, **costs, objective="makespan"), **costs)
    assert after.makespan < before.makespan - 0.5
    with pytest.raises(zbpipe.ScheduleError, match="objective must be"):
        zbpipe.refine(prog, objective="bubble")


def test_overlapped_programs_come_back_unchanged():
    prog = zbpipe.compile("dualpipev", 4, 8)
    out = zbpipe.refine(prog, f=1.0, b=2.0, w=0.5)
    assert [out.actions(r) for r in range(4)] == [prog.actions(r) for r in range(4)]


# bench_v_reference.py's "refine 3M" and "bound" columns (docs/schedules.md), to 4 decimals:
# zbpipe.refine at its default budget on v_half's / v_min's search pick within the V paper's
# cap, and the lower bound there. The bound is loose for V (half the figures or less).
V_REFINED_AND_BOUND = {
    ("v_half", 8, 24, "1.5B m=24"): (0.1671, 0.0790), ("v_half", 8, 32, "1.5B m=32"): (0.1313, 0.0606),
    ("v_half", 8, 64, "1.5B m=64"): (0.0726, 0.0319), ("v_half", 16, 48, "14.6B m=48"): (0.1682, 0.0704),
    ("v_min", 8, 24, "1.5B m=24"): (0.3323, 0.0958), ("v_min", 8, 32, "1.5B m=32"): (0.3080, 0.0741),
    ("v_min", 8, 64, "1.5B m=64"): (0.2747, 0.0397), ("v_min", 16, 48, "14.6B m=48"): (0.2914, 0.1163),
    ("v_half", 8, 32, "1.5B m=24"): (0.1308, 0.0604), ("v_half", 8, 64, "1.5B m=24"): (0.0704, 0.0311),
    ("v_half", 16, 48, "1.5B m=24"): (0.1902, 0.0882), ("v_min", 8, 32, "1.5B m=24"): (0.3065, 0.0736),
    ("v_min", 8, 64, "1.5B m=24"): (0.2642, 0.0382), ("v_min", 16, 48, "1.5B m=24"): (0.3476, 0.1326),
}


@pytest.mark.parametrize("name,pp,m,row,reference", REFERENCE)
def test_v_reference_cells_refined_and_bounded(name, pp, m, row, reference):
    costs, cap = v_costs(row), CAP_UNITS[name](pp)
    searched = zbpipe.compile(name, pp, m, refine=False, **costs)
    compiled = zbpipe.simulate(zbpipe.compile(name, pp, m, **costs), **costs)
    out = zbpipe.refine(searched, **costs, memory_cap=cap)
    refined = zbpipe.simulate(out, **costs)
    bound = zbpipe.lower_bound(searched, **costs, memory_cap=cap).bubble_rate
    want_refined, want_bound = V_REFINED_AND_BOUND[(name, pp, m, row)]
    assert refined.bubble_rate == pytest.approx(want_refined, abs=5e-5)
    assert bound == pytest.approx(want_bound, abs=5e-5)
    # Never behind the reference or compile's own (smaller-budget) refinement, within the cap.
    assert bound <= refined.bubble_rate <= min(reference + 1e-6, compiled.bubble_rate + 1e-9)
    assert max(refined.peak_activations) <= cap
