"""The stream-ordered (NCCL) hot path, on the in-process loopback world that models stream
waits (one thread per rank, a shared in-process store as real groups have): in a steady step
the host never blocks on a message (the backend counts the host-blocking waits: zero), the
step makes no device-to-host copy and no one-element message (the step's input signature goes
through the store), and a sent tensor is released when it is posted, so a rank's measured peak
of saved activations and boundary buffers equals the memory model's (simulate's peak_memory,
mem_f measured per stage). Over Gloo (stream_ordered=True) the step also makes no
device-to-host copy."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import run_threads
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import zbpipe
from zbpipe import _C

WIDTH = 64
STEPS = 3


class Scale(nn.Module):
    """tanh(x * w): autograd saves the input x (for w's gradient) and the output (tanh's)."""

    def __init__(self, tracker=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH))
        self.tracker = tracker

    def forward(self, x):
        if self.tracker is None or not torch.is_grad_enabled():
            return torch.tanh(x * self.w)
        self.tracker.per_forward.append(0)
        with torch.autograd.graph.saved_tensors_hooks(self.tracker.pack, lambda t: t):
            out = torch.tanh(x * self.w)
        if x.requires_grad:  # the input gradient this stage sends back
            x.register_hook(self.tracker.sent)
        self.tracker.snapshot()
        return out


class Tracker:
    """Storages of what a rank's stage saved and the input gradients it sent, with the live
    bytes of those at the end of every forward (parameters and the user's batch excluded)."""

    def __init__(self, skip: set[int]):
        self.skip, self.refs, self.per_forward, self.snapshots, self.live_at = skip, {}, [], [], []

    def _track(self, t, what):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.skip and (ptr not in self.refs or self.refs[ptr][0].expired()):  # addresses recur
            self.refs[ptr] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes(), what)
            return t.untyped_storage().nbytes()
        return 0

    def pack(self, t):
        if not isinstance(t, nn.Parameter):
            self.per_forward[-1] += self._track(t, f"saved #{len(self.per_forward) - 1}")
        return t

    def sent(self, g):
        self._track(g, f"sent gradient #{len(self.per_forward) - 1}")

    def live(self) -> list[str]:
        return [what for ref, _, what in self.refs.values() if not ref.expired()]

    def snapshot(self):
        self.snapshots.append(sum(n for ref, n, _ in self.refs.values() if not ref.expired()))
        self.live_at.append(self.live())


class Counting(TorchDispatchMode):
    """Counts the ops that copy to the host or read a value on it (.cpu(), .item())."""

    def __init__(self):
        super().__init__()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten._to_copy.default):
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


def _loopback_steps(name, pp, m, *, track=False, store=True):
    """STEPS steps of `name` on a loopback world (with a store unless `store` is False); per
    rank, for the last step: its host-blocking waits, its events, its host reads (counted on
    the rank's thread) and, with `track`, its Tracker."""
    prog = zbpipe.compile(name, pp, m)
    ns = prog.num_stages
    world = _C._LoopbackWorld(pp, store=store)
    torch.manual_seed(0)
    x, y = torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH)
    barrier = threading.Barrier(pp)

    def rank_main(r):
        mine = [s for s in range(ns) if prog.stage_to_rank[s] == r]
        mods = {s: Scale() for s in mine}
        tracker = None
        if track:
            params = {p.untyped_storage().data_ptr() for mod in mods.values() for p in mod.parameters()}
            tracker = Tracker(params | {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()})
        stages = [zbpipe.PipelineStage(mods[s], s, ns, "cpu", group=world.group(r)) for s in mine]
        sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], m, loss_fn=F.mse_loss,
                                                stream_ordered=True, timeout=30.0)
        args, target = ((x,) if 0 in mine else ()), (y if ns - 1 in mine else None)
        counting = Counting()
        for k in range(STEPS):
            last = k == STEPS - 1
            barrier.wait(30)
            if last:
                if r == 0:
                    world.clear_events()
                for mod in mods.values():  # the last step only: the first negotiates shapes
                    mod.tracker = tracker
            barrier.wait(30)
            with counting if last else contextlib.nullcontext():
                sched.step(*args, target=target, return_outputs=False)  # kept outputs are the caller's
        barrier.wait(30)
        return dict(host_waits=world.host_waits(r), events=world.events(r), host_reads=counting.host_reads,
                    tracker=tracker)

    out = run_threads(world, rank_main, timeout=120)
    failed = {r: repr(v) for r, v in out.items() if isinstance(v, BaseException)}
    assert not failed, failed
    return prog, out


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"])
def test_a_steady_step_never_blocks_the_host_nor_reads_a_device_value(name):
    prog, out = _loopback_steps(name, 2, 4)
    for r, res in sorted(out.items()):
        assert res["host_waits"] == 0, (name, r, res["host_waits"], res["events"])
        assert res["host_reads"] == 0, (name, r, res["host_reads"])
        # Every post carries the program's data messages only: no one-element signature message.
        posts = [ops for kind, _, _, ops in res["events"] if kind == "post"]
        assert posts and all(op[3] == 2 * 4 * WIDTH for ops in posts for op in ops), (name, r, posts)


def test_without_a_store_the_signature_is_a_message_read_on_the_host():
    # The counters see what the store removes: the storeless loopback world still sends the
    # index as a one-element message, which its receivers wait for on the host and read.
    _, out = _loopback_steps("1f1b", 2, 4, store=False)
    assert out[1]["host_waits"] >= 1 and out[1]["host_reads"] >= 1, out[1]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_peak_bytes_equal_the_memory_model_with_boundary_buffers(name):
    pp, m = 2, 4
    prog, out = _loopback_steps(name, pp, m, track=True)
    for r, res in sorted(out.items()):
        tr = res["tracker"]
        assert len(tr.per_forward) == m and len(set(tr.per_forward)) == 1, tr.per_forward
        mem_f = [float(tr.per_forward[0]) if prog.stage_to_rank[s] == r else 1.0 for s in range(prog.num_stages)]
        model = zbpipe.simulate(prog, mem_f=mem_f).peak_memory[r]
        assert max(tr.snapshots) == model, (name, r, tr.snapshots, model, tr.per_forward, tr.live_at)
        assert not tr.live(), f"alive after the step: {tr.live()}"


def _gloo_host_reads(rank, pp):
    group = torch.distributed.new_group(list(range(pp)), backend="gloo")
    torch.manual_seed(0)
    m = 4
    stage = zbpipe.PipelineStage(Scale(), rank, pp, "cpu", group=group)
    sched = zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, stream_ordered=True, timeout=30)
    x, y = torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH)
    reads = []
    for _ in range(STEPS):
        counting = Counting()
        with counting:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == pp - 1 else None)
        reads.append(counting.host_reads)
    return reads


def test_no_device_to_host_copy_per_step_over_gloo(spawn_world):
    for rank, reads in enumerate(spawn_world(2).run(_gloo_host_reads, timeout_s=120)):
        assert reads[1:] == [0] * (STEPS - 1), (rank, reads)
