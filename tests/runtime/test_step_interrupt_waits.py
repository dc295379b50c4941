"""Ctrl-C interrupts the waits before a step's first action: the ranks' program comparison
(program_agreement.cpp, before a new executor's first step: a schedule's first step, and
ScheduleAuto's first step on its chosen program, which runs the same comparison) and the shape
handshake (handshake.cpp). pp=2 in child processes (Gloo over a
FileStore), timeout 100 s: one rank waits on its peer, which holds back until the test releases
it, when the waiting rank gets SIGINT. It must raise KeyboardInterrupt long before the
timeout (before the fix, the comparison's polling loop ignored Ctrl-C until its timeout)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from helpers.subprocess_env import rank_workers, wait_for_file

BOUND_S = 30.0  # far below the waits' timeout (100 s)
WORKER = r'''
import json, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at an interactive start
from pathlib import Path
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
import zbpipe

rank, tmp, mode = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)

def hold():
    (tmp / "holding").touch()
    while not (tmp / "released").exists():
        time.sleep(0.05)

class ShapeHold(nn.Linear):
    """Stage 0 in mode handshake: its shape inference (a no-grad run) holds."""
    def forward(self, x):
        if not torch.is_grad_enabled():
            hold()
        return super().forward(x)

module = ShapeHold(8, 8) if mode == "handshake" and rank == 0 else nn.Linear(8, 8)
stage = zbpipe.PipelineStage(module, rank, 2, "cpu")
sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=100)
x, y = torch.randn(4, 8), torch.randn(4, 8)
step = lambda: sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
waiter = 0 if mode == "agreement" else 1
out = {}
try:
    if rank != waiter and mode != "handshake":
        hold()
    else:
        if rank == waiter:
            (tmp / "waiting").touch()
        step()
    out["first"] = ["ok", ""]
except BaseException as e:
    out["first"] = [type(e).__name__, str(e)]
    (tmp / f"reported{rank}").touch()
(tmp / f"result{rank}.json").write_text(json.dumps(out))
os._exit(0)  # unmatched messages may remain in the group: no teardown
'''


@pytest.mark.parametrize("mode", ["agreement", "handshake"])
def test_ctrl_c_interrupts_the_waits_before_the_first_action(tmp_path, mode):
    waiter = 0 if mode == "agreement" else 1
    with rank_workers(WORKER, tmp_path, 2, mode) as procs:
        try:
            start = time.monotonic() + 120  # the first start may be slow
            wait_for_file(tmp_path / "waiting", procs, start)
            wait_for_file(tmp_path / "holding", procs, start)
            time.sleep(1.0)  # the waiting rank is now inside its wait
            os.kill(procs[waiter].pid, signal.SIGINT)
            sent = time.monotonic()
            wait_for_file(tmp_path / f"reported{waiter}", procs, sent + BOUND_S)
            took = time.monotonic() - sent
            (tmp_path / "released").touch()
            for p in procs:
                p.wait(timeout=BOUND_S)
        finally:
            (tmp_path / "released").touch()
    result = json.loads((tmp_path / f"result{waiter}.json").read_text())
    print(f"{mode}: KeyboardInterrupt {took:.2f} s after SIGINT")
    assert result["first"][0] == "KeyboardInterrupt", (result, took)
