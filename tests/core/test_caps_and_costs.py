"""Caps, costs and the core's doors at their extremes (issue 35): an infinite or huge memory_cap
is no cap and compiles as fast as the smallest cap that changes nothing; costs whose total
overflows a double raise ScheduleError; schedule_options() lists exactly what compile() takes;
a NUL byte in user text survives into the message; generated files (/proc) are read to EOF.
Calls that hung before run in a child process with a timeout, so a regression fails, not hangs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

import zbpipe
from zbpipe import ScheduleError

from helpers.subprocess_env import NEUTRAL_CWD, child_env


def programs(prog) -> list:
    return [prog.actions(r) for r in range(prog.pp)]


def child_programs(calls: list[str], timeout: float = 120) -> list:
    """Each call's program (its actions per rank), compiled in a child process: a call that never
    returns (the int warm-up count under memory_cap=inf did) fails the test at `timeout`."""
    code = textwrap.dedent(f"""
        import json, zbpipe
        out = []
        for call in {calls!r}:
            p = eval(call, {{"compile": zbpipe.compile, "inf": float("inf")}})
            out.append([p.actions(r) for r in range(p.pp)])
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(), cwd=NEUTRAL_CWD, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# (huge caps, the smallest cap that changes nothing: every forward a rank can hold.) mem_f=1e-9
# with memory_cap=4 is a ratio of 4e9, above int32 as inf is.
NO_CAP = [
    ("compile('zb_auto', 4, 8, memory_cap=inf)", "compile('zb_auto', 4, 8, memory_cap=8)"),
    ("compile('zb_auto', 4, 8, memory_cap=1e12)", "compile('zb_auto', 4, 8, memory_cap=8)"),
    ("compile('zb_auto', 4, 8, mem_f=1e-9, memory_cap=4)",
     "compile('zb_auto', 4, 8, mem_f=1e-9, memory_cap=8e-9)"),
    # V: both stages of a rank, all 8 microbatches: 16 units.
    ("compile('v_half', 4, 8, memory_cap=inf)", "compile('v_half', 4, 8, memory_cap=16)"),
    ("compile('v_half', 4, 8, memory_cap=1e12)", "compile('v_half', 4, 8, memory_cap=16)"),
    ("compile('v_min', 4, 8, memory_cap=inf)", "compile('v_min', 4, 8, memory_cap=16)"),
    ("compile('v_min', 4, 8, memory_cap=1e12)", "compile('v_min', 4, 8, memory_cap=16)"),
]


def test_an_infinite_or_huge_cap_is_no_cap():
    # Before: zb_auto never returned (and ignored Ctrl-C); v_half / v_min raised the internal
    # "list scheduler stalled". Now each gives the program of the smallest cap that binds nothing.
    got = child_programs([call for pair in NO_CAP for call in pair])
    for i, (huge, smallest) in enumerate(NO_CAP):
        assert got[2 * i] == got[2 * i + 1], (huge, smallest)


OVERFLOWING = [
    lambda: zbpipe.simulate(zbpipe.compile("1f1b", 4, 8), f=1e308, b=1e308),
    lambda: zbpipe.simulate(zbpipe.compile("zbv", 4, 8), f=1e300, comm=1e300),
    lambda: zbpipe.compile("zb_auto", 4, 8, f=1e308, b=1e308),
    lambda: zbpipe.compile("v_min", 4, 8, w=1e308),
    lambda: zbpipe.lower_bound(zbpipe.compile("zb_h1", 4, 8), f=1e308),
    lambda: zbpipe.refine(zbpipe.compile("zb_h1", 4, 8), b=1e308),
]


@pytest.mark.parametrize("case", range(len(OVERFLOWING)))
def test_costs_that_overflow_the_simulation_are_refused(case):
    # Before: simulate gave makespan inf and bubble nan; zb_auto raised "list scheduler stalled".
    with pytest.raises(ScheduleError, match="costs overflow the simulation"):
        OVERFLOWING[case]()


def test_large_costs_that_stay_finite_still_simulate():
    res = zbpipe.simulate(zbpipe.compile("1f1b", 4, 8), f=1e290, b=1e290, w=1e290)
    assert math.isfinite(res.makespan) and math.isfinite(res.bubble_rate)
    assert 0.0 <= res.bubble_rate < 1.0


@pytest.mark.parametrize("name", [n for n in zbpipe.schedule_names() if zbpipe.schedule_options(n)])
def test_compile_takes_every_option_schedule_options_lists(name):
    # schedule_options('zb_auto') listed exhaustive_search, which compile() rejected.
    values = {"f": 1.0, "b": 1.0, "w": 1.0, "comm": 0.0, "mem_f": 1.0, "mem_w": 1.0,
              "memory_cap": 0, "exhaustive_search": True, "search_threads": 1, "refine": True}
    plain = programs(zbpipe.compile(name, 4, 8))
    for option in zbpipe.schedule_options(name):
        assert programs(zbpipe.compile(name, 4, 8, **{option: values[option]})) == plain, option


def test_a_nul_byte_in_user_text_stays_in_the_message():
    # what() is a C string: the message ended at the NUL.
    with pytest.raises(ScheduleError) as err:
        zbpipe.Program.from_csv_text("0F0,0X\x001")
    assert "'0X\\x001'" in str(err.value) and "(expected [stage][kind][microbatch]" in str(err.value)
    with pytest.raises(ScheduleError) as err:
        zbpipe.compile("zb\x00auto", 4, 8)
    assert "'zb\\x00auto' (valid: " in str(err.value)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_file_whose_stat_size_is_zero_is_read_to_its_end():
    # /proc files stat as 0 bytes: they read as "has no rows". Read to EOF, their first line
    # is what the parser names.
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(ScheduleError, match="CSV line 1: invalid action string 'Name:"):
        zbpipe.Program.from_csv("/proc/self/status")
