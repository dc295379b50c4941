"""zbpipe's PipelineStage and schedule classes take torch 2.13's arguments exactly as torch
declares them, so a drift on either side fails here: inspect.signature of each class torch
exports against zbpipe's class of the same name (the positional parameters equal in name,
kind, order and default; torch's keyword-only ones present with their defaults; zbpipe's
extras keyword-only), the same for step() and eval(), and the call forms themselves on one
in-process loopback rank (torch's positional order, Schedule1F1B(stage=...), defer_pp_recv,
use_full_backward, output_grads / input_grads)."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.distributed.pipelining as torch_pp
import torch.nn as nn
import torch.nn.functional as F
from helpers.asserts import assert_close
from torch.distributed.pipelining import schedules as torch_schedules

import zbpipe
from zbpipe import _C
from zbpipe import schedules as zb_schedules

# Every schedule class (and base) torch exports that zbpipe mirrors by name. torch's
# _PipelineScheduleRuntime takes (*args, **kwargs) and is compared with its base's signature.
TORCH_CLASSES = ["PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
                 "ScheduleLoopedBFS", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                 "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
              inspect.Parameter.VAR_POSITIONAL)


def _params(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def assert_takes_torchs_arguments(ours, theirs, what: str) -> None:
    """`ours` accepts every call `theirs` accepts, with the same meaning of each position: the
    same positional parameters (name, kind, default) in the same order, torch's keyword-only
    ones with their defaults, **kwargs where torch has it; anything more is keyword-only."""
    mine, torchs = _params(ours), _params(theirs)
    pos = [(p.name, p.kind, p.default) for p in mine if p.kind in POSITIONAL]
    want = [(p.name, p.kind, p.default) for p in torchs if p.kind in POSITIONAL]
    assert pos == want, f"{what}: positional parameters\n  zbpipe {pos}\n  torch  {want}"
    by_name = {p.name: p for p in mine}
    for p in torchs:
        if p.kind is p.KEYWORD_ONLY:
            assert p.name in by_name, f"{what}: torch's keyword {p.name!r} is missing"
            assert by_name[p.name].kind is p.KEYWORD_ONLY, f"{what}: {p.name!r} is {by_name[p.name].kind}"
            assert by_name[p.name].default == p.default, f"{what}: {p.name}={by_name[p.name].default!r}, torch {p.default!r}"
        if p.kind is p.VAR_KEYWORD:
            assert any(q.kind is q.VAR_KEYWORD for q in mine), f"{what}: torch takes **{p.name}, zbpipe does not"


@pytest.mark.parametrize("name", TORCH_CLASSES)
def test_schedule_signatures_are_torchs(name):
    ours, theirs = getattr(zb_schedules, name), getattr(torch_schedules, name)
    assert_takes_torchs_arguments(ours, theirs, name)
    for method in ("step", "eval"):
        assert_takes_torchs_arguments(getattr(ours, method), getattr(theirs, method), f"{name}.{method}")


def test_csv_runtime_class_takes_its_bases_arguments_and_defer_pp_recv():
    ours = zb_schedules._PipelineScheduleRuntime
    assert_takes_torchs_arguments(ours, torch_schedules.PipelineScheduleMulti, "_PipelineScheduleRuntime")
    assert inspect.signature(ours).parameters["defer_pp_recv"].kind is inspect.Parameter.KEYWORD_ONLY


def test_pipeline_stage_signature_is_torchs():
    assert_takes_torchs_arguments(zbpipe.PipelineStage, torch_pp.PipelineStage, "PipelineStage")
    extras = [p for p in _params(zbpipe.PipelineStage) if p.name not in inspect.signature(torch_pp.PipelineStage).parameters]
    assert [p.name for p in extras] == ["deferred_linear"] and extras[0].kind is inspect.Parameter.KEYWORD_ONLY


def test_a_drift_fails_the_comparison():
    """The comparison can fail: a parameter moved, a default changed, a keyword missing."""
    def torchs(stage, n_microbatches, loss_fn=None, scale_grads=True):
        pass

    for drifted in (lambda stage, n_microbatches, scale_grads=True, loss_fn=None: None,
                    lambda stage, n_microbatches, loss_fn=None, scale_grads=False: None,
                    lambda stage, n_microbatches, loss_fn=None, *, scale_grads=True: None,
                    lambda stage, n_microbatches, loss_fn=None, scale_grads=True, extra=0: None):
        with pytest.raises(AssertionError):
            assert_takes_torchs_arguments(drifted, torchs, "drift")


# ---- the call forms on one loopback rank --------------------------------------------------------

W = 6


def _mods(n, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(n)]


def _xy():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, W, generator=g), torch.randn(8, W, generator=g)


def _reference(mods, x, y, scale):
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        h = xm
        for m in mods:
            h = m(h)
        (F.mse_loss(h, ym) * scale).backward()


def test_pipeline_stage_takes_torchs_positional_order():
    world = _C._LoopbackWorld(1)
    group = world.group(0)
    example = torch.randn(2, W)
    # torch's order: (submodule, stage_index, num_stages, device, input_args, output_args,
    # output_grads, input_grads, group, dw_builder, get_mesh)
    stage = zbpipe.PipelineStage(nn.Linear(W, W), 0, 1, "cpu", example, example, example, example, group, None, None)
    assert stage.group is group and stage._input_args is example and stage._output_args is example
    assert stage.output_grads is example and stage.input_grads is example
    with pytest.raises(TypeError, match="got a ProcessGroup as input_args.*pass it as group="):
        zbpipe.PipelineStage(nn.Linear(W, W), 0, 1, "cpu", group)
    with pytest.raises(TypeError, match="positional"):
        zbpipe.PipelineStage(nn.Linear(W, W), 0, 1, "cpu", None, None, None, None, group, None, None, True)


def test_schedules_take_torchs_positional_and_keyword_forms():
    x, y = _xy()
    world = _C._LoopbackWorld(1)
    # Schedule1F1B(stage=..., ...) by keyword, scale_grads as torch's 7th positional argument.
    mods = _mods(1)
    stage = zbpipe.PipelineStage(mods[0], 0, 1, "cpu", group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage=stage, n_microbatches=4, loss_fn=F.mse_loss)
    sched2 = zbpipe.Schedule1F1B(stage, 4, F.mse_loss, None, None, None, False)
    assert sched.scale_grads is True and sched2.scale_grads is False
    # Interleaved / ZB / V classes: (stages, n, loss_fn, args_chunk_spec, kwargs_chunk_spec,
    # output_merge_spec, scale_grads, backward_requires_autograd, defer_pp_recv) positionally.
    mods = _mods(2)
    ref = copy.deepcopy(mods)
    stages = [zbpipe.PipelineStage(m, s, 2, "cpu", group=world.group(0)) for s, m in enumerate(mods)]
    sched = zbpipe.ScheduleInterleavedZeroBubble(stages, 4, F.mse_loss, None, None, None, False, True, True)
    assert sched.scale_grads is False and sched._runner.options.prepost_receives is False
    sched.step(x, target=y)
    _reference(ref, x, y, 1.0)
    assert_close([p.grad for m in mods for p in m.parameters()], [p.grad for m in ref for p in m.parameters()])
    # LoopedBFS has no input chunk specs in torch: output_merge_spec is its 4th argument.
    looped = zbpipe.ScheduleLoopedBFS(stages, 4, F.mse_loss, None, False)
    assert looped.scale_grads is False
    # PipelineScheduleMulti's deprecated use_full_backward: accepted with a warning, as torch.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zbpipe.ScheduleInterleaved1F1B(stages, 4, F.mse_loss, use_full_backward=True)
    assert any("use_full_backward" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="defer_pp_recv=True posts each receive"):
        zbpipe.ScheduleZBVZeroBubble(stages, 4, F.mse_loss, defer_pp_recv=True, prepost_receives=True)
