"""OVERLAP_F_B overlaps: the backward half of each DualPipeV unit runs on the executor's worker
thread while the forward half runs, both proven by a rendezvous that only concurrent halves can
pass; the forward's SEND goes out while the backward half still runs; gradients stay exact; the
trace shows the two intervals overlapping. overlap_f_b=False runs the halves in sequence (the
same rendezvous then times out, which shows the checks can fail). In-process loopback worlds."""

from __future__ import annotations

import copy
import re
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from helpers.asserts import assert_grads_close
from helpers.loopback import run_threads

import zbpipe
from zbpipe import _C

UNIT = re.compile(r"^\((\d+)F(\d+);(\d+)[BI](\d+)\)OVERLAP_F_B$")
MEET_S = 3.0


def _units(prog, rank):
    """[(f_stage, f_mb, b_stage, b_mb)] of the rank's OVERLAP_F_B units."""
    return [tuple(map(int, m.groups())) for a in prog.actions(rank) if (m := UNIT.match(a))]


class _Hook(torch.autograd.Function):
    """Identity whose backward calls `fn` first (at the start of the stage's backward)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.fn()
        return g, None


class Probe(nn.Module):
    """A stage that calls on_forward(mb) before its training forwards and on_backward(mb) at
    the start of their backward."""

    def __init__(self, seed, on_forward=None, on_backward=None):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(8, 8)
        self.on_forward, self.on_backward, self.calls = on_forward, on_backward, 0

    def forward(self, x):
        if not torch.is_grad_enabled():  # the handshake's shape run
            return self.lin(x)
        mb, self.calls = self.calls, self.calls + 1
        if self.on_forward:
            self.on_forward(mb)
        y = self.lin(torch.tanh(x))
        return _Hook.apply(y, lambda: self.on_backward(mb)) if self.on_backward else y


def _one_rank_step(overlap):
    """DualPipeV on one rank (two stages), each unit's halves meeting at a barrier."""
    m = 4
    prog = zbpipe.compile("dualpipev", 1, m)
    units = _units(prog, 0)
    assert units, prog.actions(0)
    barrier = threading.Barrier(2, timeout=MEET_S)
    met = []

    def meet(kind, stage, mb):
        if any((u[0], u[1]) == (stage, mb) if kind == "F" else (u[2], u[3]) == (stage, mb) for u in units):
            barrier.wait()  # both halves of the unit must be here at once
            met.append((kind, stage, mb))

    mods = [Probe(s, lambda mb, s=s: meet("F", s, mb), lambda mb, s=s: meet("B", s, mb)) for s in range(2)]
    ref = [Probe(s) for s in range(2)]
    world = _C._LoopbackWorld(1)
    stages = [zbpipe.PipelineStage(mod, s, 2, "cpu", group=world.group(0)) for s, mod in enumerate(mods)]
    sched = zbpipe.ScheduleDualPipeV(stages, m, loss_fn=F.mse_loss, overlap_f_b=overlap, timeout=30)
    x, y = torch.randn(2 * m, 8), torch.randn(2 * m, 8)
    sched.step(x, target=y)
    F.mse_loss(ref[1](ref[0](x)), y).backward()
    return prog, units, met, mods, ref, sched.trace()


def test_every_trace_record_has_its_own_entry_and_plain_actions_no_unit():
    *_, trace = _one_rank_step(overlap=True)
    assert [r["entry"] for r in trace] == list(range(len(trace)))
    plain = [r for r in trace if "OVERLAP" not in r["unit"]]
    assert plain and all(r["unit"] == "" for r in plain)


def test_halves_run_at_the_same_time_and_gradients_stay_exact():
    torch.set_num_threads(1)
    prog, units, met, mods, ref, trace = _one_rank_step(overlap=True)
    assert len(met) == 2 * len(units), met
    assert_grads_close(mods, ref)
    # The trace: per unit, the backward half's interval and the forward half's overlap.
    for f_stage, f_mb, b_stage, b_mb in units:
        f = next(r for r in trace if r["action"] == f"{f_stage}F{f_mb}")
        b = next(r for r in trace if r["action"] in (f"{b_stage}B{b_mb}", f"{b_stage}I{b_mb}"))
        assert f["index"] == b["index"]  # both name the unit's position in the program
        assert f["entry"] != b["entry"]  # ... but each record has its own entry
        unit = f"({f_stage}F{f_mb};{b['action']})OVERLAP_F_B"
        alt = f"({b['action']};{f_stage}F{f_mb})OVERLAP_F_B"
        assert f["unit"] == b["unit"] and f["unit"] in (unit, alt), (f, b)
        assert b["worker"] and not f["worker"]
        assert b["host_start_ns"] < f["host_end_ns"] and f["host_start_ns"] < b["host_end_ns"], (f, b)


def test_in_sequence_the_halves_never_meet():
    with pytest.raises(zbpipe.PipelineError, match="BrokenBarrierError"):
        _one_rank_step(overlap=False)


def test_forward_send_goes_out_while_the_backward_half_runs():
    """pp=2: each unit's backward half waits (at its start) until this rank has posted the
    SEND_F of the unit's forward half -- which only an overlapped unit can do."""
    pp, m = 2, 4
    prog = zbpipe.compile("dualpipev", pp, m)
    world = _C._LoopbackWorld(pp)
    seen: dict[int, list] = {r: [] for r in range(pp)}

    def sent(rank, stage, mb):
        # The wire tag of stage -> stage + 1's forward message of mb (see executor.h data_tag).
        tag = ((stage * 2) * m + mb) * 64
        return any(e[0] == "post" and any(o[0] == "send" and o[2] // 2 == tag for o in e[3])
                   for e in world.events(rank))

    def rank_main(r, overlap):
        units = {(b_stage, b_mb): (f_stage, f_mb) for f_stage, f_mb, b_stage, b_mb in _units(prog, r)
                 if f_stage + 1 < 2 * pp and prog.stage_to_rank[f_stage + 1] != r}  # F output crosses

        def on_backward(stage, mb):
            if (stage, mb) in units and (not seen[r] or seen[r][-1]):
                deadline = time.monotonic() + MEET_S
                while not sent(r, *units[(stage, mb)]) and time.monotonic() < deadline:
                    time.sleep(0.001)
                seen[r].append(sent(r, *units[(stage, mb)]))

        mods = {s: Probe(s, on_backward=lambda mb, s=s: on_backward(s, mb)) for s in prog.stages_of(r)}
        stages = [zbpipe.PipelineStage(mods[s], s, 2 * pp, "cpu", group=world.group(r)) for s in sorted(mods)]
        sched = zbpipe.ScheduleDualPipeV(stages, m, loss_fn=F.mse_loss, overlap_f_b=overlap, timeout=30)
        x, y = torch.randn(2 * m, 8), torch.randn(2 * m, 8)
        sched.step(*((x,) if r == 0 else ()), target=y if r == 0 else None)

    out = run_threads(world, lambda r: rank_main(r, True), timeout=60)
    assert all(v is None for v in out.values()), out
    assert all(seen[r] and all(seen[r]) for r in range(pp)), seen
    # In sequence, the send follows the whole unit: the first backward half waits in vain.
    world = _C._LoopbackWorld(pp)
    seen = {r: [] for r in range(pp)}
    out = run_threads(world, lambda r: rank_main(r, False), timeout=60)
    assert all(v is None for v in out.values()), out
    assert all(seen[r] == [False] for r in range(pp)), seen


def test_lowering_puts_the_forward_send_first_and_batches_split_it_off():
    for pp in (2, 4):
        prog = zbpipe.compile("dualpipev", pp, 2 * pp)
        for r in range(pp):
            acts = prog.actions(r)
            split = {b: e for b, e, early in _C.comm_batches(prog, r, split_overlap=True) if early}
            whole = [(b, e) for b, e, _ in _C.comm_batches(prog, r, split_overlap=False)]
            expected = set()
            for i, a in enumerate(acts):
                if (u := UNIT.match(a)) and int(u.group(1)) + 1 < 2 * pp and prog.stage_to_rank[int(u.group(1)) + 1] != r:
                    assert acts[i + 1] == f"{u.group(1)}SEND_F{u.group(2)}", (r, acts[i:i + 3])
                    expected.add(i + 1)
            assert expected and set(split) == expected and all(split[b] == b + 1 for b in split), (r, split)
            # Without the split, every batch is a maximal run of adjacent SEND/RECV actions.
            comm = [i for i, a in enumerate(acts) if "SEND" in a or "RECV" in a]
            assert [i for b, e in whole for i in range(b, e)] == comm
            assert all(e == len(acts) or not ("SEND" in acts[e] or "RECV" in acts[e]) for _, e in whole)


# ---- the worker's RNG: Dropout under checkpoint equals one process (two Gloo ranks) -------------

RNG_WIDTH, RNG_ROWS, RNG_M = 256, 32, 16


class DropoutBlock(nn.Module):
    """A checkpoint around Linear + Dropout (twice), after a Linear (a reentrant region needs an
    input that requires grad): its recomputation must draw the masks its forward drew. Records
    each mask, forward and recomputation apart."""

    def __init__(self, reentrant=False):
        super().__init__()
        self.pre = nn.Linear(RNG_WIDTH, RNG_WIDTH)
        self.a, self.b, self.drop = nn.Linear(RNG_WIDTH, RNG_WIDTH), nn.Linear(RNG_WIDTH, RNG_WIDTH), nn.Dropout(0.5)
        self.forwards, self.recomputed, self._in_forward, self.reentrant = [], [], False, reentrant

    def _region(self, x):
        h = self.drop(torch.relu(self.a(x)))
        if h.device.type != "meta":
            (self.forwards if self._in_forward else self.recomputed).append(h != 0)
        return torch.sin(self.drop(self.b(h)))  # saves a tensor after the mask: its recording is recomputed

    def forward(self, x):
        self._in_forward = True
        try:
            return checkpoint(self._region, self.pre(x), use_reentrant=self.reentrant)
        finally:
            self._in_forward = False


def _replay_forwards(prog, mods, x, seeds):
    """One process: each rank's forwards in its program order, with that rank's generator
    (seeded as the pipeline's rank was), the outputs chained stage to stage; each microbatch's
    loss then backpropagated (each recomputation restores the state its forward saw). Returns
    the losses and every rank's generator state after its forwards."""
    import torch.nn.functional as F

    n, m = prog.num_stages, RNG_M
    forwards = {r: [tuple(map(int, a.split("F"))) for act in prog.compute_actions(r)
                    for a in (UNIT.match(act).group(1, 2) and [f"{UNIT.match(act).group(1)}F{UNIT.match(act).group(2)}"]
                              if UNIT.match(act) else [act]) if "F" in a and "OVERLAP" not in a]
                for r in range(prog.pp)}
    state = {r: torch.manual_seed(seeds[r]).get_state() for r in range(prog.pp)}
    xs = x.chunk(m)
    out: dict = {}
    while any(forwards.values()):
        for r in range(prog.pp):
            while forwards[r]:
                s, mb = forwards[r][0]
                if s > 0 and (s - 1, mb) not in out:
                    break
                torch.set_rng_state(state[r])
                out[(s, mb)] = mods[s](xs[mb] if s == 0 else out[(s - 1, mb)])
                state[r] = torch.get_rng_state()
                forwards[r].pop(0)
    return out, state


def _dropout_step(rank, size, overlap, reentrant):
    import warnings

    import torch.nn.functional as F

    warnings.simplefilter("ignore", RuntimeWarning)  # a reentrant stage's fallback to a fused backward
    prog = zbpipe.compile("dualpipev", size, RNG_M)
    n = prog.num_stages
    torch.manual_seed(0)
    mods = [DropoutBlock(reentrant) for _ in range(n)]
    refs = copy.deepcopy(mods)
    mine = [s for s in range(n) if prog.stage_to_rank[s] == rank]
    stages = [zbpipe.PipelineStage(mods[s], s, n, "cpu") for s in mine]
    sched = zbpipe.ScheduleDualPipeV(stages, RNG_M, loss_fn=F.mse_loss, overlap_f_b=overlap, timeout=60)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(RNG_M * RNG_ROWS, RNG_WIDTH, generator=gen), torch.randn(RNG_M * RNG_ROWS, RNG_WIDTH, generator=gen)
    first = 0 in mine  # the first and the last stage live on rank 0
    sched.step(*((x,) if first else ()), target=y if first else None)  # the handshake's step
    for s in mine:
        mods[s].zero_grad()
        mods[s].forwards.clear()
        mods[s].recomputed.clear()
    seeds = [100 + r for r in range(size)]
    torch.manual_seed(seeds[rank])
    losses = []
    sched.step(*((x,) if first else ()), target=y if first else None, losses=losses)
    rng_after = torch.get_rng_state()
    # One process, replaying every rank's forwards with its generator.
    outs, states = _replay_forwards(prog, refs, x, seeds)
    ref_losses = [F.mse_loss(outs[(n - 1, mb)], ym) for mb, ym in enumerate(y.chunk(RNG_M))]
    for loss in ref_losses:
        (loss / RNG_M).backward()
    masks_differ = sum(not torch.equal(f, r) for s in mine for f, r in zip(mods[s].forwards, mods[s].recomputed))
    grads_differ = [f"stage {s} {name}" for s in mine for (name, p), q in zip(mods[s].named_parameters(), refs[s].parameters())
                    if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5)]
    losses_differ = first and not torch.allclose(torch.stack(losses), torch.stack(ref_losses).detach(), rtol=1e-5, atol=1e-5)
    return masks_differ, grads_differ, losses_differ, torch.equal(rng_after, states[rank])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in-sequence"])
def test_dropout_under_checkpoint_equals_one_process(spawn_world, overlap, reentrant):
    """DualPipeV with non-reentrant checkpoint around Dropout: every recomputed mask is its
    forward's, every gradient and loss is one process's that replays each rank's forwards with
    that rank's generator, and each rank's generator ends where that replay's does. The overlap
    worker and the executor's thread share the process's one CPU generator; a recomputation on
    the worker (torch's fork_rng: set the forward's state, draw, restore) interleaved with a
    forward drew other masks and rewound the forward's draws (issue 44: 23-30 of ~620 masks).
    Recomputed on the executor's thread before the worker starts, the worker draws nothing. A
    reentrant region recomputes inside its node: such a unit runs its halves in sequence."""
    for rank, (masks, grads, losses, rng) in enumerate(spawn_world(2).run(_dropout_step, overlap, reentrant,
                                                                          timeout_s=180)):
        assert masks == 0, f"rank {rank}: {masks} recomputed masks differ from their forward's"
        assert not grads, f"rank {rank}: gradients differ: {grads}"
        assert not losses, f"rank {rank}: losses differ"
        assert rng, f"rank {rank}: the generator did not end where one process's does"
