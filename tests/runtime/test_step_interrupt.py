"""Ctrl-C during a step: a rank blocked waiting on a peer raises KeyboardInterrupt at once (not
at its wait's timeout), its schedule refuses further steps, and its peers raise PipelineError
"aborted because rank 0 was interrupted". pp=3 in child processes of this test (the spawned
worlds ignore SIGINT), Gloo over a FileStore: rank 2 computes until told to stop, rank 1 waits
on rank 2 and rank 0 on rank 1 when rank 0 gets SIGINT. Rank 2 is released only after ranks 0
and 1 reported, and every wait's timeout (100 s) exceeds the test's bound (60 s): without the
interrupt, rank 0 would wait until the test gives up."""

from __future__ import annotations

import json
import os
import signal
import time

from helpers.subprocess_env import rank_workers, wait_for_file

PP = 3
BOUND_S = 60.0
WORKER = r'''
import json, os, signal, sys, time
# A test run started in the background of a shell without job control inherits SIGINT ignored;
# a user's terminal does not: Python's own handler, as at an interactive start.
signal.signal(signal.SIGINT, signal.default_int_handler)
from pathlib import Path
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
import zbpipe

rank, tmp = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=3)

class Slow(nn.Linear):
    """Stage 2: its first training forward runs until the test releases it."""
    def forward(self, x):
        if torch.is_grad_enabled() and not (tmp / "released").exists():
            (tmp / "computing").touch()
            while not (tmp / "released").exists():
                time.sleep(0.05)
        return super().forward(x)

stage = zbpipe.PipelineStage(Slow(8, 8) if rank == 2 else nn.Linear(8, 8), rank, 3, "cpu")
sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=100)
x, y = torch.randn(4, 8), torch.randn(4, 8)
out = {}
try:
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == 2 else None)
    out["first"] = ["ok", ""]
except BaseException as e:
    out["first"] = [type(e).__name__, str(e)]
    (tmp / f"reported{rank}").touch()
try:  # the schedule refuses to run again
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == 2 else None)
    out["again"] = ["ok", ""]
except BaseException as e:
    out["again"] = [type(e).__name__, str(e)]
(tmp / f"result{rank}.json").write_text(json.dumps(out))
os._exit(0)  # unmatched messages may remain in the group: no teardown
'''


def test_ctrl_c_interrupts_a_waiting_rank_and_its_peers_are_told(tmp_path):
    with rank_workers(WORKER, tmp_path, PP) as procs:
        deadline = time.monotonic() + BOUND_S
        wait_for_file(tmp_path / "computing", procs, deadline + 120)  # the first start may be slow
        time.sleep(1.0)  # ranks 0 and 1 are now blocked waiting on their peers
        os.kill(procs[0].pid, signal.SIGINT)
        deadline = time.monotonic() + BOUND_S
        # (rank 0, interrupted, writes its results and exits 0 meanwhile: wait_for_file allows it)
        for r in (0, 1):
            wait_for_file(tmp_path / f"reported{r}", procs[:2], deadline)
        (tmp_path / "released").touch()
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    results = {r: json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(PP)}
    assert results[0]["first"][0] == "KeyboardInterrupt", results[0]
    assert results[0]["again"][0] == "PipelineError", results[0]
    assert "Create a new process group and schedule" in results[0]["again"][1], results[0]
    for r in (1, 2):
        kind, msg = results[r]["first"]
        assert kind == "PipelineError", (r, results[r])
        assert msg.startswith("aborted because rank 0 was interrupted in stage 0 at action "), (r, msg)
        assert "timeout 100" not in msg, (r, msg)
