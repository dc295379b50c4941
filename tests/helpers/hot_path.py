"""What the stream-ordered hot path tests measure on a rank (test_stream_hot_path.py on the CPU
loopback world, test_device_cuda.py on one GPU): a stage whose autograd saves its input and
its output, the storages it saved and the gradients it sent with their live bytes at the end of
every forward, and the ops that copy to the host or read a value there."""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.nn.functional as F
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import zbpipe
from zbpipe import _C

from .loopback import run_threads

WIDTH = 64
STEPS = 3  # the first negotiates shapes; the last is measured


class Scale(nn.Module):
    """tanh(x * w): autograd saves the input x (for w's gradient) and the output (tanh's)."""

    def __init__(self, seed: int, tracker=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, generator=torch.Generator().manual_seed(seed)))
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


def host_waits_inside_the_step(events, settles) -> int:
    """The host-blocking waits ("sync" events) a step recorded before its end began (its last
    settle): what a host must not do on a GPU. Those at the end itself are the step's end
    completing what the device has not finished yet, which depends on how far the device lags
    the host, not on zbpipe (lagging_polls models it on the CPU)."""
    end = settles[-1] if settles else len(events)
    return sum(1 for kind, *_ in events[:end] if kind == "sync")


def loopback_steps(name, pp, m, *, track=False, store=True, device="cpu", lagging_polls=0):
    """STEPS steps of `name` on a loopback world (with a store unless `store` is False; its
    works lag the host by `lagging_polls`, see _LoopbackWorld); per rank, for the last step:
    its host-blocking waits (all, and those inside the step), its events, its host reads
    (counted on the rank's thread) and, with `track`, its Tracker. On a CUDA `device` each
    rank computes on a stream of its own (the loopback's copies and waits then order real
    streams)."""
    prog = zbpipe.compile(name, pp, m)
    ns = prog.num_stages
    world = _C._LoopbackWorld(pp, store=store, lagging_polls=lagging_polls)
    torch.manual_seed(0)
    x, y = torch.randn(2 * m, WIDTH, device=device), torch.randn(2 * m, WIDTH, device=device)
    cuda = torch.device(device).type == "cuda"
    barrier = threading.Barrier(pp)

    def rank_main(r):
        mine = [s for s in range(ns) if prog.stage_to_rank[s] == r]
        mods = {s: Scale(s).to(device) for s in mine}
        tracker = None
        if track:
            params = {p.untyped_storage().data_ptr() for mod in mods.values() for p in mod.parameters()}
            tracker = Tracker(params | {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()})
        stages = [zbpipe.PipelineStage(mods[s], s, ns, device, group=world.group(r)) for s in mine]
        sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], m, loss_fn=F.mse_loss,
                                                stream_ordered=True, timeout=30.0)
        args, target = ((x,) if 0 in mine else ()), (y if ns - 1 in mine else None)
        counting = Counting()
        if cuda:
            torch.cuda.synchronize()  # what the default stream made (data, parameters)
        with torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext():
            _steps(r, sched, mods, tracker, counting, args, target)
            if cuda:
                torch.cuda.current_stream().synchronize()
        barrier.wait(30)
        events, settles = world.events(r), world.settles(r)
        return dict(host_waits=world.host_waits(r), events=events, settles=settles,
                    host_waits_inside=host_waits_inside_the_step(events, settles), host_reads=counting.host_reads,
                    tracker=tracker, grads={s: mod.w.grad.cpu() for s, mod in mods.items()})

    def _steps(r, sched, mods, tracker, counting, args, target):
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

    out = run_threads(world, rank_main, timeout=120)
    failed = {r: repr(v) for r, v in out.items() if isinstance(v, BaseException)}
    assert not failed, failed
    check_exact(prog, out, x.cpu(), y.cpu())
    return prog, out


def check_exact(prog, out, x, y):
    """Every stage's gradient after STEPS steps, against the same steps in one process."""
    ref = [Scale(s) for s in range(prog.num_stages)]
    for _ in range(STEPS):
        h = x
        for mod in ref:
            h = mod(h)
        F.mse_loss(h, y).backward()
    for res in out.values():
        for s, g in res["grads"].items():
            torch.testing.assert_close(g, ref[s].w.grad, msg=lambda m, s=s: f"{prog.schedule} stage {s}: {m}")


STOP_TIMEOUT_S = 5.0


def stopped_peer(device):
    """Two ranks of 1f1b on a loopback world with a store whose stream waits return at once (the
    host runs ahead of the device); rank 1's forward raises in the second step. Per rank: (the
    exception's type name or "ok", its message, seconds the step took)."""
    world = _C._LoopbackWorld(2, stream_waits=True, store=True)
    m, dev = 4, torch.device(device)
    cuda = dev.type == "cuda"

    def stop(*args):
        raise RuntimeError("this rank stops here")

    def rank_main(r):
        with torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext():
            mod = Scale(r).to(dev)
            stage = zbpipe.PipelineStage(mod, r, 2, dev, group=world.group(r))
            sched = zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, stream_ordered=True, timeout=STOP_TIMEOUT_S)
            x, y = torch.randn(2 * m, WIDTH, device=dev), torch.randn(2 * m, WIDTH, device=dev)
            args, target = ((x,) if r == 0 else ()), (y if r == 1 else None)
            sched.step(*args, target=target)  # shapes
            if r == 1:
                mod.forward = stop
            t0 = time.monotonic()
            try:
                sched.step(*args, target=target)
            except Exception as e:  # noqa: BLE001 - the result is the point
                return type(e).__name__, str(e), time.monotonic() - t0
            return "ok", "", time.monotonic() - t0

    return run_threads(world, rank_main, timeout=60)
