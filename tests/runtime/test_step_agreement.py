"""StepAgreement (csrc/runtime/step_agreement.h) on the in-process loopback world: before each
step the ranks agree on the program (once) and on the step's shapes. A new input signature runs
the handshake, a known one is reused with none, also when a step switches back to an earlier
one (the stages then rebuild their inputs with that one's structure); static_shapes agrees
once. With a store the signature's index goes through the store ring, without one as a
message. The Gloo tests of the same behaviour: test_runtime_shapes.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import rank_schedule, rank_step, run_threads, training_executor

import zbpipe
from zbpipe import _C

PP, M, WIDTH = 2, 4, 4


class Head(nn.Module):
    """Stage 0: one output for 2-row microbatches, two for 3-row ones (the structure follows
    the input, so the next stage must rebuild its arguments with the step's structure)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.lin(x)
        return (h, 2 * h) if x.size(0) == 3 else h


class Tail(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, a, b=None):
        return self.lin(a if b is None else a + b)


def _setup(**world_options):
    """A two-rank loopback world, the stages' modules and a batch of 8 rows (and its target)."""
    world = _C._LoopbackWorld(PP, **world_options)
    torch.manual_seed(0)
    return world, [Head(), Tail()], (torch.randn(8, WIDTH), torch.randn(8, WIDTH))


def _reference_losses(mods, x, y):
    out = []
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        h = mods[0](xm)
        out.append(F.mse_loss(mods[1](*(h if isinstance(h, tuple) else (h,))), ym))
    return out


def _boundary(ex, rank):
    """The agreed shapes of the boundary between stages 0 and 1, as this rank holds them."""
    specs = ex.signatures(rank)[1 if rank == 0 else 0][0]
    return [tuple(shape) for shape, _ in specs]


@pytest.mark.parametrize("store", [True, False])
def test_a_new_signature_handshakes_and_a_known_one_is_reused(store):
    world, mods, _ = _setup(store=store)
    ref = copy.deepcopy(mods)
    rows = [8, 8, 12, 8, 12]  # microbatches of 2, 2, 3, then back to 2 and 3 rows
    batches = [(torch.randn(n, WIDTH), torch.randn(n, WIDTH)) for n in rows]

    def rank_main(r):
        sched = rank_schedule(world, r, mods[r], M)
        seen = []
        for x, y in batches:
            losses = []
            rank_step(sched, world, r, x, y, losses=losses)
            ex = training_executor(sched)
            seen.append((ex.handshakes, _boundary(ex, r), losses))
        return seen

    out = run_threads(world, rank_main, timeout=60)
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    two, three = [(2, WIDTH)], [(3, WIDTH), (3, WIDTH)]
    for r in range(PP):
        assert [h for h, _, _ in out[r]] == [1, 1, 2, 2, 2], (r, out[r])
        assert [b for _, b, _ in out[r]] == [two, two, three, two, three], (r, out[r])
    for (x, y), (_, _, losses) in zip(batches, out[PP - 1]):
        torch.testing.assert_close(torch.stack(losses), torch.stack(_reference_losses(ref, x, y)))


def test_static_shapes_agree_once_without_a_signature_message():
    # No store: a step's input signature would travel as a one-element int64 message (8 bytes).
    world, mods, (x, y) = _setup()

    def rank_main(r, static):
        sched = rank_schedule(world, r, mods[r], M, static_shapes=static)
        for _ in range(2):
            rank_step(sched, world, r, x, y)
        one_element = [op for kind, _, _, ops in world.events(r) if kind == "post" for op in ops if op[3] == 8]
        return training_executor(sched).handshakes, len(one_element)

    static = run_threads(world, lambda r: rank_main(r, True), timeout=60)
    world.clear_events()
    negotiated = run_threads(world, lambda r: rank_main(r, False), timeout=60)
    assert static == {0: (1, 0), 1: (1, 0)}, static
    # Stage 0's rank sends the index to rank 1 at each step.
    assert negotiated == {0: (1, 2), 1: (1, 2)}, negotiated


def test_static_shapes_refuse_a_changed_shape_at_the_first_stage():
    # Stream-like waits (as on NCCL): rank 1's blocked receive does not hide rank 0's failure,
    # which reaches it through the store.
    world, mods, _ = _setup(stream_waits=True, store=True)

    def rank_main(r):
        sched = rank_schedule(world, r, mods[r], M, static_shapes=True)
        for n in (8, 8, 12):  # stage 0's input changes; the target keeps its shape
            try:
                rank_step(sched, world, r, torch.randn(n, WIDTH), torch.randn(8, WIDTH))
            except zbpipe.PipelineError as e:
                return str(e), training_executor(sched).handshakes
        return "no error", training_executor(sched).handshakes

    out = run_threads(world, rank_main, timeout=60)
    msg, handshakes = out[0]
    assert handshakes == 1 and "static_shapes=True" in msg and ">>0F0<<" in msg, out[0]
    msg, handshakes = out[1]
    assert handshakes == 1, out[1]
    assert msg.startswith("aborted because rank 0 failed in stage 0 at action 0F0 (microbatch 0): "), msg


def test_signatures_before_a_step_and_of_another_rank_raise():
    world, mods, (x, y) = _setup(store=True)

    def rank_main(r):
        sched = rank_schedule(world, r, mods[r], M)
        ex, errors = training_executor(sched), []
        for stage in (r, "step", 1 - r):
            if stage == "step":
                rank_step(sched, world, r, x, y)
                continue
            try:
                ex.signatures(stage)
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        return errors, _boundary(ex, r)

    out = run_threads(world, rank_main, timeout=60)
    for r in range(PP):
        errors, boundary = out[r]
        assert errors == [f"no signatures for stage {r} on rank {r} (not local, or no step has run yet)",
                          f"no signatures for stage {1 - r} on rank {r} (not local, or no step has run yet)"], out
        assert boundary == [(2, WIDTH)], out


def test_ranks_with_different_programs_fail_before_the_first_step():
    world, mods, (x, y) = _setup(store=True)

    def rank_main(r):
        sched = rank_schedule(world, r, mods[r], M if r == 0 else 2 * M)
        try:
            rank_step(sched, world, r, x, y)
        except zbpipe.PipelineError as e:
            return str(e)
        return "no error"

    out = run_threads(world, rank_main, timeout=60)
    for r in range(PP):
        assert "the ranks run different programs: rank " in out[r], out[r]
        assert "microbatches=4" in out[r] and "microbatches=8" in out[r], out[r]
