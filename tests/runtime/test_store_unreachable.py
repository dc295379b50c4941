"""The job's store server dies mid-training (its host process ends): steps that need no store go
on -- after the first, a step asks nothing of the store (its signature and the replicas'
meetings travel over the control groups, the failure watch only waits) -- and a step that needs
it (a new schedule's first step: the executor's ids and the program agreement go through the
store) fails with PipelineError naming the store and its address, at once rather than at a
timeout. pp=2 in child processes, Gloo, against a TCPStore server in a process of its own
that the test kills after two steps."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from helpers.subprocess_env import NEUTRAL_CWD, child_env, free_port, rank_workers, wait_for_file

BOUND_S = 60.0
TIMEOUT_S = 20.0  # the schedules' and the store's bound on every wait
SERVER = r'''
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, timeout=datetime.timedelta(seconds=60),
                      wait_for_workers=False)
print("up", flush=True)
sys.stdin.read()
'''
WORKER = r'''
import datetime, json, sys, time
from pathlib import Path
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
import zbpipe

rank, tmp, port = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
x, y = torch.randn(4, 8), torch.randn(4, 8)

def schedule():
    stage = zbpipe.PipelineStage(nn.Linear(8, 8), rank, 2, "cpu")
    return zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=TIMEOUT_S)

def step(sched):
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)

out = {}
sched = schedule()
for _ in range(2):
    step(sched)
(tmp / f"ready{rank}").touch()
while not (tmp / "killed").exists():
    time.sleep(0.05)
try:
    for _ in range(3):
        step(sched)
    out["steady"] = ["ok", ""]
except BaseException as e:
    out["steady"] = [type(e).__name__, str(e)]
t0 = time.monotonic()
try:
    step(schedule())
    out["new"] = ["ok", ""]
except BaseException as e:
    out["new"] = [type(e).__name__, str(e)]
out["new"].append(time.monotonic() - t0)
(tmp / f"result{rank}.json").write_text(json.dumps(out))
import os
os._exit(0)
'''.replace("TIMEOUT_S", repr(TIMEOUT_S))


def test_steps_go_on_without_the_store_and_a_step_that_needs_it_names_it(tmp_path):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env(), cwd=NEUTRAL_CWD)
    try:
        assert server.stdout.readline().strip() == "up"
        with rank_workers(WORKER, tmp_path, 2, str(port)) as procs:
            start = time.monotonic()
            for r in range(2):
                wait_for_file(tmp_path / f"ready{r}", procs, start + 180)  # the first start may be slow
            server.kill()
            server.wait()
            (tmp_path / "killed").touch()
            for r in range(2):
                wait_for_file(tmp_path / f"result{r}.json", procs, time.monotonic() + BOUND_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    for r in range(2):
        res = json.loads((tmp_path / f"result{r}.json").read_text())
        assert res["steady"] == ["ok", ""], (r, res)
        kind, msg, seconds = res["new"]
        print(f"rank {r}: {kind} after {seconds:.2f} s: {msg.splitlines()[0] if msg else ''}")
        assert kind == "PipelineError", (r, res)
        assert f"TCPStore at 127.0.0.1:{port}" in msg.splitlines()[0], (r, msg)
        assert seconds < TIMEOUT_S, (r, seconds)  # the dead store answered at once, not at a timeout
