"""A peer killed between steps does not cost the program comparison its timeout: rank 1 runs a
step, then is SIGKILLed (as right after ScheduleAuto's last tuning step), and rank 0 starts a
new schedule on the same group, whose first step compares programs with every peer through
the store. The dead peer's heartbeat (failure_watch.h) stops, so rank 0 raises PipelineError
naming it within seconds, not at the timeout (100 s; the test's bound is 30 s). pp=2 in child
processes, Gloo over a FileStore (the store outlives the killed rank)."""

from __future__ import annotations

import json
import time

from helpers.subprocess_env import rank_workers

BOUND_S = 30.0
WORKER = r'''
import json, os, signal, sys, time
from pathlib import Path
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
import zbpipe

rank, tmp = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
x, y = torch.randn(4, 8), torch.randn(4, 8)

def schedule():
    stage = zbpipe.PipelineStage(nn.Linear(8, 8), rank, 2, "cpu")
    return zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=100)

first = schedule()
first.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)
t0 = time.monotonic()
try:
    schedule().step(x)
    out = ["ok", ""]
except BaseException as e:
    out = [type(e).__name__, str(e)]
out.append(time.monotonic() - t0)
(tmp / "result0.json").write_text(json.dumps(out))
os._exit(0)
'''


def test_a_peer_killed_between_steps_ends_the_program_comparison(tmp_path):
    with rank_workers(WORKER, tmp_path, 2) as procs:
        procs[1].wait(timeout=180)  # killed after its step (the first start may be slow)
        start = time.monotonic()
        while procs[0].poll() is None and time.monotonic() < start + BOUND_S:
            time.sleep(0.05)
        assert procs[0].poll() is not None, f"rank 0 still waiting {BOUND_S} s after rank 1 was killed"
    kind, msg, seconds = json.loads((tmp_path / "result0.json").read_text())
    print(f"rank 0: {kind} after {seconds:.1f} s: {msg.splitlines()[0] if msg else ''}")
    assert kind == "PipelineError", (kind, msg)
    assert "no program from rank 1: its process stopped" in msg, msg
