"""bench_dispatch runs end to end (one short row per library): it must build both libraries'
pipelines (and zbpipe's with static_shapes=True) on the same stages and print a complete row.
No timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.subprocess_env import NEUTRAL_CWD, child_env

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dispatch_prints_a_row_for_both_libraries():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dispatch.py"), "--sizes", "tiny",
         "--schedules", "zbv", "--microbatches", "4", "--warmup", "1", "--reps", "1", "--steps", "1",
         "--timeout", "45"],
        cwd=NEUTRAL_CWD, capture_output=True, text=True, timeout=60, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = re.search(r"^tiny\s+zbv" + r"\s+([\d.]+)" * 9 + r"\s*$", proc.stdout, re.M)
    assert row, proc.stdout
    torch_ms, zb_ms, ratio, floor_ms, _, _, _, static_ms, dyn_ratio = map(float, row.groups())
    assert torch_ms > 0 and zb_ms > 0 and floor_ms > 0 and static_ms > 0
    assert abs(ratio - zb_ms / torch_ms) < 0.01 + 0.01 * ratio
    # zbpipe with static_shapes=True, measured in the same run (the renegotiation's cost)
    assert abs(dyn_ratio - zb_ms / static_ms) < 0.002 + 0.01 * dyn_ratio


def test_bench_dispatch_overlap_prints_a_row_with_both_modes():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dispatch.py"), "--overlap", "--sizes", "medium",
         "--microbatches", "4", "--warmup", "1", "--reps", "1", "--steps", "1", "--timeout", "60"],
        cwd=NEUTRAL_CWD, capture_output=True, text=True, timeout=90, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = re.search(r"^medium\s+dualpipev\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", proc.stdout, re.M)
    assert row, proc.stdout
    seq_ms, ovl_ms, ratio = map(float, row.groups())
    assert seq_ms > 0 and ovl_ms > 0 and abs(ratio - ovl_ms / seq_ms) < 0.01 + 0.01 * ratio
