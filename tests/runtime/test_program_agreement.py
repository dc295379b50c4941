"""A peer killed between steps does not cost the program comparison its timeout: rank 1 runs a
step, then is SIGKILLed (as right after ScheduleAuto's last tuning step), and rank 0 starts a
new schedule on the same group, whose first step compares programs with every peer through
the store. The dead peer's heartbeat (failure_watch.h) stops, so rank 0 raises PipelineError
naming it within seconds, not at the timeout (100 s; the test's bound is 30 s). pp=2 in child
processes, Gloo over a FileStore (the store outlives the killed rank)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from helpers.subprocess_env import rank_workers

import zbpipe
from zbpipe import _C

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


def _fake_peer(store, events, stop):
    """Group rank 1 of a loopback world, acting out a process between two executors: its watch
    "77" never reads the first ping (it was winding down), it is parked for a while, then its
    new watch "78" answers every ping; last, it sends a program of its own."""
    store.set("zbpipe/alive/rank1", "watching 77")
    events.set()  # rank 0 may start
    deadline = time.monotonic() + 20
    while store.queue_len("zbpipe/x77/inbox/rank1") == 0:  # the first ping, left unread
        assert time.monotonic() < deadline and not stop.is_set(), "no ping came"
        time.sleep(0.02)
    store.set("zbpipe/alive/rank1", "parked")
    time.sleep(2.5)  # past rank 0's next ask (every 2 s)
    store.set("zbpipe/alive/rank1", "watching 78")
    answered, until = 0, time.monotonic() + 4.5  # past two more asks
    while time.monotonic() < until and not stop.is_set():
        if store.queue_len("zbpipe/x78/inbox/rank1") > 0:
            ping = store.queue_pop("zbpipe/x78/inbox/rank1", False).decode()
            assert ping.startswith("ping 0\n"), ping
            store.queue_push(ping.split("\n", 1)[1], "pong 1")
            answered += 1
        time.sleep(0.02)
    executor = store.add("zbpipe/executors/rank0", 0)  # rank 0's executor, whose inbox this is
    store.queue_push(f"zbpipe/x{executor}/inbox/rank0", "program 1\nschedule=a-program-of-its-own")
    return answered


def test_a_peer_between_executors_is_not_named_dead():
    """A peer whose first ping went unread, that was then parked and then answered through a new
    watch lives: before, the unread ping counted against the new watch, and a second ping was
    named unanswered the moment it was sent ("no program from rank 1: its process stopped")."""
    world = _C._LoopbackWorld(2, store=True)
    store = world.group(1).get_group_store()
    ready, stop, out = threading.Event(), threading.Event(), {}

    def peer():
        try:
            out["answered"] = _fake_peer(store, ready, stop)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["peer"] = e

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    assert ready.wait(20)
    stage = zbpipe.PipelineStage(torch.nn.Linear(4, 4), 0, 2, "cpu", group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=30)
    try:
        with pytest.raises(zbpipe.PipelineError) as info:
            sched.step(torch.randn(4, 4))
    finally:
        stop.set()
        t.join(30)
    assert "peer" not in out, out
    msg = str(info.value)
    assert "the ranks run different programs" in msg and "a-program-of-its-own" in msg, msg
    assert out["answered"] >= 1, out  # its new watch was asked, and answered
