"""benchmarks/gpu_quick.sh, the first GPU run's script, checked without a GPU: it parses
(bash -n); its plan numbers every step, bounds each by a timeout and keeps the one-GPU steps
within 8 minutes; run on the CPU (GPU_QUICK_DEVICE=cpu, some steps), it writes one PASS, FAIL
or SKIP line per step with its number into the summary file, then the verdict; and each of its
Python checks (benchmarks/gpu_checks.py) runs on the CPU where it has a meaning there, and
answers SKIP for CUDA without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.subprocess_env import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_quick.sh"
CHECKS = ROOT / "benchmarks" / "gpu_checks.py"
ONE_GPU_STEPS = range(1, 9)
BUDGET_S = 8 * 60


def _run(cmd, env=None, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(child_env(), **(env or {})))


def test_the_script_parses():
    done = _run(["bash", "-n", str(SCRIPT)])
    assert done.returncode == 0, done.stderr


def test_every_step_is_numbered_bounded_and_the_one_gpu_steps_fit_eight_minutes():
    done = _run(["bash", str(SCRIPT)], env={"GPU_QUICK_DRY": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr
    plan = [re.match(r"^PLAN (\d+) (.+) \(timeout (\d+) s\): (.+)$", line) for line in done.stdout.splitlines()]
    assert plan and all(plan), done.stdout
    numbers = [int(p.group(1)) for p in plan]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    limits = {int(p.group(1)): int(p.group(3)) for p in plan}
    assert sum(limits[n] for n in ONE_GPU_STEPS) <= BUDGET_S, limits
    commands = {int(p.group(1)): p.group(4) for p in plan}
    assert "CUDA_LAUNCH_BLOCKING=1" in commands[3]
    for n, what in ((4, "autocast"), (5, "sync"), (6, "nccl"), (7, "memory"), (8, "bench")):
        assert f"gpu_checks.py {what} --device cuda" in commands[n], (n, commands[n])
    assert "--stopped-s 90" in commands[12] and "-k nccl" in commands[9]
    # Every numbered step is a call of step(), which runs its command under `timeout` and
    # writes its line; nothing else in the script runs a check.
    source = SCRIPT.read_text()
    assert source.count('timeout --kill-after=10 "$limit" "$@"') == 1
    assert sorted({int(n) for n in re.findall(r"^\s*step (\d+) ", source, flags=re.M)}) == numbers


def test_some_steps_on_the_cpu_write_their_lines_and_the_verdict(tmp_path):
    summary = tmp_path / "summary.md"
    done = _run(["bash", str(SCRIPT)], env={"GPU_QUICK_ONLY": "5 6 7 8", "GPU_QUICK_DEVICE": "cpu",
                                            "SUMMARY": str(summary), "OUT": str(tmp_path / "out")}, timeout=400)
    text = summary.read_text()
    lines = [line for line in text.splitlines() if re.match(r"^(PASS|FAIL|SKIP) \d+ ", line)]
    assert [line.split()[:2] for line in lines] == [["SKIP", "5"], ["PASS", "6"], ["PASS", "7"], ["PASS", "8"]], text
    assert "Gloo world of one: ProcessGroup.abort(), destroy_process_group, init again" in lines[1]
    assert "1f1b gap" in lines[3] and "run-queue" in lines[3]
    assert text.startswith("# gpu_quick.sh summary") and "commit:" in text and "torch:" in text
    assert text.rstrip().endswith("verdict: every step passed or was skipped"), text
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out" / "summary.md").read_text() == text  # the copy in $OUT
    assert (tmp_path / "out" / "bench_pp1.json").exists()


def _check(*args, timeout=300):
    done = _run([sys.executable, str(CHECKS), *args], timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert lines and re.match(r"^(PASS|FAIL|SKIP) \w+: ", lines[-1]), (done.stdout, done.stderr)
    word = lines[-1].split()[0]
    assert done.returncode == {"PASS": 0, "FAIL": 1, "SKIP": 77}[word], (done.returncode, lines[-1])
    return word, lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
@pytest.mark.parametrize("check", ["autocast", "sync", "nccl", "memory", "bench"])
def test_each_check_answers_skip_for_cuda_without_a_gpu(check):
    word, line = _check(check, "--device", "cuda", timeout=120)
    assert word == "SKIP" and "no CUDA GPU" in line, line


def test_the_checks_run_on_the_cpu():
    assert _check("sync", "--device", "cpu")[0] == "SKIP"  # CUDA's alone
    for check in ("nccl", "memory"):
        word, line = _check(check, "--device", "cpu")
        assert word == "PASS", line
    # Autocast inside the stages (float32 boundaries): equal to one process under autocast,
    # much closer to it than autocast's own effect. With bf16 boundaries, as users write it,
    # the check answers in its format either way: it fails until shape inference follows
    # autocast (issue 44: the pipeline agrees on float32 where the forward gives bfloat16).
    word, line = _check("autocast", "--device", "cpu", "--boundaries", "float32")
    assert word == "PASS" and "autocast's own effect" in line, line
    _check("autocast", "--device", "cpu")


def test_the_recovery_check_on_gloo():
    word, line = _check("recovery", "--device", "cpu", "--stopped-s", "1", timeout=300)
    assert word == "PASS", line
    assert "on WORLD:" in line and "on a new_group:" in line
