"""benchmarks/torchtitan_class_swap.py: its verdict (every step's loss and gradient norm within
the tolerance, every step present, each side on its own pipeline's classes), its exit without
torchtitan, and, where a Python with torchtitan is at hand (ZBPIPE_TORCHTITAN_PYTHON, or this
one), one split schedule on torchtitan's own trainer against torch's full-backward run. CI has
no torchtitan: that last test skips there, and the others take well under a second."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.subprocess_env import NEUTRAL_CWD, child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "torchtitan_class_swap.py"
TORCH_CLASSES = ["torch.distributed.pipelining.schedules.Schedule1F1B", "torch.distributed.pipelining.stage.PipelineStage"]
ZBPIPE_CLASSES = ["zbpipe.schedules.Schedule1F1B", "zbpipe.stage.PipelineStage"]


def _script():
    spec = importlib.util.spec_from_file_location("torchtitan_class_swap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(pipeline, losses, norms, ran, error=None):
    return {"pipeline": pipeline, "schedule": "1F1B", "csv": None, "ac": "selective", "losses": losses,
            "grad_norms": norms, "ran": ran, "error": error, "command": "torchrun ..."}


def _torch():
    return _run("torch", [8.1, 8.0], [0.71, 0.82], TORCH_CLASSES)


@pytest.mark.parametrize("got, passes", [
    (_run("zbpipe", [8.1, 8.0], [0.71, 0.82], ZBPIPE_CLASSES), True),
    (_run("zbpipe", [8.1, 8.0 * (1 + 5e-6)], [0.71, 0.82 * (1 - 5e-6)], ZBPIPE_CLASSES), True),
    (_run("zbpipe", [8.1, 8.0 * (1 + 2e-5)], [0.71, 0.82], ZBPIPE_CLASSES), False),  # a loss off
    (_run("zbpipe", [8.1, 8.0], [0.71 * (1 + 2e-5), 0.82], ZBPIPE_CLASSES), False),  # a grad norm off
    (_run("zbpipe", [8.1], [0.71], ZBPIPE_CLASSES), False),  # a step missing
    (_run("zbpipe", [8.1, 8.0], [0.71, 0.82], ZBPIPE_CLASSES, error="rc=1: RuntimeError"), False),
    (_run("zbpipe", [8.1, 8.0], [0.71, 0.82], TORCH_CLASSES), False),  # the swap did not take
    (_run("zbpipe", [8.1, 8.0], [0.71, 0.82], []), False),  # no record of what ran
], ids=["equal", "within", "loss", "grad_norm", "missing_step", "error", "torch_classes", "no_classes"])
def test_verdict_needs_every_step_within_tolerance_on_zbpipes_classes(got, passes, capsys):
    ok = _script().compare("1F1B", _torch(), got, None, SimpleNamespace(steps=2, tolerance=1e-5))
    out = capsys.readouterr().out
    assert ok is passes, out
    assert ("PASS:" in out) is passes, out


def _has_torchtitan(python: str) -> bool:
    return subprocess.run([python, "-c", "import torchtitan.trainer"], capture_output=True).returncode == 0


def test_without_torchtitan_says_why_and_exits_0():
    if _has_torchtitan(sys.executable):
        pytest.skip(f"torchtitan is importable from {sys.executable}: the script would run it")
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=NEUTRAL_CWD, capture_output=True, text=True,
                          timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"skipped: torchtitan is not importable from {sys.executable}: "), proc.stdout


def test_split_schedule_on_torchtitans_trainer_equals_torchs_full_backward_run():
    python = os.environ.get("ZBPIPE_TORCHTITAN_PYTHON", sys.executable)
    if not _has_torchtitan(python):
        pytest.skip(f"torchtitan is not importable from {python} (set ZBPIPE_TORCHTITAN_PYTHON to a Python that "
                    "has torchtitan 0.3.0; docs/torchtitan.md, 'Run on torchtitan 0.3.0')")
    proc = subprocess.run([python, str(SCRIPT), "--schedules", "ZBVZeroBubble", "--steps", "2", "--no-torch-split",
                           "--timeout", "400"], cwd=NEUTRAL_CWD, capture_output=True, text=True, timeout=900,
                          env=child_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "classes: zbpipe.schedules.ScheduleZBVZeroBubble, zbpipe.stage.PipelineStage against torch." in proc.stdout
    assert "1/1 schedules on zbpipe equal torch's run within 1e-05" in proc.stdout, proc.stdout
