"""Spawned Gloo worlds on 127.0.0.1 for the runtime tests: bounded time, always cleaned up.

run_world(pp, fn, *args) starts pp processes, each calling fn(rank, pp, *args) after
init_process_group, and returns {rank: result} plus the exit codes. A worker that raises
returns {"error": traceback}; processes still alive at the deadline are killed (and reported).
`gloo_devices` loopback devices back the group (with two, zbpipe sends the two directions of a
rank pair through different ones).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, pp, port, gloo_devices, fn, args, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["GLOO_SOCKET_IFNAME"] = ",".join(["lo"] * gloo_devices)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp,
            timeout=timedelta(seconds=60),
        )
        result = fn(rank, pp, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    out.put((rank, result))
    out.close()
    out.join_thread()  # flush to the parent before the hard exit
    # Leave without the group's teardown: after a failure test the group holds unmatched
    # messages, and a normal exit must not wait on them.
    os._exit(0)


def run_world(pp: int, fn, *args, timeout: float = 120.0, gloo_devices: int = 1):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, pp, port, gloo_devices, fn, args, out), daemon=True) for r in range(pp)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < pp and time.monotonic() < deadline:
            try:
                rank, res = out.get(timeout=0.5)
                results[rank] = res
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
        for p in procs:
            p.join(max(0.0, min(10.0, deadline - time.monotonic())))
    finally:
        leftover = []
        for r, p in enumerate(procs):
            if p.is_alive():
                leftover.append(r)
                p.kill()
                p.join(5)
    codes = [p.exitcode for p in procs]
    return results, codes, leftover
