"""The training demo end to end: `python -m zbpipe.train` with tiny settings in a subprocess must
exit 0, print progress, and its pipelined loss must equal the single-process loss. Its
throughput and memory printout is sane (values, not timings): tokens/s per device consistent
with the step time and the world size, FLOPs per token by PaLM's formula for the model, MFU in
(0, 1] against a measured CPU peak, and each rank's peak saved-activation bytes near the
simulator's prediction."""

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
RATES = re.compile(r"^step .* \|\s+(\d+) tok/s \|\s+(\d+) tok/s/dev \| MFU\s+(\S+)% \|\s+(\S+) ms/step$", re.M)
THROUGHPUT = re.compile(
    r"^throughput: (\d+) tokens/s per device \((\d+) devices, (\S+) ms/step over (\d+) steps\) \| "
    r"(\d+) FLOPs/token \(6N \+ 12LHQT, N=(\d+)\) \| MFU (\S+)% of (\S+) TFLOP/s per device \((.*)\)$", re.M)
SAVED = re.compile(r"^saved activations rank (\d+) \(stages \[([\d, ]+)\]\): peak (\S+) KiB measured \| (\S+) KiB predicted$", re.M)
MEM_F = re.compile(r"^saved activations per \(stage, microbatch\), measured: \[([\d., ]+)\] KiB", re.M)
BATCH, SEQ, LAYERS, D, HEADS, VOCAB = 32, 32, 4, 64, 4, 16  # the trainer's defaults (zbpipe.train.model)


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
        ("--lib", "zbpipe", "--schedule", "auto", "--steps", "5"),  # ScheduleAuto: measures (4 steps), switches
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
    n = int(args[args.index("--steps") + 1]) if "--steps" in args else 3
    progress = PROGRESS.findall(out)
    assert [int(s) for s, *_ in progress] == list(range(1, n + 1)), out
    assert all(int(total) == n and int(tps) > 0 for _, total, _, tps in progress), out
    m = FINAL.search(out)
    assert m, f"no final comparison line in:\n{out}"
    piped, single, diff, steps, worst, verdict = m.groups()
    piped, single = float(piped), float(single)
    assert int(steps) == n and verdict == "MATCH"
    losses = [float(l) for _, _, l, _ in progress]
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    # The loss the pipeline reported at its last progress line is the one compared.
    assert abs(float(progress[-1][2]) - piped) < 1e-4
    # Same math, only reassociated: equal to float tolerance (and the untrained loss is ~ln 16).
    assert abs(piped - single) <= 1e-5 * max(1.0, abs(single)), (piped, single)
    assert float(worst) <= 1e-5 and 1.0 < single < 3.5
    _check_rates(out, world=2 * (2 if "--dp" in args else 1), zb=zb, steps=n)
    if args[3] == "auto":
        _check_tuning(out)
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


def _check_rates(out: str, world: int, zb: bool, steps: int) -> None:
    """The printout's numbers agree with each other and with the model (torchtitan's metrics);
    zbpipe's ranks hold the saved activations its program predicts (torch's runtime holds more
    than zbpipe's program of the same schedule: not bounded here)."""
    for tps, tps_dev, mfu, ms in RATES.findall(out):
        # rounding of the printed integers only
        assert abs(int(tps) * float(ms) / 1e3 - BATCH * SEQ) <= 0.01 * BATCH * SEQ, (tps, ms)
        assert abs(int(tps_dev) * world - int(tps)) <= world, (tps, tps_dev)
        assert 0 < float(mfu) <= 100, mfu
    m = THROUGHPUT.search(out)
    assert m, f"no throughput line in:\n{out}"
    tps_dev, devices, ms, timed, flops, n, mfu, peak_tflops, source = m.groups()
    assert int(devices) == world and int(timed) == steps - 1  # the first step sets up: not timed
    assert abs(int(tps_dev) * world * float(ms) / 1e3 - BATCH * SEQ) <= 0.01 * BATCH * SEQ, m.group(0)
    # N: every parameter; 6 N counts the matmul ones (not the token and position embeddings).
    block = 4 * D * D + 4 * D + 2 * (D * 4 * D) + 4 * D + D + 4 * D  # qkv+proj, mlp, 2 layer norms
    n_expected = VOCAB * D + SEQ * D + LAYERS * block + 2 * D + D * VOCAB + VOCAB
    assert int(n) == n_expected, (n, n_expected)
    assert int(flops) == 6 * (n_expected - VOCAB * D - SEQ * D) + 12 * LAYERS * HEADS * (D // HEADS) * SEQ
    assert 0 < float(mfu) <= 100 and float(peak_tflops) > 0 and "measured" in source, m.group(0)
    assert abs(float(mfu) / 100 - int(flops) * int(tps_dev) / (float(peak_tflops) * 1e12)) <= 0.05 * float(mfu) / 100 + 1e-4
    mem_f = [float(v) for v in MEM_F.search(out).group(1).split(",")]
    assert mem_f and all(v > 0 for v in mem_f), mem_f
    saved = SAVED.findall(out)
    assert [int(r[0]) for r in saved] == list(range(world)), out
    for rank, stages, measured, predicted in saved:
        assert float(measured) > 0 and float(predicted) >= max(mem_f[int(s)] for s in stages.split(",")), (rank, predicted)
        # The rank holds what the simulator counts under the measured mem_f: at most the
        # prediction (mem_w = mem_f: I frees nothing there), and not far below it.
        assert not zb or 0.5 <= float(measured) / float(predicted) <= 1.02, (rank, measured, predicted)


TUNED_STAGE = re.compile(r"^\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)$", re.M)  # stage F I W B mem


def _check_tuning(out: str) -> None:
    """`--schedule auto` prints the tuning table once, after the tuning's four steps and before
    the step after them, with every stage's measured bytes (the trainer's own saved-activation
    meter chains to the schedule's memory probe instead of hiding the tensors from it)."""
    assert out.count("ScheduleAuto tuning at step 4") == 1, out
    table = out[out.index("ScheduleAuto tuning"):]
    assert table.index("choice: ") < table.index("step     5/5"), out
    stages = TUNED_STAGE.findall(table[:table.index("candidate")])
    assert [int(s[0]) for s in stages] == [0, 1], table
    assert all(int(mem_f) > 100_000 and 0 < int(mem_w) <= int(mem_f) for *_, mem_f, mem_w in stages), table
    # One stage per rank: the third step ran 1f1b, so each stage's fused B was timed.
    assert "(zb_h1, 1f1b, zb_h1)" in table and all(float(s[4]) > 0 for s in stages), table
