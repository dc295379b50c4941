"""The split backward's cost and where its work lands: zbpipe's graph split, zbpipe's
deferred_linear and PyTorch's stage_backward_input / stage_backward_weight, in the same run.

    PYTHONPATH=. python benchmarks/bench_split.py                       # all models, 1 thread
    PYTHONPATH=. python benchmarks/bench_split.py --models linear --reps 3

Models (benchmarks/_split_models.py): `linear` = four nn.Linear(1024, 1024), `block` = a
transformer encoder block (attention + MLP, d=512), `twice` = two nn.Linear(1024, 1024) each
applied twice; microbatches of 64 rows, fp32, CPU, one spawned rank (torch.set_num_threads).

Table 1, from the executor's own trace (issue #8, item 1): one rank holds both stages of a ZBV
program (pp=1, 4 microbatches); on stage 1, whose input carries a gradient, the host time of
its I and W actions summed over the step and W's share of I+W, with the graph split and with
`deferred_linear=True`; median over the timed steps. Goal: the split's share at least 0.35 and
within 0.1 of deferred_linear's.

Table 2 (item 6), the three backends called directly on one stage microbatch whose input needs
a gradient (a middle stage): F, B (full backward), I and W host time (medians over
repetitions, the backends alternating within each), W's share of I+W, and the bytes held
between I and W: every tensor storage created by the forward and I (the input and the output
gradient included, parameters and their .grad excluded) still alive after I once the caller has dropped its
own references (output, input, input gradient), i.e. what W keeps plus anything I failed to
release. `after W` is the same count after W (0 means nothing leaks). For a Linear with input
[r, k] and output [r, n], W needs the saved input (r*k*4 bytes) and the output gradient
(r*n*4): 512 KiB per Linear at r=64, k=n=1024, on all three paths; PyTorch's W also keeps the
rest of the graph (I runs with retain_graph=True and frees nothing). The bytes are counted in
a separate, untimed pass (a dispatch mode sees every storage).

Where dW runs: the graph split runs every weight-side product in W (AddmmBackward's dW and
db, attention's projections); deferred_linear defers nn.Linear modules called through their
forward only (a transformer's attention projections keep their dW in I); PyTorch's W re-runs
the boundary nodes like the graph split. The machine these numbers come from is shared: read
ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _split_models import MODELS, build
from zbpipe.launch import run_local

MICROBATCHES = 4  # of table 1's ZBV step


class _SplitPath:
    """zbpipe's graph split: the executor's C++ B, I and W."""

    name = "graph split"

    def __init__(self, model):
        from zbpipe import _C

        self.model, self._C, self.cache = model, _C, _C.SplitPlanCache()

    def forward(self, x):
        return self.model(x), None

    def full(self, out, ctx, g, x):
        self._C.backward_full([out], [g], [x])

    def input(self, out, ctx, g, x):
        return self._C.backward_input([out], [g], [x], self.cache)[1]

    def weight(self, state):
        self._C.backward_weight(state)


class _DeferredPath:
    """zbpipe's deferred_linear: the Linears' dW queued in I's full backward, run in W (what
    the executor does for a deferred_linear stage)."""

    name = "deferred_linear"

    def __init__(self, model):
        from zbpipe import _C
        from zbpipe.deferred_linear import DeferredLinearHook

        self.model, self._C = model, _C
        self.hook = DeferredLinearHook(model)
        self.hook.in_step = True

    def forward(self, x):
        self.hook.queue = queue = []
        try:
            return self.model(x), queue
        finally:
            self.hook.queue = None

    def full(self, out, queue, g, x):
        self._C.backward_full([out], [g], [x])
        self.weight(queue)

    def input(self, out, queue, g, x):
        self._C.backward_full([out], [g], [x])
        return queue

    def weight(self, queue):
        for entry in queue:
            entry.run()
        queue.clear()


class _TorchPath:
    """torch.distributed.pipelining._backward, as its PipelineStage calls it on a middle stage."""

    name = "torch"

    def __init__(self, model):
        from torch.distributed.pipelining import _backward

        self.model, self._b = model, _backward

    def forward(self, x):
        return self.model(x), None

    def full(self, out, ctx, g, x):
        self._b.stage_backward(out, g, [x])

    def input(self, out, ctx, g, x):
        return self._b.stage_backward_input([out], [g], [x], self.model.parameters())[1]

    def weight(self, groups):
        self._b.stage_backward_weight(self.model.parameters(), groups)


PATHS = (_SplitPath, _DeferredPath, _TorchPath)


class _Storages(TorchDispatchMode):
    """Weak references to every storage an op creates while active (the autograd engine runs
    CPU backward ops on the calling thread, so I's and W's are seen too)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                old = self.refs.get(s._cdata)
                if old is None or old[0].expired():
                    self.refs[s._cdata] = (StorageWeakRef(s), s.nbytes(), s.data_ptr())
        return out

    def live_bytes(self, exclude_ptrs: set[int]) -> int:
        gc.collect()
        return sum(n for ref, n, ptr in self.refs.values() if not ref.expired() and ptr not in exclude_ptrs)


def _zero(model):
    for p in model.parameters():
        p.grad = None


def _grad_ptrs(model) -> set[int]:
    return {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}


def _held_bytes(path, base, gbase) -> tuple[int, int]:
    """(bytes alive between I and W, bytes alive after W) of one microbatch, see the docstring."""
    _zero(path.model)
    params = {p.untyped_storage().data_ptr() for p in path.model.parameters()}
    with _Storages() as track:
        x, g = base.clone().requires_grad_(True), gbase.clone()
        out, ctx = path.forward(x)
        state = path.input(out, ctx, g, x)
        del out, ctx, x, g
        held = track.live_bytes(params | _grad_ptrs(path.model))  # dW done in I is no activation
        path.weight(state)
        del state
        after = track.live_bytes(params | _grad_ptrs(path.model))
    return held, after


def _function_table(a) -> None:
    print("\n**Table 2** backends called directly, one middle-stage microbatch: host ms (median of "
          f"{a['reps']} reps), W's share of I+W, KiB held between I and W\n")
    print("| model | backend | F ms | B ms | I ms | W ms | I+W / B | W/(I+W) | held I->W KiB | after W KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a["models"]:
        shape = MODELS[name][1]
        gen = torch.Generator().manual_seed(1)
        base, gbase = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        paths = [cls(build(name)) for cls in PATHS]
        times = {p.name: {k: [] for k in "FBIW"} for p in paths}
        for rep in range(a["warmup"] + a["reps"]):
            for p in paths:  # alternating, so drift on a shared machine hits every backend
                _zero(p.model)
                x = base.clone().requires_grad_(True)
                t0 = time.perf_counter()
                out, ctx = p.forward(x)
                t1 = time.perf_counter()
                p.full(out, ctx, gbase, x)
                t2 = time.perf_counter()
                del out, ctx
                _zero(p.model)
                x = base.clone().requires_grad_(True)
                out, ctx = p.forward(x)
                t3 = time.perf_counter()
                state = p.input(out, ctx, gbase, x)
                t4 = time.perf_counter()
                del out, ctx
                p.weight(state)
                t5 = time.perf_counter()
                del state
                if rep >= a["warmup"]:
                    for k, dt in zip("FBIW", (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                        times[p.name][k].append(dt)
        for p in paths:
            med = {k: statistics.median(v) * 1e3 for k, v in times[p.name].items()}
            held, after = _held_bytes(p, base, gbase)
            print(f"| {name} | {p.name} | {med['F']:.2f} | {med['B']:.2f} | {med['I']:.2f} | {med['W']:.2f} "
                  f"| {(med['I'] + med['W']) / med['B']:.2f} | {med['W'] / (med['I'] + med['W']):.2f} "
                  f"| {held / 1024:.0f} | {after / 1024:.0f} |", flush=True)


def _trace_share(name: str, deferred: bool, a) -> tuple[float, float, float]:
    """(I ms, W ms, W share) of stage 1 per ZBV step, medians over the timed steps."""
    import zbpipe

    mods = [build(name, seed=s) for s in range(2)]
    stages = [zbpipe.PipelineStage(m, s, 2, "cpu", deferred_linear=deferred) for s, m in enumerate(mods)]
    sched = zbpipe.ScheduleZBVZeroBubble(stages, MICROBATCHES, loss_fn=F.mse_loss)
    shape = MODELS[name][1]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((shape[0] * MICROBATCHES, *shape[1:]), generator=gen)
    y = torch.randn(x.shape, generator=gen)
    i_ms, w_ms, share = [], [], []
    for k in range(a["warmup"] + a["reps"]):
        for m in mods:
            _zero(m)
        sched.step(x, target=y)
        if k < a["warmup"]:
            continue
        t = {"I": 0.0, "W": 0.0}
        for r in sched.trace():
            hit = re.fullmatch(r"1([IW])\d+", r["action"])
            if hit:
                t[hit[1]] += (r["host_end_ns"] - r["host_start_ns"]) / 1e6
        i_ms.append(t["I"])
        w_ms.append(t["W"])
        share.append(t["W"] / (t["I"] + t["W"]))
    return statistics.median(i_ms), statistics.median(w_ms), statistics.median(share)


def _trace_table(a) -> None:
    print(f"\n**Table 1** executor trace, ZBV on one rank (pp=1, {MICROBATCHES} microbatches), stage 1: "
          f"I and W host ms per step, W/(I+W) (median of {a['reps']} steps)\n")
    print("| model | split I ms | split W ms | split W/(I+W) | deferred I ms | deferred W ms "
          "| deferred W/(I+W) | deferred - split |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a["models"]:
        si, sw, ss = _trace_share(name, False, a)
        di, dw, ds = _trace_share(name, True, a)
        print(f"| {name} | {si:.2f} | {sw:.2f} | {ss:.2f} | {di:.2f} | {dw:.2f} | {ds:.2f} | {ds - ss:+.2f} |",
              flush=True)


def _bench(rank: int, world: int, a: dict) -> None:
    if "trace" in a["tables"]:
        _trace_table(a)
    if "backends" in a["tables"]:
        _function_table(a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list from {list(MODELS)}")
    p.add_argument("--tables", default="trace,backends", help="comma list from trace, backends")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads of the rank")
    ns = p.parse_args(argv)
    a = vars(ns) | {"models": ns.models.split(","), "tables": ns.tables.split(",")}
    for m in a["models"]:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {list(MODELS)}")
    print(f"# bench_split: torch {torch.__version__}, CPU fp32, {ns.threads} thread(s), microbatches of "
          f"{', '.join(f'{m} {MODELS[m][1]}' for m in a['models'])}; {ns.warmup} warm-up, "
          f"{ns.reps} timed", flush=True)
    run_local(_bench, 1, (a,), timeout_s=1800, threads=ns.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
