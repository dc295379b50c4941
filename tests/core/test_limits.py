"""Program size: memory linear in the actions, and requests beyond zbpipe's limits refused with a
ScheduleError naming the limit and the memory, before anything is allocated for them
(csrc/include/zbpipe/limits.h). Memory is read in child processes, whose peak RSS is their own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import zbpipe
from zbpipe import Program, ScheduleError, _C

from helpers.subprocess_env import NEUTRAL_CWD, child_env

LIMITS = _C.size_limits()


def run_child(code: str, data_limit_bytes: int | None = None, timeout: float = 300) -> dict:
    """Runs `code` in a fresh interpreter (zbpipe imported, optionally under RLIMIT_DATA) and
    returns the JSON object it prints last."""
    prelude = "import json, resource\n"
    if data_limit_bytes:
        prelude += f"resource.setrlimit(resource.RLIMIT_DATA, ({data_limit_bytes}, {data_limit_bytes}))\n"
    prelude += "import zbpipe\nfrom zbpipe import _C\n"
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True, text=True, env=child_env(), cwd=NEUTRAL_CWD, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PEAK_GROWTH = """
def peak_kb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

def growth_mb(fn):
    before = peak_kb()
    fn()
    return (peak_kb() - before) / 1024
"""


def test_memory_of_a_wide_pipeline_is_linear_in_its_actions():
    # pp=4096, one microbatch: 4 actions per rank once lowered. The old validate() kept a send
    # list per ordered rank pair, 32 bytes x pp^2 = 512 MB here; now it takes a few MB. Each
    # entry point in a fresh child, since a peak once reached hides the next one's.
    compiled = run_child(PEAK_GROWTH + """
print(json.dumps({"mb": growth_mb(lambda: zbpipe.compile("1f1b", 4096, 1))}))
""")
    imported = run_child(PEAK_GROWTH + """
text = "\\n".join(f"{r}F0,{r}B0" for r in range(4096))
print(json.dumps({"mb": growth_mb(lambda: zbpipe.Program.from_csv_text(text))}))
""")
    assert compiled["mb"] < 64, compiled
    assert imported["mb"] < 64, imported


def test_memory_per_stage_microbatch_stays_within_the_stated_estimate():
    # The limits' memory figures come from bytes_per_stage_microbatch: a program near the
    # largest size per rank pins it (zbv: I/W split, 2 stages per rank, every transfer
    # across ranks, the most actions per pair).
    cells = 64 * 2 * 2048
    out = run_child(PEAK_GROWTH + """
print(json.dumps({"mb": growth_mb(lambda: zbpipe.compile("zbv", 64, 2048))}))
""")
    estimate_mb = cells * LIMITS["bytes_per_stage_microbatch"] / 2**20
    assert out["mb"] < 1.25 * estimate_mb, (out, estimate_mb)


# Requests that each reached for gigabytes or more before (or ran until killed), with the limit
# their message must name.
OVERSIZED = [
    ("compile('1f1b', 2, 10**9)", "limit of 1048576 microbatches"),
    ("compile('zbv', 4, 10**9)", "limit of 1048576 microbatches"),
    ("compile('zb_h1', 4, 10**9)", "limit of 1048576 microbatches"),
    ("compile('dualpipev', 4, 10**9)", "limit of 1048576 microbatches"),
    ("compile('1f1b', 100000, 1)", "limit of 16384 pipeline ranks"),
    ("compile('interleaved_1f1b', 4096, 8, 32)", "limit of 65536 stages"),
    ("compile('zbv', 32768, 1)", "limit of 16384 pipeline ranks"),
    # 2 stages per rank: 16384 x 129 pairs pass the check of the request, the builder's finds
    # 32768 x 129.
    ("compile('zbv', 16384, 129)", "limit of 4194304 (stage, microbatch) pairs"),
    ("compile('gpipe', 8, 1048576)", "limit of 4194304 (stage, microbatch) pairs"),
    ("compile('v_half', 10**9, 1)", "limit of 16384 pipeline ranks"),
    ("_C.build('v_min', 10**9, 1)", "limit of 16384 pipeline ranks"),
    ("Program.from_actions([['0F0', '0B0']], [0], 10**12)", "limit of 1048576 microbatches"),
    ("Program.from_actions([[]] * 20000, [0], 1)", "limit of 16384 pipeline ranks"),
    ("Program.from_actions([['0F0']], [0] * 100000, 1)", "limit of 65536 stages"),
    ("Program.from_csv_text('0F0\\n0F999999999')", "limit of 1048576 microbatches"),
    ("Program.from_csv_text('999999999F0')", "limit of 65536 stages"),
    ("Program.from_csv_text('\\n' * 20000 + '0F0')", "limit of 16384 pipeline ranks"),
    ("Program.from_csv_text('0F0,' * 40000000)", "limit of 33554432 actions"),
]


def test_oversized_requests_are_refused_before_allocating():
    # Under a 3 GB data limit an allocation for any of these would fail (MemoryError or a
    # RuntimeError from std::bad_alloc) instead of the ScheduleError asked for.
    out = run_child(
        "from zbpipe import Program, compile\nresults = []\n"
        f"for expr, _ in {OVERSIZED!r}:\n"
        "    try:\n"
        "        eval(expr)\n"
        "        results.append('accepted')\n"
        "    except zbpipe.ScheduleError as e:\n"
        "        results.append(str(e))\n"
        "    except Exception as e:\n"
        "        results.append(f'{type(e).__name__}: {e}')\n"
        "print(json.dumps({'results': results}))\n",
        data_limit_bytes=3 << 30,
    )
    for (expr, limit), message in zip(OVERSIZED, out["results"]):
        assert limit in message, (expr, message)
        assert "would take about" in message and "B;" in message, (expr, message)
        assert "the limits: pp <= 16384" in message, (expr, message)


def test_size_limits_are_the_ones_the_messages_state():
    assert LIMITS == {
        "pp": 16384,
        "stages": 65536,
        "microbatches": 1 << 20,
        "stages_x_microbatches": 1 << 22,
        "actions": 1 << 25,
        "bytes_per_stage_microbatch": 448,
        "csv_bytes": 1 << 28,
    }


@pytest.mark.parametrize(
    "name,pp,microbatches,spr,field",
    [
        ("inference", LIMITS["pp"], 1, 0, "pp"),
        ("inference", 1, LIMITS["microbatches"], 0, "microbatches"),
        ("looped_bfs", 2048, 1, LIMITS["stages"] // 2048, "stages"),
        ("inference", 8, LIMITS["stages_x_microbatches"] // 8, 0, "stages x microbatches"),
    ],
)
def test_each_limit_is_inclusive(name, pp, microbatches, spr, field):
    prog = _C.build(name, pp, microbatches, spr)
    assert prog.num_stages * prog.microbatches <= LIMITS["stages_x_microbatches"]
    bigger = dict(pp=pp, microbatches=microbatches, spr=spr)
    bigger["spr" if field == "stages" else "microbatches" if "microbatches" in field else "pp"] += 1
    with pytest.raises(ScheduleError, match=f"{field}=[0-9]+ is above zbpipe's limit"):
        _C.build(name, bigger["pp"], bigger["microbatches"], bigger["spr"])


def test_error_grid_of_a_huge_program_is_a_window():
    # 16384 ranks, 100000 actions on the last one: the whole grid would be 16384 columns x
    # 100000 steps (gigabytes); the message shows the window around the marked action.
    text = "\n" * 16383 + ",".join(f"0F{i}" for i in range(100000)) + ",0F0"
    with pytest.raises(ScheduleError, match="'0F0' appears twice") as err:
        Program.from_csv_text(text)
    message = str(err.value)
    assert len(message) < 100_000, len(message)
    assert "(ranks 16352 to 16383 of 16384 shown)" in message
    assert ">>0F0<<" in message and "(99937 steps before not shown)" in message


def test_grid_window_follows_the_mark():
    prog = zbpipe.compile("1f1b", pp=40, microbatches=64)
    grid = prog.format(39, 120)
    assert ">>" + prog.actions(39)[120] + "<<" in grid
    assert "(ranks 8 to 39 of 40 shown)" in grid
    assert "steps before not shown" in grid and "steps after not shown" in grid
    # Small programs are shown whole, as before.
    small = zbpipe.compile("1f1b", pp=4, microbatches=8).format()
    assert "not shown" not in small and len(small.splitlines()) == 1 + max(
        len(zbpipe.compile("1f1b", pp=4, microbatches=8).actions(r)) for r in range(4)
    )
