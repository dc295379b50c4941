"""bench_control_plane's scale run, small: 32 simulated ranks (pipelines of 4, groups of 8
replicas) in 2 processes against one TCPStore server of their own set up, agree, sit idle and
hear of one rank's failure. Every other rank must be told it (the benchmark exits 1 otherwise),
the idle window must cost the server no request at all (a poll or a heartbeat would), and the
table must be complete. No timing is asserted (docs/benchmarks.md has the 1,024-rank run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.subprocess_env import NEUTRAL_CWD, child_env

ROOT = Path(__file__).resolve().parents[2]


def test_every_rank_hears_of_a_failure_and_idle_ranks_ask_nothing():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_control_plane.py"), "scale", "--ranks", "32", "--pp", "4",
         "--procs", "2", "--idle", "2", "--timeout", "60"],
        cwd=NEUTRAL_CWD, capture_output=True, text=True, timeout=600, env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"^idle: requests/s\s+0\.00\s+0\s+-$", out, re.M), out
    told = re.search(r"^failure: ranks told\s+(\d+)\s+(\d+)", out, re.M)
    assert told and int(told.group(1)) == 31, out
    worst = re.search(r"^failure: worst latency \(s\)\s+([\d.]+)$", out, re.M)
    setup = re.search(r"^setup agreement \(s\)\s+([\d.]+)\s+(\d+)", out, re.M)
    assert worst and setup and int(setup.group(2)) > 0, out
