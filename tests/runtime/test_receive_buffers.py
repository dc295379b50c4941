"""Receive buffers of integral boundaries start zero-filled: after an abort on a GPU, kernels
already queued after a receive that never came still run, and an embedding or gather reading
uninitialised int64 ids there raises a device assert, a sticky CUDA error that makes the
in-process recovery impossible. Floating buffers stay uninitialised (their bytes are the large
ones; reading garbage floats breaks nothing). Shown on the loopback world with stream-like
waits (Work::wait returns at once, as on a GPU), where the receiver's compute runs on the
buffer of a receive whose sender failed before sending."""

from __future__ import annotations

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import run_threads

import zbpipe
from zbpipe import _C

PP, M, ROWS, IDS = 2, 4, 2, 16
SENTINEL = 12345  # the ids of the first step, in memory the allocator hands back later


class Ids(nn.Module):
    """Stage 0: x -> (x * w, ids), ids int64 [ROWS, IDS]; raises in `fail_after`'s step once
    `go` is set (the receiver's forward has run on the unfilled buffer)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.failing, self.go = False, threading.Event()

    def forward(self, x):
        if self.failing:
            assert self.go.wait(30), "the receiver's forward never ran"
            raise RuntimeError("this rank fails before sending")
        return x * self.w, torch.full((x.size(0), IDS), SENTINEL, dtype=torch.long)


class Reads(nn.Module):
    """Stage 1: (h, ids) -> h * v; records the ids each forward saw."""

    def __init__(self, seen, go):
        super().__init__()
        self.v = nn.Parameter(torch.ones(4))
        self.seen, self.go, self.watching = seen, go, False

    def forward(self, h, ids):
        if self.watching:
            self.seen.append(ids.clone())
            self.go.set()
        return h * self.v


def test_an_integral_receive_whose_sender_failed_reads_zeros():
    world = _C._LoopbackWorld(PP, stream_waits=True, store=True)
    first = Ids()
    seen: list[torch.Tensor] = []
    mods = [first, Reads(seen, first.go)]
    x, y = torch.randn(ROWS * M, 4), torch.randn(ROWS * M, 4)

    def rank_main(r):
        stage = zbpipe.PipelineStage(mods[r], r, PP, "cpu", group=world.group(r))
        sched = zbpipe.Schedule1F1B(stage, M, loss_fn=F.mse_loss, stream_ordered=True, timeout=30.0)
        args, target = ((x,) if r == 0 else ()), (y if r == PP - 1 else None)
        sched.step(*args, target=target)  # negotiates the shapes
        if r == 0:
            first.failing = True
        else:
            # Memory the allocator hands back to this thread next holds the ids of a message.
            junk = [torch.full((ROWS, IDS), SENTINEL, dtype=torch.long) for _ in range(64)]
            del junk
            mods[1].watching = True
        try:
            sched.step(*args, target=target)
        except zbpipe.PipelineError as e:
            return str(e)
        return "ok"

    out = run_threads(world, rank_main, timeout=90)
    assert "this rank fails before sending" in str(out[0]), out[0]
    assert "aborted because rank 0 failed" in str(out[1]), out[1]
    # The receiver computed on its receive's buffer (the host ran ahead: stream-like waits),
    # which no message reached: zeros, not what the memory held before.
    assert seen, "the receiver's forward did not run on the unfilled buffer"
    assert seen[0].dtype == torch.long and seen[0].shape == (ROWS, IDS)
    assert bool((seen[0] == 0).all()), seen[0]
