"""CustomRun (csrc/runtime/custom_run.h), register_custom_function's protocol, on the
in-process loopback world: a registered function runs every compute part of its action
exactly once through run_part, in any order; a part run twice, a part not of the action, a
function that skips a part and run_part outside a function fail clearly; a function
registered or removed between steps applies from the next step. The Gloo tests of the same
behaviour: test_schedule_api.py (case_custom_function, case_custom_function_errors)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.asserts import assert_grads_close
from helpers.loopback import rank_schedule, rank_step, run_threads, training_executor

import zbpipe
from zbpipe import _C

M = 2
F0 = "rank 0 failed in stage 0 at action 0F0 (microbatch 0): "


def _one_rank(fn, steps=1):
    """GPipe of one stage on a one-rank world with `fn` registered for F: the schedule and the
    outcome of each step ("ok", or the PipelineError's text)."""
    world = _C._LoopbackWorld(1)
    torch.manual_seed(0)
    sched = rank_schedule(world, 0, nn.Linear(4, 4), M, schedule=zbpipe.ScheduleGPipe)
    sched.register_custom_function(zbpipe.Kind.F, fn)
    out = []
    for _ in range(steps):
        try:
            rank_step(sched, world, 0, torch.randn(2 * M, 4), torch.randn(2 * M, 4))
            out.append("ok")
        except zbpipe.PipelineError as e:
            out.append(str(e))
    return sched, out


def test_a_part_run_twice_fails_at_its_action():
    def twice(action, ctx):
        ctx.run(action)
        ctx.run(action)

    _, (msg,) = _one_rank(twice)
    assert msg.startswith(F0 + "RuntimeError: ") and "'0F0' already ran in this custom function" in msg, msg


def test_a_part_not_of_the_action_is_refused():
    _, (msg,) = _one_rank(lambda action, ctx: ctx.run(zbpipe.Action.parse("0F1")))
    assert msg.startswith(F0) and "'0F1' is not a part of the action '0F0' this custom function runs" in msg, msg


def test_a_function_that_skips_its_part_fails_the_step_and_the_executor():
    _, out = _one_rank(lambda action, ctx: None, steps=2)
    assert out[0].startswith(F0 + "the custom function for '0F0' returned without running its part '0F0' "
                             "(it must call ctx.run(part) once for every part)"), out[0]
    assert out[1].startswith("zbpipe: rank 0: this schedule failed in an earlier step"), out[1]


def test_run_part_outside_a_custom_function_is_refused():
    kept = []

    def keep(action, ctx):
        kept.append((action, ctx))
        ctx.run(action)

    sched, out = _one_rank(keep)
    assert out == ["ok"] and len(kept) == M, (out, kept)
    action, ctx = kept[0]
    for run in (ctx.run, training_executor(sched).run_part):  # after the step, as the executor's own call
        with pytest.raises(RuntimeError, match=r"run_part\('0F0'\) called outside a custom function of a running step"):
            run(action)


def test_a_function_registered_or_removed_between_steps_applies_from_the_next_step():
    world = _C._LoopbackWorld(1)
    torch.manual_seed(0)
    sched = rank_schedule(world, 0, nn.Linear(4, 4), M, schedule=zbpipe.ScheduleGPipe)
    ex = training_executor(sched)
    seen = []

    def fn(action):
        seen.append(str(action))
        ex.run_part(action)

    def step():
        rank_step(sched, world, 0, torch.randn(2 * M, 4), torch.randn(2 * M, 4))
        return len(seen)

    ex.set_custom_actions(fn, [zbpipe.Kind.F])
    counts = [step()]
    ex.set_custom_actions(None, [zbpipe.Kind.F])  # no function: the built-in computation
    counts.append(step())
    ex.set_custom_actions(fn, [])  # no kind: the same
    counts.append(step())
    ex.set_custom_actions(fn, [zbpipe.Kind.F, zbpipe.Kind.B])
    counts.append(step())
    assert counts == [M, M, M, 3 * M] and seen[:2] == ["0F0", "0F1"], (counts, seen)
    with pytest.raises(RuntimeError, match="custom functions replace compute actions only"):
        ex.set_custom_actions(fn, [zbpipe.Kind.SEND_F])


_BATCH = (torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
          torch.randn(8, 4, generator=torch.Generator().manual_seed(2)))


def _dualpipev(world, r, mods, fn):
    """DualPipeV on a two-rank world (stages 0, 3 on rank 0; 1, 2 on rank 1) with `fn` for
    OVERLAP_F_B when given; (its losses, or the PipelineError's text) and the units `fn` saw.
    The batch is drawn before the rank threads start: both share the global generator."""
    x, y = _BATCH
    mine = [0, 3] if r == 0 else [1, 2]
    stages = [zbpipe.PipelineStage(mods[s], s, 4, "cpu", group=world.group(r)) for s in mine]
    sched = zbpipe.ScheduleDualPipeV(stages, 4, loss_fn=F.mse_loss, stream_ordered=True, timeout=30.0)
    units = []
    if fn is not None:
        sched.register_custom_function(zbpipe.Kind.OVERLAP_F_B, lambda a, ctx: (units.append(str(a)), fn(a, ctx)))
    losses = []
    try:
        sched.step(*((x,) if r == 0 else ()), target=y if r == 0 else None, losses=losses)
    except zbpipe.PipelineError as e:
        return str(e), units
    return losses, units


def test_the_parts_of_an_overlapped_unit_run_in_any_order_with_exact_gradients():
    def backward_first(action, ctx):
        f, b = action.sub_actions
        ctx.run(b)
        ctx.run(f)

    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(4)]
    ref = copy.deepcopy(mods)
    world, plain = _C._LoopbackWorld(2), _C._LoopbackWorld(2)
    out = run_threads(world, lambda r: _dualpipev(world, r, mods, backward_first), timeout=60)
    want = run_threads(plain, lambda r: _dualpipev(plain, r, ref, None), timeout=60)
    prog = zbpipe.compile("dualpipev", 2, 4)
    for r in range(2):
        units = out[r][1]
        assert units and units == [a for a in prog.actions(r) if a.endswith("OVERLAP_F_B")], (r, units)
    torch.testing.assert_close(torch.stack(out[0][0]), torch.stack(want[0][0]))
    assert_grads_close(mods, ref)


def test_an_overlapped_unit_whose_function_skips_a_part_names_that_part():
    world = _C._LoopbackWorld(2, stream_waits=True, store=True)
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(4)]
    out = run_threads(world, lambda r: _dualpipev(world, r, mods, lambda a, ctx: ctx.run(a.sub_actions[0])),
                      timeout=60)
    culprits = [r for r in range(2) if not out[r][0].startswith("aborted because ")]
    assert culprits, out
    for r in culprits:  # its first unit ran only its forward part
        msg, units = out[r]
        unit = units[0]
        f, b = unit[1:unit.index(")")].split(";")
        assert msg.splitlines()[0] == (
            f"rank {r} failed in stages {f[0]} and {b[0]} at action {unit}: the custom function for "
            f"'{unit}' returned without running its part '{b}' (it must call ctx.run(part) once for every part)"), msg
