"""bench_autotune runs end to end on one placement: every fixed candidate and ScheduleAuto get a
measured step and a prediction, the ratios and the tuning table are printed, `--breakdown` says
per rank where each step went (every candidate posting the same sends), `--confirm` measures
the picks again in fresh steps, and under a budget below the safe default's peak ScheduleAuto
picks a candidate that fits. No timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.subprocess_env import NEUTRAL_CWD, child_env

ROOT = Path(__file__).resolve().parents[2]


def test_bench_autotune_measures_every_candidate_and_fits_the_budget():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_autotune.py"), "--placements", "one",
         "--warmup", "0", "--reps", "1", "--breakdown", "--confirm", "1"],
        cwd=NEUTRAL_CWD, capture_output=True, text=True, timeout=600, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    row = r"\| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (yes|no) \|$"  # step, predicted, their ratio, fits
    rows = {m[0]: m[1:] for m in re.findall(r"^\| (zb_h1|1f1b|zb_h2|zb_auto) " + row, out, re.M)}
    assert sorted(rows) == ["1f1b", "zb_auto", "zb_h1", "zb_h2"], out
    assert rows["zb_h1"][3] == "yes" and rows["zb_h2"][3] == "no", rows  # zb_h2 holds more than zb_h1
    assert re.search(r"^\| auto \((zb_h1|1f1b|zb_h2|zb_auto)\) " + row, out, re.M), out
    # --breakdown: per schedule and rank, compute actions and sends counted; the safe default's
    # timing steps against the timed steps.
    parts = re.findall(r"^\| (zb_h1|1f1b|zb_h2|zb_auto|auto) \| ([01]) \| [\d.]+ \| [\d.]+ \((\d+)\) \| [\d.]+ \| "
                       r"[\d.]+ \((\d+)\) \| -?[\d.]+ \|$", out, re.M)
    assert len(parts) == 10, out
    actions = {(name, rank): int(n) for name, rank, n, _ in parts}
    assert actions[("1f1b", "1")] == 16 and actions[("zb_h1", "1")] == 24, actions  # B against I + W
    assert {int(sends) for *_, sends in parts} == {8}, parts  # every candidate: one send per microbatch
    assert re.search(r"^zb_h1: simulated under the timing steps' costs [\d.]+ ms, under the timed steps' [\d.]+ ms", out, re.M), out
    # The same-time prediction: every schedule, the safe default's 1 by construction (its own
    # unmodelled time).
    same = re.search(r"^same-time prediction / measured \(costs and unmodelled time of the timed steps\): (.*)$", out, re.M)
    assert same, out
    ratios = dict(kv.split() for kv in same.group(1).split(", "))
    assert sorted(ratios) == ["1f1b", "auto", "zb_auto", "zb_h1", "zb_h2"] and ratios["zb_h1"] == "1.000", ratios
    assert all(float(v) > 0 for v in ratios.values()), ratios
    assert re.search(r"auto / best fixed \(\w+\): [\d.]+ .* predicted / measured \(median\): [\d.]+", out), out
    assert "<- chosen" in out, out
    # --confirm: fresh alternating steps of auto and the two picks, ratios from those.
    c = re.search(r"^confirmation, 1 fresh steps each, alternating: auto / best fixed \((zb_h1|1f1b|zb_h2|zb_auto)\): "
                  r"[\d.]+; auto / best fixed within the budget \((\w+)\): [\d.]+; predicted / measured: [\d.]+"
                  r"(?:; A/A \(auto runs the same program as \[(.*)\]\))?$", out, re.M)
    assert c, out
    # A pick of auto's own program (not zb_auto: the fixed one is compiled at unit costs) is named
    # as an A/A comparison, and only such a pick.
    choice = re.search(r"^\| auto \((\w+)\) ", out, re.M).group(1)
    same = re.findall(r"'(\w+)'", c.group(3) or "")
    assert set(same) <= {c.group(1), c.group(2)} and all(n == choice or n == "zb_auto" for n in same), (same, out)
    if choice in (c.group(1), c.group(2)) and choice != "zb_auto":
        assert choice in same, out
    m = re.search(r"budget \d+ B/rank \(0.95 of \d+, zb_h1's peak\): auto picks (\w+), peak \d+ B \(fits: (\w+)\)", out)
    assert m and m.group(1) != "zb_h1" and m.group(2) == "True", out
