"""ExecutorRunner (zbpipe/schedule_runner.py), on one rank of the in-process loopback world
(zbpipe._C._LoopbackWorld): one executor per program (the training one, its forwards for eval),
built at first use and dropped with the program; a build failure split into the caller's errors
and PipelineError; the data-parallel check after the first step; custom functions on every
executor with their PipelineContext; the call counts failure messages name; the memory probe;
the last executor's trace and Chrome trace with the memory counters."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zbpipe
from zbpipe import _C
from zbpipe.schedule_runner import ExecutorRunner, PipelineContext
from zbpipe.step_data import StepData

OPTIONS = _C.ExecutorOptions(timeout_s=20.0)


@pytest.fixture
def one_rank():
    """(world, stage, zb_h1 program, runner bound to it) on one loopback rank."""
    torch.manual_seed(0)
    world = _C._LoopbackWorld(1)  # kept alive with the stage's group by the caller
    stage = zbpipe.PipelineStage(nn.Linear(4, 4), 0, 1, "cpu", group=world.group(0))
    prog = zbpipe.compile("zb_h1", 1, 2)
    runner = ExecutorRunner([stage], OPTIONS)
    runner.bind_program(prog)
    return world, stage, prog, runner


def _step(train: bool = True) -> StepData:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    return StepData.build(2, train=train, has_first=True, has_last=True, loss_fn=F.mse_loss, args=(x,), target=y)


def _run(runner, prog, train=True, schedule=None, losses=None):
    """One runner.step: (the executor that ran it, (outputs, losses))."""
    _, outputs, mb_losses = runner.step("step" if train else "eval", train, lambda: _step(train), 0.5, losses,
                                        schedule)
    return runner.executor(train), (outputs, mb_losses)


def test_one_executor_per_program_built_at_first_use_and_dropped_with_the_program(one_rank):
    _, _, prog, runner = one_rank
    train = runner.executor(True)
    assert runner.executor(True) is train and train.program == prog
    forwards = runner.executor(False)  # an eval step's: the program's forwards, in its order
    assert forwards is not train and forwards.program == _C.lower(_C.strip_backward(prog.compute_only()))
    runner.bind_program(prog)  # a new program: the next step builds anew
    assert runner.executor(True) is not train


def test_a_build_failure_is_the_callers_error_or_a_pipeline_error(one_rank, monkeypatch):
    _, stage, _, runner = one_rank

    def bad_argument(split):
        raise ValueError("bad argument")

    monkeypatch.setattr(stage, "bind_data_parallel", bad_argument)  # read while the executor is built
    with pytest.raises(ValueError, match="^bad argument$"):
        runner.executor(True)

    def device_failure(split):
        raise RuntimeError("device gone")

    monkeypatch.setattr(stage, "bind_data_parallel", device_failure)
    with pytest.raises(zbpipe.PipelineError) as info:
        runner.executor(True)
    assert str(info.value) == "rank 0 failed while building its executor: RuntimeError: device gone"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_stage_that_becomes_data_parallel_after_the_first_step_is_refused(one_rank, monkeypatch):
    _, stage, prog, runner = one_rank
    runner.executor(True)
    runner.check_data_parallel(True)  # as it was read: passes
    monkeypatch.setattr(stage, "bind_data_parallel", lambda split: True)  # as DDP / fully_shard would
    with pytest.raises(ValueError) as info:
        runner.check_data_parallel(True)
    assert str(info.value) == (
        "stage 0: its module became data-parallel (Linear) after this schedule's first step; zbpipe "
        "reads a stage's data parallelism when a schedule first runs it: wrap the module (and assign "
        "stage.submod) before that, or build a new schedule")


def test_a_step_counts_itself_scopes_the_stages_and_tells_a_failure_before_the_run(one_rank, monkeypatch):
    _, stage, prog, runner = one_rank
    seen, real = [], stage.step_scope

    @contextlib.contextmanager
    def scope(training):
        seen.append(("enter", training))
        with real(training):
            yield
        seen.append("exit")

    monkeypatch.setattr(stage, "step_scope", scope)
    _run(runner, prog)
    assert seen == [("enter", True), "exit"] and runner.count("step") == 2  # this step was call 1

    def bad_batch():
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="^bad batch$"):  # raised as it is on this rank ...
        runner.step("step", True, bad_batch, 0.5, None, None)
    with pytest.raises(zbpipe.PipelineError, match="failed in an earlier step"):  # ... and told: unusable
        _run(runner, prog)


def test_call_counts_number_each_kind_of_call(one_rank):
    runner = one_rank[3]
    assert [runner.count("step"), runner.count("step"), runner.count("eval")] == [1, 2, 1]
    runner.set_call_counts(step=41)
    assert (runner.count("step"), runner.count("eval")) == (42, 2)
    runner.set_call_counts(eval=0)
    assert runner.count("eval") == 1


def test_a_failure_names_the_owners_call_count():
    world = _C._LoopbackWorld(1)

    def failing_loss(out, target):
        raise ValueError("loss failed")

    stage = zbpipe.PipelineStage(nn.Linear(4, 4), 0, 1, "cpu", group=world.group(0))
    sched = zbpipe.ScheduleGPipe(stage, 2, loss_fn=failing_loss, timeout=20)
    sched.set_call_counts(step=41)
    with pytest.raises(zbpipe.PipelineError, match=r"step 42\b"):
        sched.step(torch.randn(4, 4), target=torch.randn(4, 4))


def test_custom_functions_run_on_executors_built_before_and_after_registering(one_rank):
    _, _, prog, runner = one_rank
    seen = []

    def forward(action, ctx):
        seen.append((str(action), ctx.schedule_ref, ctx.losses, len(ctx.arg_mbs), len(ctx.target_mbs)))
        ctx.run(action)

    built = runner.executor(True)
    runner.set_custom(_C.Kind.F, forward)  # reaches the executor built before
    assert runner.custom_kinds == {_C.Kind.F}
    owner, losses = object(), []
    _run(runner, prog, schedule=owner, losses=losses)
    assert seen == [("0F0", owner, losses, 2, 2), ("0F1", owner, losses, 2, 2)]
    assert runner._ctx is None  # the step's context does not outlive it
    runner.bind_program(prog)
    seen.clear()
    assert runner.executor(True) is not built
    _run(runner, prog, schedule=owner)  # the new executor runs them too
    assert [s[0] for s in seen] == ["0F0", "0F1"]


def test_pipeline_context_carries_torchs_fields():
    step = _step()
    ctx = PipelineContext("sched", None, step, [1])
    assert (ctx.schedule_ref, ctx.arg_mbs, ctx.kwarg_mbs, ctx.target_mbs, ctx.losses, ctx.loss_kwargs) == \
        ("sched", step.args, None, step.targets, [1], {})


def test_memory_is_probed_on_training_steps_while_measuring(one_rank):
    _, _, prog, runner = one_rank
    _run(runner, prog)
    assert runner.memory_profile is None  # measure_memory off
    runner.measure_memory = True
    _run(runner, prog, train=False)
    assert runner.memory_profile is None  # an eval step measures nothing
    _run(runner, prog)
    profile = runner.memory_profile
    assert list(profile) == [0] and profile[0]["mem_f"] > 0 and 0 < profile[0]["mem_w"] <= profile[0]["mem_f"]


def test_the_last_executor_gives_the_trace_and_chrome_trace_with_memory_counters(one_rank, tmp_path):
    _, _, prog, runner = one_rank
    path = str(tmp_path / "trace.json")
    assert runner.last is None and runner.trace() == []
    with pytest.raises(RuntimeError, match="^no step has run yet$"):
        runner.export_chrome_trace(path)
    _run(runner, prog, train=False)
    ex, _ = _run(runner, prog)
    assert runner.last is ex and sorted(r["action"] for r in runner.trace()) == sorted(prog.actions(0))
    runner.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert not any(e.get("ph") == "C" for e in events)  # no memory profile: the executor's trace only
    runner.measure_memory = True
    _run(runner, prog)
    runner.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    counters = [e for e in events if e.get("ph") == "C"]
    assert counters == [{"name": "stage 0 saved bytes", "ph": "C", "pid": 0, "tid": 0, "ts": 0,
                         "args": dict(runner.memory_profile[0])}]
    assert len(events) > len(counters)
