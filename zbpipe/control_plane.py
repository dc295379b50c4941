"""The Python side of zbpipe's control plane (csrc/runtime/control_group.h, failure_watch.h):
the Gloo control groups the executor asks for, and the warnings a setup deserves once.

Each step's input signature and the data-parallel replicas' meetings travel over small CPU
groups of their own, one per executor and group, opened after the ranks met through the store.
`gloo_control_group` makes one: a Gloo group over the group's store (prefixed for it), on the
interface GLOO_SOCKET_IFNAME names first (else the host's), with one worker thread. Its pairs
connect when it is made (every rank is there: the ranks just met), so a later send never waits
for a peer to connect -- a peer that failed and left meanwhile would keep it waiting until the
timeout, on a thread nothing can interrupt. Groups above EAGER_CONNECT ranks (data-parallel
groups of large jobs) connect a pair at its first message instead, which the replicas' first
meeting over the group makes for every pair it uses (csrc/runtime/replica_barrier.cpp).
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

from . import _C

_warned: set[str] = set()  # what this process has warned about
EAGER_CONNECT = 64  # ranks: a full mesh of sockets, and its rendezvous through the store, up to here


def gloo_control_group(store, rank: int, size: int, timeout_s: float):
    """A CPU process group of `size` ranks over `store` (already prefixed for it): what the
    executor's ExecutorOptions::control_group calls. Blocks until every rank made it."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    lazy = size > EAGER_CONNECT
    device = (dist.ProcessGroupGloo.create_device(interface=interfaces[0], lazy_init=lazy) if interfaces
              else dist.ProcessGroupGloo.create_default_device(lazy_init=lazy))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._threads = 1  # a few small messages per step
    options._timeout = datetime.timedelta(seconds=timeout_s)
    backend = dist.ProcessGroupGloo(store, rank, size, options)
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def _warn_once(key: str, text: str) -> bool:
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(text, UserWarning, stacklevel=4)
    return True


def warn_if_polled(group) -> bool:
    """Warns once per process where `group`'s store has no blocking wait (a FileStore, a custom
    store): zbpipe's control plane then polls it. Returns whether it warned now."""
    try:
        polled = _C._store_polled(group)
    except Exception:  # noqa: BLE001 - a group without store: nothing goes through one
        return False
    if not polled:
        return False
    return _warn_once("polled", (
        "zbpipe: the process group's store has no blocking wait (a FileStore or a custom store): failures, "
        "the ranks' program agreement and the replicas' first meeting are polled through it (every 0.05 s "
        "during a step, 0.5 s between steps) instead of being answered by the server; a TCPStore "
        "(init_method='tcp://...' or 'env://', torchrun's) asks nothing of the store between failures "
        "(docs/runtime.md#failures)"))


def backend_name(group, device) -> str | None:
    """The name of `group`'s backend for `device` ("nccl", "gloo", ...), or None."""
    try:
        return group._get_backend(torch.device(device)).name().lower()
    except Exception:  # noqa: BLE001 - no backend for that device, or a group that does not say
        return None


def warn_if_default_nccl_group(group, device, default_group=None) -> bool:
    """Warns once per process where the pipeline runs on NCCL on the default group: a failure
    aborts the failing rank's communicators of the pipeline group (and every peer's, when its
    watcher hears of it), which is then every collective of the job on WORLD. Returns whether
    it warned now."""
    if default_group is None:
        try:
            default_group = dist.distributed_c10d._get_default_group()
        except Exception:  # noqa: BLE001 - no default group: nothing to compare
            return False
    if group is not default_group or backend_name(group, device) != "nccl":
        return False
    return _warn_once("default_nccl", (
        "zbpipe: the pipeline runs on the default process group with NCCL: after a failure zbpipe aborts the "
        "pipeline group's communicators on every rank (so no rank waits for NCCL's watchdog), which here are "
        "WORLD's, every collective of the job; give the stages a group of their own, "
        "PipelineStage(..., group=dist.new_group(ranks)) (docs/nccl.md#a-group-of-its-own)"))
