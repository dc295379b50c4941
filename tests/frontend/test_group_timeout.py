"""A schedule `timeout` not below a group's own (NCCL) timeout is warned about when the step's
executor is built: NCCL's watchdog would end the process before zbpipe raises
(zbpipe/group_timeout.py). Gloo's own timeout only fails the operation, so Gloo is not checked."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zbpipe
import zbpipe.group_timeout as gt
from zbpipe import _C


class _Backend:
    def __init__(self, name, seconds):
        self._name, self.options = name, type("O", (), {"_timeout": datetime.timedelta(seconds=seconds)})()

    def name(self):
        return self._name


class _Group:
    def __init__(self, name, seconds):
        self._backend = _Backend(name, seconds)

    def _get_backend(self, device):
        return self._backend


@pytest.mark.parametrize("timeout", [600.0, 900.0])
def test_a_timeout_not_below_the_nccl_groups_own_warns(timeout):
    with pytest.warns(UserWarning, match=r"not below the nccl group's own timeout \(600 s\)"):
        said = gt.warn_if_not_below(timeout, [_Group("nccl", 600)], "cpu")
    assert len(said) == 1


def test_a_timeout_below_it_and_gloo_groups_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gt.warn_if_not_below(599.0, [_Group("nccl", 600)], "cpu") == []
        assert gt.warn_if_not_below(900.0, [_Group("gloo", 600)], "cpu") == []
        assert gt.warn_if_not_below(900.0, [object()], "cpu") == []  # no backend options: nothing to compare


def test_the_schedule_checks_its_timeout_against_its_group(monkeypatch):
    seen = []
    monkeypatch.setattr(gt, "group_timeout_s", lambda group, device: seen.append(group) or ("nccl", 10.0))
    world = _C._LoopbackWorld(1)
    stage = zbpipe.PipelineStage(nn.Linear(4, 4), 0, 1, "cpu", group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=10.0)
    with pytest.warns(UserWarning, match=r"timeout=10 s is not below the nccl group's own timeout \(10 s\)"):
        sched.step(torch.randn(4, 4), target=torch.randn(4, 4))
    assert seen and seen[0] is world.group(0)
