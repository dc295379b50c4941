"""bench_failure runs end to end: rank 0's injected failure reaches rank 1 (named in the error,
or the benchmark fails) and a complete row is printed. No timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.subprocess_env import NEUTRAL_CWD, child_env

ROOT = Path(__file__).resolve().parents[2]


def test_bench_failure_prints_a_row():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_failure.py"), "--pp", "2", "--reps", "2"],
        cwd=NEUTRAL_CWD, capture_output=True, text=True, timeout=120, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = re.search(r"^\s*2\s+1\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+60\s+([\d.]+)\s*$", proc.stdout, re.M)
    assert row, proc.stdout
    med, lo, hi, ratio = map(float, row.groups())
    assert 0 < lo <= med <= hi and abs(ratio - med / 1e3 / 60) < 1e-4
