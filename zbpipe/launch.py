"""Spawned local worlds: `size` processes joined by one process group, for the trainer, the
benchmarks and the tests, in bounded time and never leaving a process behind.

    with LocalWorld(2) as world:                 # nothing starts yet
        sums = world.run(fn, x)                  # fn(rank, size, x) on every rank -> [result per rank]
        more = world.run(other)                  # same processes, same group
    run_local(fn, 2, (x,))                       # one run in a world of its own

Rendezvous is a TCPStore the parent hosts on 127.0.0.1 for the world's life, on a port the
system picks, so concurrent worlds on one machine cannot collide on a port, and zbpipe's control
plane gets the store it is built for (failures pushed by the server; a FileStore is polled).
Gloo runs on the loopback interface (127.0.0.1), with `gloo_devices` devices on it
(GLOO_SOCKET_IFNAME=lo,lo for 2: zbpipe routes the two directions of a rank pair through
different ones); `device="cuda"` selects NCCL (Gloo for CPU tensors) with rank r on
cuda:(r % device_count), and `rank_device()` is a rank's torch device.

A world stays up between runs while every rank returns. When any rank raises or dies, or the
run passes its deadline, every process of the world ends (a failed rank can leave its peers
blocked inside a collective) and the next run starts a new world. Processes also end when the
parent dies (even by SIGKILL) and on Ctrl-C, which only the parent handles.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_DEVICE: torch.device | None = None  # set in each spawned rank


def rank_device() -> torch.device:
    """This rank's device in a spawned world (cuda:k under NCCL, else cpu)."""
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


class RankFailure(RuntimeError):
    """A run in which a rank raised or exited. `errors`: rank -> "Type: message" (or its exit
    code); `tracebacks`: rank -> traceback text; `results`: rank -> value of the ranks that
    returned before the world was stopped."""

    def __init__(self, message: str, errors: dict, tracebacks: dict, results: dict):
        super().__init__(message)
        self.errors, self.tracebacks, self.results = errors, tracebacks, results


def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM this child if the parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _init_rank(rank: int, size: int, port: int, device: str, pg_timeout_s: float, threads: int,
               gloo_devices: int | None) -> None:
    global _DEVICE
    _die_with_parent()
    # The parent owns Ctrl-C handling; a child interrupted mid-collective would only add noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gloo_devices is not None:
        # One Gloo device (own connections and transport thread) per entry; zbpipe sends the two
        # directions of a rank pair through different ones (see csrc/runtime/p2p.h, wire_tag).
        os.environ["GLOO_SOCKET_IFNAME"] = ",".join(["lo"] * gloo_devices)
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        # NCCL for CUDA tensors, Gloo for the CPU ones a run may still exchange (objects, flags).
        backend, _DEVICE = "cpu:gloo,cuda:nccl", torch.device("cuda", torch.cuda.current_device())
    else:
        backend, _DEVICE = "gloo", torch.device("cpu")
    dist.init_process_group(
        backend,
        store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=pg_timeout_s)),
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
        **({"device_id": _DEVICE} if device == "cuda" else {}),
    )


def _rank_main(rank: int, size: int, config: tuple, jobs, results) -> None:
    """Runs the jobs of the parent, one at a time, until told to stop (None)."""
    try:
        _init_rank(rank, size, *config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops the world
        results.put((None, rank, False, (time.time(), f"{type(e).__name__}: {e}", traceback.format_exc())))
        results.close()
        results.join_thread()
        os._exit(1)
    while (job := jobs.get()) is not None:
        job_id, payload = job
        try:
            fn, args = pickle.loads(payload)
            reply = (job_id, rank, True, pickle.dumps(fn(rank, size, *args)))
        except BaseException as e:  # noqa: BLE001 - the parent reports it
            tb = traceback.format_exc()
            sys.stderr.write(f"[rank {rank}] {tb}")
            reply = (job_id, rank, False, (time.time(), f"{type(e).__name__}: {e}".strip()[:4000], tb))
        results.put(reply)
    results.close()
    results.join_thread()  # flush to the parent before the hard exit
    # Leave without the group's teardown: a run may have left unmatched messages in a group
    # (failure tests do), and every rank has returned from its last run by now.
    os._exit(0)


class LocalWorld:
    """`size` spawned ranks joined by one process group, started by the first run and kept for
    the next ones until a run fails or close() is called.

    Args:
        device: "cpu" (Gloo) or "cuda" (NCCL, one GPU per rank).
        gloo_devices: Gloo devices on the loopback interface (None: GLOO_SOCKET_IFNAME as set).
        threads: torch threads per rank.
        pg_timeout_s: the process group's timeout (bounds every blocking collective).
    """

    def __init__(self, size: int, *, device: str = "cpu", gloo_devices: int | None = 2, threads: int = 1,
                 pg_timeout_s: float = 120.0):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got size={size}")
        self.size = size
        self._config = (device, pg_timeout_s, threads, gloo_devices)
        self._procs: list = []
        self._jobs: list = []
        self._results = None
        self._store: dist.TCPStore | None = None  # the world's rendezvous, hosted here
        self._job_id = 0

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (empty while no world is up)."""
        return [p.pid for p in self._procs]

    def _start(self) -> None:
        device = self._config[0]
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False")
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self._config[1]))
        config = (self._store.port, *self._config)
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.size)]
        self._procs = [ctx.Process(target=_rank_main, args=(r, self.size, config, self._jobs[r], self._results),
                                   daemon=True) for r in range(self.size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, settle_s: float = 0.0) -> list:
        """Calls fn(rank, size, *args) on every rank (fn and args picklable: a module-level
        function); returns the ranks' return values in rank order. Blocks until every rank
        returned. Raises RankFailure naming the rank that failed first (its traceback is on
        stderr) once `settle_s` has passed after the first failure (time for the other ranks
        to return what they saw of it), or TimeoutError after `timeout_s` (process start
        included); the world is stopped in both cases. Every blocking communication inside
        is bounded by the process group's timeout."""
        payload = pickle.dumps((fn, args))  # here, so a pickling error is the caller's
        if not self._procs:
            self._start()
        self._job_id += 1
        for q in self._jobs:
            q.put((self._job_id, payload))
        done: dict[int, Any] = {}
        failed: dict[int, tuple[float, str, str]] = {}
        deadline = time.monotonic() + timeout_s
        first_failure = None
        ok = False
        try:
            while len(done) + len(failed) < self.size:
                self._collect(done, failed)
                if failed:
                    first_failure = first_failure or time.monotonic()
                    if time.monotonic() - first_failure >= settle_s:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"local run of {self.size} ranks exceeded {timeout_s:.0f} s")
            ok = not failed
        finally:
            if not ok:
                self.close(graceful=False)
        if failed:
            raise _failure(failed, done)
        return [done[r] for r in range(self.size)]

    def _collect(self, done: dict, failed: dict) -> None:
        """Waits briefly for one reply; records the ranks that exited without one."""
        try:
            job_id, rank, ok, value = self._results.get(timeout=0.05)
            if job_id in (self._job_id, None):
                if ok:
                    done[rank] = pickle.loads(value)
                else:
                    failed[rank] = value
        except queue.Empty:
            for r, p in enumerate(self._procs):
                if p.exitcode is not None and r not in done and r not in failed:
                    failed[r] = (time.time(), f"exited with code {p.exitcode}", "")

    def close(self, graceful: bool = True) -> None:
        """Stops every rank: asks them to leave (graceful), then terminates and kills what is
        still alive after a few seconds. The next run starts a new world."""
        if graceful:
            for p, q in zip(self._procs, self._jobs):
                if p.is_alive():
                    q.put(None)
        end = time.monotonic() + (5.0 if graceful else 0.0)
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for q in [*self._jobs, *([self._results] if self._results is not None else [])]:
            q.cancel_join_thread()  # data a dead rank never read must not block this process
            q.close()
        self._procs, self._jobs, self._results, self._store = [], [], None, None


def _failure(failed: dict, done: dict) -> RankFailure:
    """Names the earliest failure (peers of a crashed rank fail right after it, "connection
    closed": the earliest is the root cause)."""
    first = min(failed, key=lambda r: failed[r][0])
    return RankFailure(
        f"rank {first} failed first: {failed[first][1]} (failed so far: ranks {sorted(failed)}; "
        "tracebacks on stderr)",
        {r: what for r, (_, what, _) in failed.items()},
        {r: tb for r, (_, _, tb) in failed.items()},
        dict(done),
    )


def run_local(fn: Callable[..., Any], size: int, args: tuple = (), *, device: str = "cpu",
              timeout_s: float = 600.0, pg_timeout_s: float = 120.0, threads: int = 1,
              gloo_devices: int | None = 2) -> list:
    """One run of fn(rank, size, *args) in a world of its own (see LocalWorld.run)."""
    with LocalWorld(size, device=device, gloo_devices=gloo_devices, threads=threads,
                    pg_timeout_s=pg_timeout_s) as world:
        return world.run(fn, *args, timeout_s=timeout_s)
