"""An exception inside a stage's backward (a custom autograd Function's backward, a hook the
engine calls) fails the step with the usual culprit-first PipelineError, keeping the
exception's type and message in the first line ("rank 1 failed in stage 1 at action 1B0
(microbatch 0): ValueError: ..."), as torch's Python backward would raise it, and the peers'
("aborted because rank 1 failed ..."); a torch C++ error is named as Python names it, without
its C++ backtrace. On B, I and W, and on the OVERLAP_F_B worker thread: never std::terminate.
Two Gloo ranks, one spawned world."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.schedule_registry import local_stages


class _Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("the stage's backward refuses 42")


class Stage(nn.Module):
    """A Linear; on the failing stage a custom Function raising ValueError in its backward
    ("function"), or a hook on the Linear's weight returning the wrong shape ("hook": torch's
    C++ check fails, in W where the split runs the weight side)."""

    def __init__(self, fail: str | None):
        super().__init__()
        self.lin, self.fail = nn.Linear(8, 8), fail
        if fail == "hook":
            self.lin.weight.register_hook(lambda g: g[:1])

    def forward(self, x):
        y = self.lin(x)
        return _Raises.apply(y) if self.fail == "function" else y


def _step(rank, size, name, fail):
    import torch.distributed as dist

    import zbpipe

    group = dist.new_group(list(range(size)), backend="gloo")  # a failed step leaves its group unusable
    prog = zbpipe.compile(name, size, 4)
    n = prog.num_stages
    torch.manual_seed(0)
    mods = [Stage(fail if s == 1 else None) for s in range(n)]
    mine = local_stages(prog, rank)
    stages = [zbpipe.PipelineStage(mods[s], s, n, "cpu", group=group) for s in mine]
    sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], 4, loss_fn=F.mse_loss,
                                            timeout=10)
    try:
        sched.step(*((torch.randn(8, 8),) if 0 in mine else ()), target=torch.randn(8, 8) if n - 1 in mine else None)
    except zbpipe.PipelineError as e:
        return str(e)
    return "no error"


# (schedule, failing kind, the action that fails on rank 1, the summary)
CASES = [
    ("1f1b", "function", r"1B0", r"ValueError: the stage's backward refuses 42"),
    ("zb_h1", "function", r"1I0", r"ValueError: the stage's backward refuses 42"),
    ("zb_h1", "hook", r"1W0", r"RuntimeError: hook '<lambda>' has changed the size of value"),
    ("dualpipev", "function", r"\(\d+F\d+;1B\d\)OVERLAP_F_B|1[BI]\d", r"ValueError: the stage's backward refuses 42"),
]


@pytest.mark.parametrize("name,fail,action,summary", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_backward_exception_keeps_its_type_in_the_first_line(spawn_world, name, fail, action, summary):
    first, second = spawn_world(2).run(_step, name, fail, timeout_s=120)
    culprit = second.splitlines()[0]
    assert re.match(rf"rank 1 failed in stages? .*at action ({action}).*: {summary}$", culprit), culprit
    assert "Exception raised from" not in second  # no C++ backtrace
    if fail == "function":  # this rank alone shows the user's traceback, ending in the raise
        assert "raise ValueError" in second
    assert re.match(rf"aborted because rank 1 failed .*: {summary}$", first.splitlines()[0]), first
