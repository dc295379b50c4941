"""A live peer whose main thread is blocked in a store wait of its own still answers liveness
pings. A TCPStore client serves one request at a time per connection, a blocking wait included
(c10d holds the connection for the wait), so a watcher that answered through the group's
connection could not answer while its main thread waited there -- in `dist.new_group`'s
rendezvous, a user's `store.wait`, or a launcher's job queue -- and a peer comparing programs
named the live rank dead after kDeadAfter (3 s; failure_watch.h). The watcher answers (and
forwards failures) through a connection of its own.

pp=2 in child processes, Gloo over a TCPStore hosted by rank 0 (torchrun's store). Rank 1 runs a
step (its schedule, and so its watch, stays alive), then blocks HOLD_S in `store.wait` on the
group's store, then starts a second schedule; rank 0 starts its second schedule at once, so its
program comparison asks rank 1 whether it lives while rank 1's main thread holds the connection."""

from __future__ import annotations

import json
import time

from helpers.subprocess_env import rank_workers, wait_for_file

HOLD_S = 8.0  # well past kDeadAfter + kAskAfter (4 s): two pings go unanswered without the fix
WORKER = r'''
import datetime, json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
import zbpipe

rank, tmp, hold = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
timeout = datetime.timedelta(seconds=60)
if rank == 0:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    (tmp / "port.tmp").write_text(str(store.port))
    os.replace(tmp / "port.tmp", tmp / "port")
else:
    while not (tmp / "port").exists():
        time.sleep(0.02)
    store = dist.TCPStore("127.0.0.1", int((tmp / "port").read_text()), 2, False, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
x, y = torch.randn(4, 8), torch.randn(4, 8)

def step(sched):
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)

def schedule():
    stage = zbpipe.PipelineStage(nn.Linear(8, 8), rank, 2, "cpu")
    return zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=60)

first = schedule()  # kept: its watch answers the pings
step(first)
if rank == 1:  # the main thread holds the store's connection for `hold` seconds
    try:
        store.wait(["zbpipe-test/never-set"], datetime.timedelta(seconds=hold))
    except Exception:
        pass
t0 = time.monotonic()
try:
    step(schedule())
    out = ["ok", ""]
except BaseException as e:
    out = [type(e).__name__, str(e)]
out.append(time.monotonic() - t0)
(tmp / f"result{rank}.json").write_text(json.dumps(out))
dist.barrier() if out[0] == "ok" else None
os._exit(0)
'''


def test_a_peer_blocked_in_a_store_wait_is_not_named_dead(tmp_path):
    with rank_workers(WORKER, tmp_path, 2, str(HOLD_S)) as procs:
        deadline = time.monotonic() + 180  # the first start may be slow
        for r in range(2):
            wait_for_file(tmp_path / f"result{r}.json", procs, deadline)
        for p in procs:
            p.wait(timeout=60)
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    for r, (kind, msg, seconds) in enumerate(results):
        print(f"rank {r}: {kind} after {seconds:.1f} s: {msg.splitlines()[0] if msg else ''}")
    assert [k for k, _, _ in results] == ["ok", "ok"], results
    # Rank 0's comparison did wait for rank 1 (the pings went out and were answered).
    assert results[0][2] > HOLD_S - 2, results
