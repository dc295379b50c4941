"""zbpipe.lower_bound (csrc/include/zbpipe/span_bound.h): no valid program's rank spans go below
it. Checked against every order of tiny pipelines (brute force), against every builder's program
under random costs and memory, and against closed forms where it is tight."""

import itertools
import random

import pytest

import zbpipe

EPS = 1e-9


def rank_orders(stage, m):
    """Every order of one stage's F, I and W over m microbatches with each kind in microbatch
    order and F before I before W for each microbatch."""
    kinds = "F" * m + "I" * m + "W" * m
    for perm in sorted(set(itertools.permutations(kinds))):
        seen = {"F": 0, "I": 0, "W": 0}
        order = []
        for k in perm:
            order.append((k, seen[k]))
            seen[k] += 1
        pos = {a: i for i, a in enumerate(order)}
        if all(pos[("F", j)] < pos[("I", j)] < pos[("W", j)] for j in range(m)):
            yield [f"{stage}{k}{j}" for k, j in order]


def optimum(pp, m, costs, memory, cap):
    """The least longest span over every valid program (one stage per rank) within cap."""
    best = None
    per_rank = [list(rank_orders(s, m)) for s in range(pp)]
    for ranks in itertools.product(*per_rank):
        try:
            prog = zbpipe.Program.from_actions([list(r) for r in ranks], list(range(pp)), m)
        except zbpipe.ScheduleError:  # deadlocks
            continue
        res = zbpipe.simulate(prog, **costs, **memory)
        if max(res.peak_memory) <= cap + EPS:
            best = max(res.span) if best is None else min(best, max(res.span))
    return best, prog


@pytest.mark.parametrize("pp,m,seed", [(2, 2, 0), (2, 2, 1), (2, 3, 2), (3, 2, 3), (2, 3, 4)])
def test_never_above_the_optimum_of_every_order(pp, m, seed):
    rng = random.Random(seed)
    costs = dict(f=[rng.uniform(0.5, 2.0) for _ in range(pp)],
                 b=[rng.uniform(0.5, 2.0) for _ in range(pp)],
                 w=[rng.uniform(0.1, 1.5) for _ in range(pp)], comm=rng.choice([0.0, 0.3]))
    memory = dict(mem_f=1.0, mem_w=rng.choice([None, 0.4]))
    cap = rng.choice([1.0, 1.5, 2.0])
    best, shape = optimum(pp, m, costs, memory, cap)
    bound = zbpipe.lower_bound(shape, **costs, **memory, memory_cap=cap)
    assert bound.max_span <= best + EPS


BUILT = [(name, seed) for name in zbpipe.schedule_names() if name != "inference"
         for seed in range(4)]


@pytest.mark.parametrize("name,seed", BUILT)
def test_every_builders_program_is_at_or_above_it(name, seed):
    rng = random.Random(100 + seed)
    pp, m = rng.randint(2, 5), rng.randint(2, 12)
    try:
        prog = zbpipe.compile(name, pp, m)
    except zbpipe.ScheduleError:
        prog = zbpipe.compile(name, pp, 2 * pp)
    n = prog.num_stages
    costs = dict(f=[rng.uniform(0.5, 2.0) for _ in range(n)],
                 b=[rng.uniform(0.5, 2.0) for _ in range(n)],
                 w=[rng.uniform(0.0, 1.5) for _ in range(n)], comm=rng.choice([0.0, 0.2, 1.0]))
    memory = dict(mem_f=[rng.uniform(1.0, 2.0) for _ in range(n)])
    memory["mem_w"] = [x * rng.uniform(0.0, 1.0) for x in memory["mem_f"]]
    res = zbpipe.simulate(prog, **costs, **memory)
    bound = zbpipe.lower_bound(prog, **costs, **memory)  # within the program's own peaks
    for r in range(pp):
        assert res.span[r] >= bound.span[r] - EPS * (1 + res.span[r]), r
    assert res.bubble_rate >= bound.bubble_rate - EPS


def test_chain_bound_closed_form():
    # A deep pipeline with few microbatches: rank 0's span is at least (p-1)(F+B+2c) + m(F+B) + W
    # whatever the memory, and 1F1B-sized forwards fill the warm-up, so that is the bound.
    pp, m, f, b, w, c = 8, 8, 1.0, 1.2, 0.3, 0.1
    prog = zbpipe.compile("zb_h1", pp, m)
    bound = zbpipe.lower_bound(prog, f=f, b=b, w=w, comm=c, memory_cap=2 * pp)
    assert bound.span[0] == pytest.approx((pp - 1) * (f + b + 2 * c) + m * (f + b) + w)


def test_idle_bound_closed_form():
    # At 1F1B's cap with I freeing nothing, rank 0 runs p forwards before its first I, which
    # waits for F + (p-1)(F+B+2c); after its last F it holds p-1 other microbatches, whose
    # backward work B+W each fills part of the same round trip.
    pp, m, f, b, w, c = 4, 16, 1.0, 1.0, 1.0, 0.0
    prog = zbpipe.compile("zb_h1", pp, m)
    bound = zbpipe.lower_bound(prog, f=f, b=b, w=w, comm=c, memory_cap=pp)
    trip = (pp - 1) * (f + b + 2 * c)
    start_idle = f + trip - pp * f
    end_idle = max(0.0, trip - (pp - 1) * (b + w))
    assert bound.span[0] == pytest.approx(m * (f + b + w) + start_idle + end_idle)
    # ZB-H1 reaches it: optimal at this cap.
    assert max(zbpipe.simulate(prog, f=f, b=b, w=w, comm=c).span) == pytest.approx(bound.max_span)


def test_bad_input_raises():
    with pytest.raises(zbpipe.ScheduleError, match="runs no backward"):
        zbpipe.lower_bound(zbpipe.compile("inference", 4, 8))
    prog = zbpipe.compile("zb_h1", 4, 8)
    with pytest.raises(zbpipe.ScheduleError, match="holds no microbatch"):
        zbpipe.lower_bound(prog, mem_f=2.0, memory_cap=1.0)
    with pytest.raises(zbpipe.ScheduleError, match="one per rank"):
        zbpipe.lower_bound(prog, memory_cap=[4.0, 4.0])
