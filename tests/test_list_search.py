"""The cost-driven builders' fast search (grid points merged when no knob check tells them apart,
runs stopped at the best makespan so far, scores from the scheduler's own timing) picks exactly
the program the exhaustive grid picks: every point run to the end and scored by zbpipe.simulate."""

import random

import pytest

import zbpipe
from zbpipe import _C


def random_case(rng, name):
    pp, m = rng.randint(1, 6), rng.randint(1, 14)
    k = 1 if name == "zb_auto" else 2
    costs = {
        "f": [rng.uniform(0.3, 2.0) for _ in range(k * pp)],
        "b": [rng.uniform(0.3, 2.0) for _ in range(k * pp)],
        "w": [rng.uniform(0.1, 2.0) for _ in range(k * pp)],
        "comm": rng.choice([0.0, 0.05, 0.3, 1.0]),
    }
    if name == "zb_auto":
        costs["memory_cap"] = rng.randint(1, 2 * pp + 1)
    return pp, m, costs


CASES = [(name, *random_case(random.Random(1000 * i + j), name))
         for j, name in enumerate(("zb_auto", "v_half", "v_min")) for i in range(25)]


def long_zb_auto_case(rng):
    # Deeper pipelines and more microbatches than random_case: the drain bound (a one-stage
    # rank's last round trip) stops runs long before their end here.
    pp = rng.randint(4, 10)
    m = rng.randint(pp, 4 * pp)
    f, b = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
    costs = {"f": [f * rng.uniform(0.8, 1.2) for _ in range(pp)],
             "b": [b * rng.uniform(0.8, 1.2) for _ in range(pp)],
             "w": [rng.uniform(0.1, 1.5) for _ in range(pp)],
             "comm": rng.choice([0.0, 0.05, 0.3]),
             "memory_cap": rng.choice([pp, pp + 1, 2 * pp - 1, max(1, pp // 2)])}
    return pp, m, costs


CASES += [("zb_auto", *long_zb_auto_case(random.Random(7000 + i))) for i in range(40)]


def programs(prog):
    return [prog.compute_actions(r) for r in range(prog.pp)]


@pytest.mark.parametrize("name,pp,m,options", CASES)
def test_fast_search_picks_the_exhaustive_pick(name, pp, m, options):
    fast = _C.compile(name, pp, m, **options)
    full = _C.compile(name, pp, m, exhaustive_search=True, **options)
    assert programs(fast) == programs(full)


@pytest.mark.parametrize("name", ["zb_auto", "v_half", "v_min"])
def test_equal_costs_and_larger_sizes(name):
    # Equal costs make many grid points build the same program (the merging path); the 1.5B
    # costs make most of them differ (the bound path).
    k = 1 if name == "zb_auto" else 2
    for pp, m, costs in [(8, 24, {}), (8, 24, dict(f=[18.522 / k], b=[18.086 / k],
                                                   w=[9.337 / k], comm=0.601))]:
        fast = _C.compile(name, pp, m, **costs)
        assert programs(fast) == programs(_C.compile(name, pp, m, exhaustive_search=True, **costs))
