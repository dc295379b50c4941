"""bench_ac runs end to end on a small configuration: every checkpointed block is recomputed
exactly once per (stage, microbatch) in the pipelined steps, and its per-stage memory table shows
a checkpointed stage holding less than an unchecked one from F to I and exactly as much from I
to W (what W needs); the goals are printed from the step times and from the actions' CPU
times. No timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.subprocess_env import NEUTRAL_CWD, child_env

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ac_recomputes_once_and_holds_what_w_needs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_ac.py"), "--models", "mlp", "--schedules",
         "1f1b,zb_h1", "--microbatches", "2", "--warmup", "0", "--reps", "1"],
        cwd=NEUTRAL_CWD, capture_output=True, text=True, timeout=600, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = re.findall(r"^\| (1f1b|zb_h1) \| (yes|no) \| ([^|]+) \|", proc.stdout, re.M)
    assert len(rows) == 8, proc.stdout  # two schedules, with and without AC, in both tables
    assert [r[2].strip() for r in rows[:4] if r[1] == "yes"] == ["1.00-1.00"] * 2, proc.stdout
    # The goal also read from the actions' CPU times (the trace's cpu_ns, shared-machine proof).
    assert re.search(r"^- zb_h1: .* from CPU times \d+\.\d\d \((met|NOT met)\)$", proc.stdout, re.M), proc.stdout
    mem = {(ac, blocks, grad): (int(f), int(w)) for ac, blocks, grad, f, w in
           re.findall(r"^\| (yes|no) \| (\d+) \| (yes|no) \| (\d+) \| (\d+) \|$", proc.stdout, re.M)}
    assert mem, proc.stdout
    for (ac, blocks, grad), (mem_f, mem_w) in mem.items():
        if ac == "yes":
            plain_f, plain_w = mem[("no", blocks, grad)]
            assert mem_f < plain_f, proc.stdout
            assert mem_w == (plain_w if grad == "yes" else mem_f), proc.stdout
