"""Runs a function in `world` spawned local processes joined by one process group, and never
leaves anything behind: a failed rank, a deadline, Ctrl-C or the parent dying all end every child.

Rendezvous is a FileStore in a fresh temporary directory, so concurrent runs on one machine
cannot collide on a port. Gloo is bound to the loopback interface (127.0.0.1), with
`gloo_devices` devices on it (default 2: zbpipe routes the two directions of a rank pair through
different ones); `device="cuda"` selects NCCL with rank r on cuda:(r % device_count).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM this child if the parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _child(
    rank: int,
    world: int,
    tmp: str,
    device: str,
    pg_timeout_s: float,
    threads: int,
    gloo_devices: int,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    _die_with_parent()
    # The parent owns Ctrl-C handling; a child interrupted mid-collective would only add noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One Gloo device (own connections and transport thread) per entry; zbpipe sends the two
    # directions of a rank pair through different ones (see csrc/runtime/p2p.h, wire_tag).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", ",".join(["lo"] * gloo_devices))
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend, dev = "nccl", torch.device("cuda", torch.cuda.current_device())
    else:
        backend, dev = "gloo", torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
        **({"device_id": dev} if backend == "nccl" else {}),
    )
    try:
        fn(rank, world, dev, *args)
        # Tear down together: a rank destroying its group while a peer still has transfers in
        # flight can abort the peer inside the backend.
        dist.barrier()
    except BaseException as e:
        # Peers of a crashed rank fail right after it ("connection closed"); the timestamp lets
        # the parent name the rank that failed first, the root cause.
        with open(os.path.join(tmp, f"error.{rank}"), "w") as f:
            f.write(f"{time.time()!r}\n{type(e).__name__}: {e}".strip()[:2000])
        raise
    finally:
        dist.destroy_process_group()


def run_local(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    *,
    device: str = "cpu",
    timeout_s: float = 600.0,
    pg_timeout_s: float = 120.0,
    threads: int = 1,
    gloo_devices: int = 2,
) -> None:
    """Calls `fn(rank, world, torch_device, *args)` in `world` spawned processes.

    `fn` and `args` must be picklable (module-level function). Raises RuntimeError naming the
    first rank that failed (its traceback is on stderr) or TimeoutError after `timeout_s`;
    every blocking communication inside is bounded by `pg_timeout_s`.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="zbpipe_run_") as tmp:
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world, tmp, device, pg_timeout_s, threads, gloo_devices, fn, args),
                daemon=True,
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.exitcode for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    raise RuntimeError(_failure_message(tmp, failed, codes))
                if all(c == 0 for c in codes):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"local run of {world} ranks exceeded {timeout_s:.0f} s")
                time.sleep(0.05)
        finally:
            _stop([p for p in procs if p.pid is not None])


def _failure_message(tmp: str, failed: list[int], codes: list) -> str:
    """Names the earliest failure among the ranks that recorded one, else the first exit."""
    first, when, what = failed[0], float("inf"), ""
    for r in range(len(codes)):
        try:
            with open(os.path.join(tmp, f"error.{r}")) as f:
                stamp, _, text = f.read().partition("\n")
        except OSError:
            continue
        if float(stamp) < when:
            first, when, what = r, float(stamp), text
    detail = f": {what}" if what else f" with code {codes[first]}"
    return f"rank {first} failed first{detail} (exited so far: {failed}; tracebacks on stderr)"


def _stop(procs: list) -> None:
    """Terminate, wait briefly, then kill whatever is still alive."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)
