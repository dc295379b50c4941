"""Bad input fails fast and hangs nothing: a batch that does not split into the microbatches, a
stage whose output shape differs from what the next stage expects (declared, and changing at
run time), an exception inside a stage, and a peer that dies mid-step. Every surviving rank
gets a clear error (naming the rank and the failing action, with the program grid) in bounded
time, and no process is left behind. pp=3 (a middle rank sees neither the input nor the
target), every scenario on a fresh group in the module's one spawned world (the dead peer's
test ends that world; the launcher starts a new one after it)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.model_registry import FaultyLinear
from zbpipe.train.launcher import RankFailure

PP = 3
WAIT_S = 2.0  # the executor's wait timeout in these tests


def _attempt(rank, make_stage, batch=8, n=4, timeout=WAIT_S, loss_fn=F.mse_loss):
    """One step on a fresh group; returns (exception type, message, seconds) or ok."""
    import torch.distributed as dist

    import zbpipe

    group = dist.new_group(list(range(PP)), backend="gloo")
    torch.manual_seed(0)
    stage = make_stage(group)
    sched = zbpipe.Schedule1F1B(stage, n, loss_fn=loss_fn, timeout=timeout)
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    t0 = time.monotonic()
    try:
        if rank == 0:
            sched.step(x)
        elif rank == PP - 1:
            sched.step(target=y)
        else:
            sched.step()
    except Exception as e:  # noqa: BLE001 - the result is the point
        return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("ok", "", time.monotonic() - t0)


def _plain(rank, **kw):
    """A stage factory: FaultyLinear(**kw) on rank 1, a plain one elsewhere."""
    import zbpipe

    return lambda group: zbpipe.PipelineStage(FaultyLinear(**(kw if rank == 1 else {})), rank, PP, "cpu", group=group)


def _placement(rank):
    """Stages placed as a loop where the schedule wants a V: refused before any message."""
    import zbpipe

    mods = [FaultyLinear() for _ in range(2 * PP)]
    wrong = [zbpipe.PipelineStage(mods[s], s, 2 * PP, "cpu") for s in (rank, rank + PP)]
    try:
        zbpipe.ScheduleZBVZeroBubble(wrong, 4, loss_fn=F.mse_loss, timeout=WAIT_S).step(
            *((torch.randn(8, 8),) if rank == 0 else ()), target=torch.randn(8, 8))
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), 0.0)
    return ("ok", "", 0.0)


class _OffDevice(nn.Module):
    """nn.Linear(8, 8) whose training forwards return their output on the meta device (the
    shape pass, under no_grad, sees the right one)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y.to("meta") if torch.is_grad_enabled() else y


def _elementwise_loss(out, target):
    return (out - target) ** 2  # not reduced: shape (microbatch, 8)


def _loss_shape(rank):
    """A loss of shape (2, 8): every rank fails before any backward (no parameter has a .grad)."""
    import zbpipe

    stages = []

    def make(group):
        stages.append(zbpipe.PipelineStage(FaultyLinear(), rank, PP, "cpu", group=group))
        return stages[0]

    res = _attempt(rank, make, loss_fn=_elementwise_loss)
    return res + (all(p.grad is None for p in stages[0].submod.parameters()),)


def _scenario(rank, pp, scenario):
    """A warm-up step (first use, imports and lazy init, may be slow), then the scenario."""
    import zbpipe

    warm = _attempt(rank, _plain(rank), timeout=60)
    assert warm[0] == "ok", warm
    if scenario == "indivisible":
        return _attempt(rank, _plain(rank), batch=10)
    if scenario == "declared_shape":
        return _attempt(rank, lambda g: zbpipe.PipelineStage(
            FaultyLinear(), rank, PP, "cpu", group=g, input_args=torch.empty(2, 5) if rank == 1 else None))
    if scenario == "runtime_shape":
        return _attempt(rank, _plain(rank, shrink_at=3))
    if scenario == "stage_exception":
        return _attempt(rank, _plain(rank, fail_at=2))
    if scenario == "broken_module":  # fails in the shape pass: fake-tensor run, then the real one
        return _attempt(rank, _plain(rank, broken=True))
    if scenario == "placement":
        return _placement(rank)
    if scenario == "meta":  # rank 1's stage lives on the meta device: no backend serves it
        return _attempt(rank, lambda g: zbpipe.PipelineStage(
            FaultyLinear().to("meta") if rank == 1 else FaultyLinear(), rank, PP, "meta" if rank == 1 else "cpu",
            group=g))
    if scenario == "loss_shape":
        return _loss_shape(rank)
    if scenario == "off_device":  # rank 1's stage outputs land on the meta device
        return _attempt(rank, lambda g: zbpipe.PipelineStage(
            _OffDevice() if rank == 1 else FaultyLinear(), rank, PP, "cpu", group=g))
    if scenario == "plain":
        return _attempt(rank, _plain(rank))
    assert scenario == "dies"  # rank 1 dies in its second forward: after the handshake, mid-step
    return _attempt(rank, _plain(rank, die_at=2))


def _check_failure(res, rank, *needles):
    kind, msg, seconds = res
    assert kind in ("PipelineError", "ValueError"), (rank, kind, msg)
    for n in needles:
        assert n in msg, f"rank {rank}: {n!r} not in:\n{msg}"
    for internal in ("(index ", "(start of step)", "(end of step)", "index -"):  # no sentinel leaks
        assert internal not in msg, f"rank {rank}: {internal!r} in:\n{msg}"
    assert seconds < 10 * WAIT_S + 10, f"rank {rank} took {seconds:.1f}s"  # bounded, not a hang


def _recovery(rank, pp):
    """The recipe of docs/runtime.md#failures: step 1 trains, step 2 fails on rank 1 (its
    forward of microbatch 1), the old schedule refuses another step; then zero the gradients,
    build a new group and schedule over the same stage modules, run step 2 again and step 3.
    Step 3's gradients must equal one process training the whole model on the same batches
    (an AssertionError names the parameter). Returns (the failed step's error, the refusal)."""
    import copy

    import torch.distributed as dist
    from helpers.asserts import assert_grads_close

    import zbpipe

    torch.manual_seed(0)
    mods = [FaultyLinear() for _ in range(PP)]
    ref = copy.deepcopy(mods)
    mods[1].fail_at = 6 if rank == 1 else None  # step 2 (4 microbatches per step), microbatch 1
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    for k, (x, y) in enumerate(batches):  # the reference: the whole model in one process
        ref_opt.zero_grad()
        F.mse_loss(ref[2](ref[1](ref[0](x))), y).backward()
        if k < 2:
            ref_opt.step()
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.1)

    def schedule():
        group = dist.new_group(list(range(PP)), backend="gloo")
        stage = zbpipe.PipelineStage(mods[rank], rank, PP, "cpu", group=group)
        return zbpipe.Schedule1F1B(stage, 4, loss_fn=F.mse_loss, timeout=60)

    def step(sched, k):
        x, y = batches[k]
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == PP - 1 else None)

    sched = schedule()
    step(sched, 0)
    opt.step()
    opt.zero_grad()
    errors = []
    for _ in range(2):  # the failing step, then the refusal
        try:
            step(sched, 1)
        except zbpipe.PipelineError as e:
            errors.append(str(e))
    # The recipe: drop what the failed step accumulated, new group, new schedule, same modules.
    mods[rank].fail_at = None  # the fault was transient
    opt.zero_grad()
    sched = schedule()
    step(sched, 1)
    opt.step()
    opt.zero_grad()
    step(sched, 2)
    assert_grads_close([mods[rank]], [ref[rank]], msg=f"rank {rank} after recovery")
    return errors


def _run(spawn_world, scenario):
    return spawn_world(PP).run(_scenario, scenario, timeout_s=180)


def test_indivisible_batch_is_told_to_every_rank(spawn_world):
    for rank, r in enumerate(_run(spawn_world, "indivisible")):
        # The ranks holding the batch / target say so at once; the middle rank learns it from
        # them (through the store) instead of waiting for its timeout.
        if rank in (0, PP - 1):
            assert r[0] == "ValueError"
            _check_failure(r, rank, "not divisible by n_microbatches=4")
        else:
            _check_failure(r, rank, "not divisible by n_microbatches=4")
            first = r[1].splitlines()[0]
            assert first.startswith(("aborted because rank 0 failed before step 1: ValueError: ",
                                     "aborted because rank 2 failed before step 1: ValueError: ")), first
            assert "timeout" not in r[1] and " within " not in r[1]  # told, not timed out


def test_declared_shape_mismatch_is_told_by_the_handshake(spawn_world):
    for rank, r in enumerate(_run(spawn_world, "declared_shape")):
        _check_failure(r, rank, "stage 1", "input_args", "float32[2, 5]", "float32[2, 8]")
        assert r[0] == "PipelineError"
        # Every rank names the stage that rejected its inputs, not itself.
        culprit = "rank 1 failed in stage 1 at the start of step 1 (inferring its output shapes): ValueError: "
        assert r[1].startswith(culprit if rank == 1 else "aborted because " + culprit), r[1]


def test_output_shape_changing_mid_step_is_named_by_its_sender(spawn_world):
    for rank, r in enumerate(_run(spawn_world, "runtime_shape")):
        culprit = "rank 1 failed in stage 1 at action 1F2 (microbatch 2): stage 1 microbatch 2 produced"
        if rank == 1:
            _check_failure(r, rank, "(float32[2, 4]) but the pipeline agreed on (float32[2, 8])", ">>1F2<<")
            assert r[1].startswith(culprit), r[1]
        else:
            _check_failure(r, rank)
            assert r[1].startswith("aborted because " + culprit), r[1]


def test_stage_exception_names_the_culprit_first_on_every_rank(spawn_world):
    culprit = "rank 1 failed in stage 1 at action 1F1 (microbatch 1): ValueError: boom from inside the stage"
    for rank, r in enumerate(_run(spawn_world, "stage_exception")):
        first = r[1].splitlines()[0]
        if rank == 1:  # the user's traceback, once, on the failing rank only
            _check_failure(r, rank, "Traceback", ">>1F1<<")
            assert first == culprit, r[1]
            assert r[1].count("Traceback (most recent call last)") == 1, r[1]
        else:
            _check_failure(r, rank, f"on rank {rank}, in stage {rank} at action")
            assert first == "aborted because " + culprit, r[1]
            assert "Traceback" not in r[1], r[1]


def test_a_user_error_in_the_shape_pass_is_reported_once(spawn_world):
    """The module raises in the fake-tensor shape pass and again in the real one that follows:
    one error, one traceback, no chained duplicate, on the failing rank; none on its peers."""
    culprit = ("rank 1 failed in stage 1 at the start of step 1 (inferring its output shapes): "
               "RuntimeError: this module is broken")
    for rank, r in enumerate(_run(spawn_world, "broken_module")):
        _check_failure(r, rank)
        first = r[1].splitlines()[0]
        assert "During handling" not in r[1] and "direct cause" not in r[1], r[1]
        if rank == 1:
            assert first == culprit, r[1]
            assert r[1].count("Traceback (most recent call last)") == 1, r[1]
            assert r[1].count("RuntimeError: this module is broken") == 1, r[1]
        else:
            assert first == "aborted because " + culprit, r[1]
            assert "Traceback" not in r[1] and r[1].count("this module is broken") == 1, r[1]


def test_a_new_group_and_schedule_work_after_failures(spawn_world):
    _run(spawn_world, "stage_exception")
    assert [r[0] for r in _run(spawn_world, "plain")] == ["ok"] * PP


def test_wrong_stage_placement_is_refused_before_any_message(spawn_world):
    for rank, r in enumerate(_run(spawn_world, "placement")):
        if rank != 1:  # rank 1 holds stages 1 and 4 in both layouts: it is told
            assert r[0] == "ScheduleError", r
            _check_failure((("ValueError",) + r[1:]), rank,
                           f"places stages [{rank}, {2 * PP - 1 - rank}] on rank {rank}",
                           f"given stages [{rank}, {rank + PP}]")
        else:
            _check_failure(r, rank, "places stages [", "but this rank was given stages [")
            first = r[1].splitlines()[0]
            assert first.startswith(("aborted because rank 0 failed while building its executor: ScheduleError: ",
                                     "aborted because rank 2 failed while building its executor: ScheduleError: ")), r[1]


def test_a_setup_failure_on_any_device_is_told_to_the_peers(spawn_world):
    """Publishing touches only the group's store, so a device no backend serves (meta) does
    not keep the peers waiting for their timeout."""
    for rank, r in enumerate(_run(spawn_world, "meta")):
        _check_failure(r if rank != 1 else ("PipelineError",) + r[1:], rank)
        first = r[1].splitlines()[0]
        if rank == 1:  # the device's own error, as a PipelineError like every rank's (issue #35)
            assert r[0] == "PipelineError", r
            assert first.startswith("rank 1 failed while building its executor: RuntimeError: No backend type "
                                    "associated with device type meta"), r[1]
        else:
            assert first.startswith("aborted because rank 1 failed while building its executor: "), r[1]
            assert "meta" in first and "timeout" not in r[1] and " within " not in r[1], r[1]


def test_a_loss_that_is_not_a_scalar_fails_every_rank_before_any_backward(spawn_world):
    """As loss.backward() in one process: no silent backward of loss.sum() (issue #35)."""
    for rank, r in enumerate(_run(spawn_world, "loss_shape")):
        _check_failure(r[:3], rank, "loss_fn returned a loss of shape (2, 8) for microbatch 0 of stage 2",
                       "grad can be implicitly created only for scalar outputs")
        assert r[0] == "PipelineError", r
        first = r[1].splitlines()[0]
        culprit = "rank 2 failed in stage 2 at action 2F0 (microbatch 0): RuntimeError: zbpipe: loss_fn returned"
        assert first.startswith(culprit if rank == 2 else "aborted because " + culprit), first
        assert r[3], f"rank {rank}: a backward ran (a parameter has a .grad)"


def test_a_stage_output_on_another_device_names_both_devices(spawn_world):
    for rank, r in enumerate(_run(spawn_world, "off_device")):
        _check_failure(r, rank, "stage 1 microbatch 0 produced outputs on device meta (tensor 0 of 1) but the "
                       "pipeline runs on cpu")
        first = r[1].splitlines()[0]
        assert first.startswith("rank 1 failed in stage 1 at action 1F0" if rank == 1 else
                                "aborted because rank 1 failed in stage 1 at action 1F0"), first


def test_dead_peer_fails_survivors_in_bounded_time(spawn_world):
    with pytest.raises(RankFailure, match="rank 1 failed first: exited with code 3") as info:
        spawn_world(PP).run(_scenario, "dies", timeout_s=120, settle_s=60)
    assert sorted(info.value.results) == [0, 2]  # the survivors returned, each with its error
    for rank, r in info.value.results.items():
        _check_failure(r, rank, "from rank 1")
        assert r[1].startswith((f"rank {rank} failed in stage {rank} at action", "aborted because rank ")), r[1]


def test_training_continues_exactly_on_a_new_group_and_schedule(spawn_world):
    for rank, errors in enumerate(spawn_world(PP).run(_recovery, timeout_s=180)):
        assert len(errors) == 2, errors
        culprit = "rank 1 failed in stage 1 at action 1F1 (microbatch 1): ValueError: boom from inside the stage"
        assert errors[0].startswith(culprit if rank == 1 else "aborted because " + culprit), errors[0]
        assert "Create a new process group and schedule" in errors[1], errors[1]
