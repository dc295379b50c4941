"""What zbpipe/control_plane.py warns about, once per process, when a schedule builds its
executor: a store without blocking waits (a FileStore or a custom store: the control plane
polls it) and a pipeline on NCCL on the default group (a failure aborts the pipeline group's
communicators on every rank, which there are WORLD's)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zbpipe
import zbpipe.control_plane as cp
from zbpipe import _C


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(cp, "_warned", set())


class _Backend:
    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


class _Group:
    def __init__(self, name):
        self._backend = _Backend(name)

    def _get_backend(self, device):
        return self._backend


def test_nccl_on_the_default_group_warns_once():
    world = _Group("nccl")
    with pytest.warns(UserWarning, match=r"default process group with NCCL.*dist\.new_group"):
        assert cp.warn_if_default_nccl_group(world, "cuda:0", default_group=world)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cp.warn_if_default_nccl_group(world, "cuda:0", default_group=world)  # once per process


def test_a_group_of_its_own_or_gloo_does_not_warn():
    world = _Group("nccl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cp.warn_if_default_nccl_group(_Group("nccl"), "cuda:0", default_group=world)
        gloo = _Group("gloo")
        assert not cp.warn_if_default_nccl_group(gloo, "cpu", default_group=gloo)


def test_a_store_without_blocking_waits_warns_once(tmp_path):
    polled = dist.ProcessGroup(dist.FileStore(str(tmp_path / "store"), 1), 0, 1)
    assert _C._store_polled(polled)
    with pytest.warns(UserWarning, match=r"no blocking wait .* polled"):
        assert cp.warn_if_polled(polled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cp.warn_if_polled(polled)


class _PythonStore(dist.Store):
    """A custom store, as a user may write one: no queues."""

    def __init__(self):
        super().__init__()
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value

    def get(self, key):
        return self.kv[key]


def test_a_custom_python_store_is_polled():
    assert _C._store_polled(dist.ProcessGroup(_PythonStore(), 0, 1))


def test_a_store_with_blocking_waits_does_not_warn():
    world = _C._LoopbackWorld(1, store=True)  # a HashStore: blocking queue pops
    assert not _C._store_polled(world.group(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cp.warn_if_polled(world.group(0))


def test_the_schedule_asks_both_for_its_group(monkeypatch):
    seen = []
    monkeypatch.setattr("zbpipe.schedule_runner.warn_if_polled", lambda group: seen.append(("polled", group)))
    monkeypatch.setattr("zbpipe.schedule_runner.warn_if_default_nccl_group",
                        lambda group, device: seen.append(("default", group)))
    world = _C._LoopbackWorld(1)
    stage = zbpipe.PipelineStage(nn.Linear(4, 4), 0, 1, "cpu", group=world.group(0))
    zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss).step(torch.randn(4, 4), target=torch.randn(4, 4))
    assert seen == [("default", world.group(0)), ("polled", world.group(0))], seen
