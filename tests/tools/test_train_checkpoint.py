"""`zbpipe train --checkpoint DIR --resume` across pipeline sizes: 10 steps at pp=2 (zbv, two
stages per rank, gradients clipped), saved with DCP; resumed at pp=4 (1f1b, world 4) and at
pp=1 for 10 more steps. Each resumed run's losses equal those of steps 11..20 of the same
model trained uninterrupted for 20 steps in one process (the trainer's own reference, 1e-5):
model, optimizer state and data position all came back. A checkpoint of another model, or
none, is refused before any process starts."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from helpers.subprocess_env import NEUTRAL_CWD, child_env

WAIT_S = 240  # what the test waits for one trainer process (a few seconds when the machine is quiet)
TOL = 1e-5
COMMON = ("--layers", "4", "--batch-size", "8", "--max-norm", "0.5", "--log-every", "1", "--tol", str(TOL),
          "--timeout", "200")
FINAL = re.compile(r"max over (\d+) steps (\S+), tol \S+\) (MATCH|MISMATCH)")
PROGRESS = re.compile(r"^step\s+(\d+)/(\d+) \| loss (\S+) \|", re.M)


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbpipe.train", *COMMON, *args], cwd=NEUTRAL_CWD,
                          env=child_env(), capture_output=True, text=True, timeout=WAIT_S)


def _check(proc: subprocess.CompletedProcess, first_step: int, last_step: int) -> list[float]:
    """The run matched the uninterrupted reference over its steps; returns its losses."""
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-4000:]}"
    steps, worst, verdict = FINAL.search(out).groups()
    progress = PROGRESS.findall(out)
    assert [int(s) for s, _, _ in progress] == list(range(first_step, last_step + 1)), out
    assert int(steps) == last_step - first_step + 1 and verdict == "MATCH", out
    losses = [float(loss) for _, _, loss in progress]
    assert float(worst) <= TOL * max(1.0, *losses), out  # the trainer's tolerance: relative to max(1, |loss|)
    return losses


def test_resume_at_other_pipeline_sizes_continues_the_uninterrupted_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    _check(_train("--pp", "2", "--schedule", "zbv", "--microbatches", "4", "--steps", "10",
                  "--checkpoint", str(ckpt)), 1, 10)
    assert (ckpt / "step-10" / ".metadata").is_file()
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    at4 = _check(_train("--pp", "4", "--schedule", "1f1b", "--microbatches", "4", "--steps", "20",
                        "--checkpoint", str(ckpt), "--resume"), 11, 20)
    assert (ckpt / "step-20" / ".metadata").is_file()
    at1 = _check(_train("--pp", "1", "--schedule", "gpipe", "--microbatches", "2", "--steps", "20",
                        "--checkpoint", str(copy), "--resume"), 11, 20)
    assert at4 == at1


def test_resume_refuses_another_model_or_no_checkpoint(tmp_path):
    proc = _train("--pp", "1", "--schedule", "gpipe", "--steps", "1", "--checkpoint", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    other = _train("--layers", "6", "--pp", "1", "--schedule", "gpipe", "--steps", "2", "--checkpoint",
                   str(tmp_path), "--resume")
    assert other.returncode == 2 and "holds another model" in other.stderr, other.stderr
    none = _train("--pp", "1", "--schedule", "gpipe", "--steps", "2", "--checkpoint", str(tmp_path / "empty"),
                  "--resume")
    assert none.returncode == 2 and "needs a step-N checkpoint" in none.stderr, none.stderr
    assert "step " not in other.stdout + none.stdout
