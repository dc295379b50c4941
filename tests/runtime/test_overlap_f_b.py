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
