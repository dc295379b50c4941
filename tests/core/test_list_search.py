"""The cost-driven builders' fast search (grid points merged when no knob check tells them apart,
runs stopped at the best makespan so far, scores from the scheduler's own timing) picks exactly
the program the exhaustive grid picks: every point run to the end and scored by zbpipe.simulate.
The fast search shares its grid among threads; every thread count picks the same program."""

import os
import random
import subprocess
import sys

import pytest

import zbpipe
from helpers.subprocess_env import NEUTRAL_CWD, child_env
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


def memory_model_case(rng, kept_by_w):
    # The memory model of memory_model.h with I freeing part of a forward: caps in mem_f's
    # units, runs pruned on the longest span and on the drain of partial frees (with a small
    # share kept for W, freeing by I alone is the drain's cheapest way).
    pp, m, costs = long_zb_auto_case(rng)
    mem_f = [rng.uniform(1.0, 2.0) for _ in range(pp)]
    costs.update(mem_f=mem_f, mem_w=[x * rng.uniform(*kept_by_w) for x in mem_f],
                 memory_cap=rng.choice([0.5, 1.0, 1.5, 2.0]) * pp * max(mem_f))
    return pp, m, costs


CASES += [("zb_auto", *memory_model_case(random.Random(9000 + i), (0.2, 0.9))) for i in range(30)]
CASES += [("zb_auto", *memory_model_case(random.Random(9500 + i), (0.0, 0.15))) for i in range(20)]


def long_v_case(rng):
    # The same for the V schedules, whose drain bound also counts what the cap makes a rank run
    # before its last microbatch may enter.
    pp = rng.randint(2, 8)
    m = rng.randint(1, 4 * pp)
    f, b = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
    jitter = rng.choice([0.0, 0.2, 0.6])
    costs = {"f": [f * rng.uniform(1 - jitter, 1 + jitter) for _ in range(2 * pp)],
             "b": [b * rng.uniform(1 - jitter, 1 + jitter) for _ in range(2 * pp)],
             "w": [rng.uniform(0.1, 1.5) for _ in range(2 * pp)],
             "comm": rng.choice([0.0, 0.05, 0.3])}
    return pp, m, costs


CASES += [(name, *long_v_case(random.Random(8000 + 2 * i + j)))
          for j, name in enumerate(("v_half", "v_min")) for i in range(20)]


def programs(prog):
    return [prog.compute_actions(r) for r in range(prog.pp)]


def paper_costs(name):
    # The Zero Bubble paper's 1.5B model, per 1F1B stage; a V stage costs half.
    k = 1 if name == "zb_auto" else 2
    return dict(f=[18.522 / k], b=[18.086 / k], w=[9.337 / k], comm=0.601)


@pytest.mark.parametrize("name,pp,m,options", CASES)
def test_fast_search_picks_the_exhaustive_pick(name, pp, m, options):
    fast = _C.compile(name, pp, m, **options)
    full = _C.compile(name, pp, m, exhaustive_search=True, **options)
    assert programs(fast) == programs(full)


@pytest.mark.parametrize("name", ["zb_auto", "v_half", "v_min"])
def test_equal_costs_and_larger_sizes(name):
    # Equal costs make many grid points build the same program (the merging path); the 1.5B
    # costs make most of them differ (the bound path).
    for pp, m, costs in [(8, 24, {}), (8, 24, paper_costs(name))]:
        fast = _C.compile(name, pp, m, **costs)
        assert programs(fast) == programs(_C.compile(name, pp, m, exhaustive_search=True, **costs))


THREAD_CASES = [(name, 8, 24, opts) for name in ("zb_auto", "v_half", "v_min")
                for opts in ({}, paper_costs(name))]
THREAD_CASES += CASES[::9]


@pytest.mark.parametrize("name,pp,m,options", THREAD_CASES)
def test_every_thread_count_picks_the_same_program(name, pp, m, options):
    # Workers interleave differently on every run; at unit costs many grid points tie on every
    # score and the lowest one must still win, as in a serial search.
    one = programs(_C.compile(name, pp, m, search_threads=1, **options))
    for threads in (2, 3, 8):
        assert programs(_C.compile(name, pp, m, search_threads=threads, **options)) == one, threads


def test_thread_count_is_checked():
    with pytest.raises(zbpipe.ScheduleError, match="search_threads must be >= 0"):
        zbpipe.compile("v_min", 4, 8, search_threads=-1)
    assert programs(zbpipe.compile("v_min", 4, 8, search_threads=0)) == programs(
        zbpipe.compile("v_min", 4, 8, search_threads=1))


def test_default_thread_count_follows_the_cpus_this_process_may_use():
    # The affinity mask, not the machine's CPU count: a launcher pinning a rank to one core gets
    # a one-thread search. Pinned in a child process so this one keeps its mask.
    cpus = sorted(os.sched_getaffinity(0))
    assert _C.search_thread_count() == min(len(cpus), 8)
    assert _C.search_thread_count(3) == 3
    code = (f"import os; os.sched_setaffinity(0, {{{cpus[0]}}}); "
            "from zbpipe import _C; print(_C.search_thread_count())")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=NEUTRAL_CWD,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "1"
