"""The training demo end to end: `python -m zbpipe.train` with tiny settings in a subprocess must
exit 0, print progress, and its pipelined loss must equal the single-process loss."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers.subprocess_env import NEUTRAL_CWD, child_env

# Bounds, not speed goals: three steps take seconds on a quiet machine, minutes on a loaded one.
RUN_TIMEOUT_S = 150  # the trainer's own --timeout
WAIT_S = 180  # what this test waits for the trainer's process
FINAL = re.compile(
    r"final loss: pipelined (\S+) \| single-process (\S+) \| diff (\S+) "
    r"\(max over (\d+) steps (\S+), tol \S+\) (MATCH|MISMATCH)"
)
PROGRESS = re.compile(r"^step\s+(\d+)/(\d+) \| loss (\S+) \|\s+(\d+) tok/s", re.M)


def _run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zbpipe.train", "--steps", "3", "--log-every", "1", "--timeout", str(RUN_TIMEOUT_S), *args],
        cwd=NEUTRAL_CWD, env=child_env(), capture_output=True, text=True, timeout=WAIT_S,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("--lib", "zbpipe", "--schedule", "zbv"),  # the default: V topology, split I/W
        ("--lib", "zbpipe", "--schedule", "1f1b"),  # one stage per rank, full backward
        ("--lib", "zbpipe", "--schedule", "zb_auto"),  # cost-driven, at unit costs
        ("--lib", "zbpipe", "--schedule", "v_min"),  # controllable-memory V
        ("--lib", "zbpipe", "--schedule", "zb_h1", "--dp", "2"),  # 2 replicas of pp 2, DDP stages, split I/W
        ("--lib", "torch", "--schedule", "zbv"),  # the harness itself, against PyTorch's runtime
    ],
    ids=lambda a: "-".join(a[1::2]),
)
def test_pipelined_loss_matches_single_process(args, tmp_path):
    zb = args[1] == "zbpipe"
    proc = _run_demo(*args, *(("--trace", str(tmp_path / "t")) if zb else ()))
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    progress = PROGRESS.findall(out)
    assert [int(s) for s, *_ in progress] == [1, 2, 3], out
    assert all(int(total) == 3 and int(tps) > 0 for _, total, _, tps in progress), out
    m = FINAL.search(out)
    assert m, f"no final comparison line in:\n{out}"
    piped, single, diff, steps, worst, verdict = m.groups()
    piped, single = float(piped), float(single)
    assert int(steps) == 3 and verdict == "MATCH"
    losses = [float(l) for _, _, l, _ in progress]
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    # The loss the pipeline reported at its last progress line is the one compared.
    assert abs(float(progress[-1][2]) - piped) < 1e-4
    # Same math, only reassociated: equal to float tolerance (and the untrained loss is ~ln 16).
    assert abs(piped - single) <= 1e-5 * max(1.0, abs(single)), (piped, single)
    assert float(worst) <= 1e-5 and 1.0 < single < 3.5
    if zb:  # each rank wrote its last step's trace, with the schedule's compute actions in it
        for rank in (0, 1):
            events = json.loads((tmp_path / f"t.rank{rank}.json").read_text())["traceEvents"]
            assert any(re.fullmatch(r"\d+F7", e["name"]) for e in events), events[:3]


def test_bad_arguments_fail_fast():
    proc = _run_demo("--batch-size", "30", "--microbatches", "8")
    assert proc.returncode == 2 and "divisible" in proc.stderr, proc.stderr


def test_invalid_schedule_size_fails_before_spawning():
    proc = _run_demo("--schedule", "dualpipev", "--microbatches", "2", "--batch-size", "4")
    assert proc.returncode == 2 and "dualpipev needs microbatches" in proc.stderr, proc.stderr
    assert "step " not in proc.stdout
