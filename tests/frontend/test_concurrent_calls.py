"""One call at a time per schedule: a step()/eval() made while a step of the same schedule runs
(from another thread, or from inside one of its stages) raises RuntimeError at once, naming the
running call and its thread, and the running step goes on to exact gradients. pp=2 over Gloo;
the running step is held inside a stage forward by an Event (no timing is asserted)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

PP, M = 2, 4
HOLD_S = 60.0  # bound of every wait of the test's own (a failure, not a timing)


class _Gate(nn.Module):
    """nn.Linear(8, 8) whose first training forward runs `on_hold` (the test's second calls,
    made while the step is held here) and returns only when they are done."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.on_hold = None
        self.held = False

    def forward(self, x):
        if torch.is_grad_enabled() and not self.held:  # not the handshake's no-grad shape run
            self.held = True
            self.on_hold()
        return self.lin(x)


def _schedule(kind, stage):
    import zbpipe

    if kind == "auto":
        return zbpipe.ScheduleAuto([stage], M, loss_fn=F.mse_loss, timing_steps=1, timeout=HOLD_S)
    return zbpipe.Schedule1F1B(stage, M, loss_fn=F.mse_loss, timeout=HOLD_S)


def _calls_while_running(rank, pp, kind):
    """Step 1 runs on thread 'first-step'; while it is held in this rank's first forward, the
    main thread calls step() and eval(), and the stage itself calls eval() (re-entering). Then
    a second step. Returns the messages of the refused calls, whether the held step raised,
    and whether each step's gradients equal one process's."""
    import torch.distributed as dist

    import zbpipe

    group = dist.new_group(list(range(PP)), backend="gloo")
    torch.manual_seed(0)
    gates = [_Gate() for _ in range(PP)]
    refs = [nn.Linear(8, 8) for _ in range(PP)]
    for g, r in zip(gates, refs):
        r.load_state_dict(g.lin.state_dict())
    stage = zbpipe.PipelineStage(gates[rank], rank, PP, "cpu", group=group)
    sched = _schedule(kind, stage)
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(2)]

    def inputs(k):
        x, y = batches[k]
        return ((x,) if rank == 0 else ()), dict(target=y if rank == PP - 1 else None)

    refused, inside, first = {}, [], {}
    held, done = threading.Event(), threading.Event()

    def on_hold():  # on 'first-step', inside the running step
        try:
            sched.eval(*inputs(0)[0], **inputs(0)[1])
            inside.append(None)
        except RuntimeError as e:
            inside.append(str(e))
        held.set()
        if not done.wait(HOLD_S):
            raise TimeoutError("the test's main thread never finished its calls")

    gates[rank].on_hold = on_hold

    def run_first():
        try:
            sched.step(*inputs(0)[0], **inputs(0)[1])
            first["error"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            first["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run_first, name="first-step")
    t.start()
    try:
        assert held.wait(HOLD_S), "step 1 never reached its first forward"
        for name, call in (("step", sched.step), ("eval", sched.eval)):
            try:
                call(*inputs(1)[0], **inputs(1)[1])
                refused[name] = None
            except RuntimeError as e:
                refused[name] = str(e)
    finally:
        done.set()
        t.join(2 * HOLD_S)
    assert not t.is_alive(), "step 1 did not end"

    def exact():  # this rank's stage against the same layer of the one-process model
        mine, ref = gates[rank].lin, refs[rank]
        return all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                   for p, q in zip(mine.parameters(), ref.parameters()))

    F.mse_loss(refs[1](refs[0](batches[0][0])), batches[0][1]).backward()
    exact_first = exact()
    sched.step(*inputs(1)[0], **inputs(1)[1])  # the schedule is usable after the refusals
    F.mse_loss(refs[1](refs[0](batches[1][0])), batches[1][1]).backward()
    return dict(refused=refused, inside=inside[0], first=first["error"], exact_first=exact_first,
                exact_second=exact())


@pytest.mark.parametrize("kind", ["1f1b", "auto"])
def test_a_second_call_while_a_step_runs_is_refused_and_the_step_is_exact(spawn_world, kind):
    owner = "ScheduleAuto" if kind == "auto" else "schedule"
    for rank, r in enumerate(spawn_world(PP).run(_calls_while_running, kind, timeout_s=240)):
        assert r["first"] is None, (rank, r["first"])
        assert r["exact_first"] and r["exact_second"], (rank, r)
        for name, msg in r["refused"].items():
            assert msg is not None, f"rank {rank}: {name}() ran while step() was running"
            assert msg.startswith(f"zbpipe: {name}() called from thread 'MainThread' while step() is "
                                  f"already running on this {owner} (called from thread 'first-step')"), msg
        # From inside the running step's own stage: the same refusal, the same thread named.
        assert r["inside"] is not None and r["inside"].startswith(
            "zbpipe: eval() called from thread 'first-step' while step() is already running on this "
            f"{owner} (called from thread 'first-step')"), r["inside"]
