"""StepFailures (csrc/runtime/step_failure.h) on the in-process loopback world with a store and
stream-like waits (a peer's failure reaches a rank through the store, as on NCCL): the failing
rank's report and its peers' name the culprit in their first line, the step is numbered as the
caller counts its steps (set_step_number), a failed executor refuses the next step, and a
failure before a step (report_failure) or while building an executor (report_setup_failure)
reaches the peers. The Gloo tests of the same behaviour: test_runtime_errors.py,
test_runtime_propagation.py."""

from __future__ import annotations

import torch
from helpers.loopback import rank_schedule, rank_step, run_threads
from helpers.model_registry import Stops

import zbpipe
from zbpipe import _C

PP, M = 2, 4
REFUSED = ("zbpipe: rank {r}: this schedule failed in an earlier step; its process group may hold "
           "unmatched messages. Create a new process group and schedule.")


def _world():
    return _C._LoopbackWorld(PP, stream_waits=True, store=True)


def _steps(world, r, module, batches, calls=0):
    """One schedule's steps on `batches` (rows), its step() calls counted from `calls`: the
    outcome of each, "ok" or (exception type, message)."""
    torch.manual_seed(r)
    sched = rank_schedule(world, r, module, M)
    sched.set_call_counts(step=calls)
    out = []
    for rows in batches:
        try:
            rank_step(sched, world, r, torch.randn(rows, 4), torch.randn(8, 4))
            out.append("ok")
        except Exception as e:  # noqa: BLE001 - the outcome is the point
            out.append((type(e).__name__, str(e)))
    return out


def test_the_failing_rank_and_its_peers_name_it_first_with_the_callers_step_number():
    world = _world()
    # Rank 1's second training forward raises, in the caller's step 7 (the executor's first).
    out = run_threads(world, lambda r: _steps(world, r, Stops(2 if r == 1 else None), [8, 8], calls=6),
                      timeout=60)
    culprit = "rank 1 failed in stage 1 at action 1F1 (microbatch 1): RuntimeError: this rank stops here"
    context = "  schedule '1f1b' (pp=2, stages=2, microbatches=4), step 7"
    kind, msg = out[1][0]
    lines = msg.splitlines()
    assert kind == "PipelineError" and lines[:2] == [culprit, context], msg
    assert "Traceback" in msg and ">>1F1<<" in msg and "program (failing action marked >> <<):" in msg, msg
    kind, msg = out[0][0]
    lines = msg.splitlines()
    assert kind == "PipelineError" and lines[0] == "aborted because " + culprit, msg
    assert lines[1].startswith("  on rank 0, ") and lines[2] == context, msg
    assert "Traceback" not in msg and "program (this rank's action marked >> <<):" in msg, msg
    # The executor is unusable afterwards: the next step is refused at once, on every rank.
    assert [out[r][1] for r in range(PP)] == [("PipelineError", REFUSED.format(r=r)) for r in range(PP)], out


def test_a_failure_before_a_step_reaches_the_peers():
    world = _world()
    # Rank 0's batch of 7 rows does not split into 4 microbatches: the schedule's own check
    # fails before the executor runs (report_failure), in the caller's step 3.
    out = run_threads(world, lambda r: _steps(world, r, Stops(), [7 if r == 0 else 8, 8], calls=2), timeout=60)
    kind, msg = out[0][0]
    assert kind == "ValueError" and "not divisible by n_microbatches=4" in msg, out[0]
    kind, msg = out[1][0]
    first = msg.splitlines()[0]
    assert kind == "PipelineError", out[1]
    assert first.startswith("aborted because rank 0 failed before step 3: ValueError: "), msg
    assert [out[r][1] for r in range(PP)] == [("PipelineError", REFUSED.format(r=r)) for r in range(PP)], out


def test_a_rank_whose_executor_could_not_be_built_is_named_by_its_peers():
    world = _world()

    def rank_main(r):
        if r == 0:  # the peers' executor of the same number learns it through the store
            _C.Executor.report_setup_failure(world.group(0), [], 0, "ValueError: no executor here")
            return ["not built"]
        return _steps(world, r, Stops(), [8])

    out = run_threads(world, rank_main, timeout=60)
    kind, msg = out[1][0]
    first = msg.splitlines()[0]
    assert kind == "PipelineError", out[1]
    assert first == "aborted because rank 0 failed while building its executor: ValueError: no executor here", msg


def test_a_rejected_input_is_named_by_the_handshake_on_every_rank():
    world = _world()
    # Stage 1 declares inputs of 5 features; stage 0 sends 4.
    out = run_threads(world, lambda r: _one_declared(world, r), timeout=60)
    culprit = "rank 1 failed in stage 1 at the start of step 1 (inferring its output shapes): "
    for r in range(PP):
        kind, msg = out[r]
        assert kind == "PipelineError" and msg.startswith(culprit if r == 1 else "aborted because " + culprit), msg


def _one_declared(world, r):
    declared = {"input_args": torch.randn(2, 5)} if r == 1 else {}
    sched = rank_schedule(world, r, Stops(), M, stage_kwargs=declared)
    try:
        rank_step(sched, world, r, torch.randn(8, 4), torch.randn(8, 4))
    except zbpipe.PipelineError as e:
        return "PipelineError", str(e)
    return "ok", ""
