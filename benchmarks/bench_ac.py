"""Activation checkpointing under the split backward (issue #21): does a zero-bubble schedule
keep its gain over 1F1B when every block is checkpointed?

    PYTHONPATH=. python benchmarks/bench_ac.py                           # both models
    PYTHONPATH=. python benchmarks/bench_ac.py --models mlp --reps 3

pp=2, two spawned ranks on one host joined by Gloo (zbpipe.launch), one intra-op
thread per rank, 8 microbatches, fp32 CPU; schedules 1f1b, zb_h1, zbv and interleaved_zb, each
with and without AC, on the same weights. Models (the blocks are split evenly over the
schedule's stages: one stage per rank for 1f1b and zb_h1, two for zbv and interleaved_zb):
- `mlp` (the issue's): 4 blocks per rank, each `x + checkpoint(mlp, x, use_reentrant=False)`,
  mlp = Linear(512, 2048) -> GELU -> Linear(2048, 512), microbatches of 64 rows (two blocks
  per stage on the V schedules);
- `block`: 2 transformer encoder blocks per rank (benchmarks/_split_models.py: d=512, 8 heads,
  MLP 2048, pre-norm; microbatches of [2, 32, 512]), each under torch's checkpoint_wrapper as
  torchtitan applies it.

Table 1, per schedule and AC setting, medians over the timed steps (the runs alternate step by
step, so drift on a shared machine hits all of them):
- `recompute`: calls of each checkpointed function in the backward per (stage, microbatch,
  block), min and max over every (stage, microbatch) of both ranks and every timed step (goal:
  exactly 1.00 everywhere);
- `F / I / W / B ms`: mean host time of one action (receive waits excluded) over the stages,
  from the executor's trace. The first stage's input needs no gradient: its I does nothing and
  its W the whole backward, recomputation included (W's mean counts it);
- `step ms` (rank 0, between barriers), `/1f1b+AC` (over 1F1B with AC), `AC/none` (a schedule's
  step with AC over its step without). Goal: each zero-bubble schedule's AC/none no worse than
  1F1B's plus 0.05. `predicted ms` is zbpipe.simulate's makespan of the program fed with the
  measured per-stage F, I, W (B) and a Gloo send's latency (`comm`), and `pred AC/none` its
  ratio: the same comparison with the timing noise of the step's waits taken out; `CPU pred
  AC/none` the same fed with each action's thread CPU time (the trace's `cpu_ns`), which leaves
  out the time other processes took of the rank's core (not what they do to its caches);
- `held MiB r0 / r1`: in one extra, untimed step, the largest total, sampled after every
  compute action, of the bytes of the live storages an op made during the step (saved
  activations, recomputed tensors, captured gradients, receive buffers, kept outputs; not
  parameters or their .grad, accumulated in place); `peak MiB` the same at its largest after
  any op (also the actions' transients: a recomputation's working set, dW before it is added).

Table 2, one stage microbatch of each stage kind called directly (F, I, W on
zbpipe._C.backward_*, the forward in a stage's training-forward context): `mem_f`, the bytes
held from F to I (what the forward made that is still alive, its output excluded, plus the
input where it needs a gradient: a receive buffer), and `mem_w`, those held from I to W (W's
captured gradients included). The first stage's I does nothing: it holds mem_f until W. The
simulator's memory model (F +mem_f, I -(mem_f - mem_w), W -mem_w, B -mem_f) walked over each
rank's program with these gives `model MiB`, next to table 1's `held`, which also counts what
the model leaves out: receive buffers posted at step start, the last stage's kept outputs and
loss.

The machine these numbers come from is shared: compare within one run, and read the predicted
columns where the step times are noisy.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from _split_models import MODELS as SPLIT_MODELS
from bench_bubble import KINDS, _agree, _comm_ms, _costs, _predict
from zbpipe.launch import run_local

PP = 2
SCHEDULES = ("1f1b", "zb_h1", "zbv", "interleaved_zb")
BLOCKS = {"mlp": 4, "block": 2}  # per rank
SHAPES = {"mlp": (64, 512), "block": SPLIT_MODELS["block"][1]}


class Calls:
    """Calls of one stage's checkpointed functions, per (microbatch, block): a call during the
    stage's forward (on that thread) tags the block's input with the microbatch; any other is
    a recomputation of the tagged input."""

    def __init__(self):
        self.local = threading.local()
        self.tags: dict[tuple[int, int], int] = {}
        self.recomputed: dict[tuple[int, int], int] = {}

    def record(self, block: int, x: torch.Tensor) -> None:
        if not torch.is_grad_enabled():  # the handshake's shape run
            return
        mb = getattr(self.local, "mb", None)
        key = (block, x.data_ptr())
        if mb is not None:
            self.tags[key] = mb
            self.recomputed.setdefault((mb, block), 0)
        else:
            mb = self.tags[key]
            self.recomputed[mb, block] += 1


class Counted(nn.Module):
    def __init__(self, inner: nn.Module, calls: Calls, block: int):
        super().__init__()
        self.inner, self.calls, self.block = inner, calls, block

    def forward(self, x):
        self.calls.record(self.block, x)
        return self.inner(x)


class MLPBlock(nn.Module):
    """`x + checkpoint(mlp, x, use_reentrant=False)` (without AC: `x + mlp(x)`)."""

    def __init__(self, ac: bool, calls: Calls, block: int):
        super().__init__()
        self.ac = ac
        self.mlp = Counted(nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)), calls, block)

    def forward(self, x):
        return x + (checkpoint(self.mlp, x, use_reentrant=False) if self.ac else self.mlp(x))


class Stage(nn.Module):
    """Blocks of one stage; forward k of a step runs microbatch k % m (the executor runs a
    stage's forwards in microbatch order)."""

    def __init__(self, model: str, ac: bool, first_block: int, n_blocks: int, m: int):
        super().__init__()
        self.calls, self.m, self.k = Calls(), m, 0
        blocks = []
        for b in range(first_block, first_block + n_blocks):
            torch.manual_seed(b)  # the same weights with and without AC, in every layout
            if model == "mlp":
                blocks.append(MLPBlock(ac, self.calls, b))
            else:
                counted = Counted(SPLIT_MODELS["block"][0](), self.calls, b)
                blocks.append(checkpoint_wrapper(counted) if ac else counted)
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x):
        if torch.is_grad_enabled():
            self.calls.local.mb, self.k = self.k % self.m, self.k + 1
        try:
            return self.blocks(x)
        finally:
            self.calls.local.mb = None


class _PeakBytes(TorchDispatchMode):
    """Bytes of the live storages made by ops while active, at their largest after any op,
    but those of `exclude` (tensors made before: parameters, their .grad -- accumulated in
    place -- and the data), which views (a weight's transpose) and in-place ops return."""

    def __init__(self, exclude=()):
        super().__init__()
        self.exclude = {t.untyped_storage()._cdata for t in exclude if t is not None}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = self.peak = self.held = 0

    def _purge(self) -> None:
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.total -= n

    def sample(self) -> None:
        """Between two actions: what the rank holds, transients of the actions gone."""
        self._purge()
        self.held = max(self.held, self.total)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._purge()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in self.live and s._cdata not in self.exclude and s.nbytes():
                    self.live[s._cdata] = (StorageWeakRef(s), s.nbytes())
                    self.total += s.nbytes()
        self.peak = max(self.peak, self.total)
        return out


class _Run:
    """One schedule, with or without AC, on this rank's stages."""

    def __init__(self, name: str, model: str, ac: bool, rank: int, m: int):
        import zbpipe

        self.name, self.ac, self.m = name, ac, m
        self.prog = zbpipe.compile(name, PP, m)
        n = self.prog.num_stages
        per = PP * BLOCKS[model] // n
        self.mine = [s for s in range(n) if self.prog.stage_to_rank[s] == rank]
        self.num_stages = n
        self.mods = {s: Stage(model, ac, s * per, per, m) for s in self.mine}
        stages = [zbpipe.PipelineStage(self.mods[s], s, n, "cpu") for s in self.mine]
        self.sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], m,
                                                    loss_fn=F.mse_loss, device_timing=True)  # cpu_ns
        g = torch.Generator().manual_seed(1)
        shape = SHAPES[model]
        self.x = torch.randn((shape[0] * m, *shape[1:]), generator=g)
        self.y = torch.randn(self.x.shape, generator=g)
        self.walls: list[float] = []
        self.samples = [[[] for _ in range(n)] for _ in KINDS]  # [kind][stage]: host ms of the timed steps
        self.cpu_samples = [[[] for _ in range(n)] for _ in KINDS]  # the same, the thread's CPU ms
        self.recompute: list[float] = []  # per (stage, microbatch, block) of every timed step
        self.peak = self.held = 0

    def step(self, timed: bool, measure: bool = False) -> None:
        for mod in self.mods.values():
            mod.calls.recomputed.clear()
            if not measure:  # the measured step accumulates into .grad in place
                for p in mod.parameters():
                    p.grad = None
        dist.barrier()
        args = ((self.x,) if 0 in self.mine else ())
        target = self.y if self.num_stages - 1 in self.mine else None
        t0 = time.perf_counter()
        if measure:
            made_before = [self.x, self.y] + [t for mod in self.mods.values() for p in mod.parameters()
                                               for t in (p, p.grad)]
            track = _PeakBytes(made_before)

            def sampled(action, ctx):  # the last step of this run: its custom functions stay
                ctx.run(action)
                track.sample()

            for kind in ("F", "I", "W", "B"):
                self.sched.register_custom_function(kind, sampled)
            with track:
                self.sched.step(*args, target=target)
            self.peak, self.held = track.peak, track.held
        else:
            self.sched.step(*args, target=target)
        dist.barrier()
        wall = time.perf_counter() - t0
        if not timed:
            return
        self.walls.append(wall * 1e3)
        trace = self.sched.trace()
        for samples, costs in ((self.samples, _costs(trace, self.num_stages)),
                               (self.cpu_samples, _cpu_costs(trace, self.num_stages))):
            for kind, per_stage in zip(samples, costs):
                for s, v in enumerate(per_stage):
                    kind[s].extend(v)
        if self.ac:
            self.recompute += [c for mod in self.mods.values() for c in mod.calls.recomputed.values()]

    def result(self, comm: float) -> dict:
        def across(values, op):  # one value over both ranks
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, op=op)
            return t.tolist()

        cost = _agree(self.samples, self.num_stages)  # [kind][stage] means over both ranks
        means = [statistics.fmean([c for c in per_stage if c] or [0.0]) for per_stage in cost]
        lo, neg_hi = across([min(self.recompute, default=0.0), -max(self.recompute, default=0.0)],
                            dist.ReduceOp.MIN)
        mem = [0.0] * 2 * PP
        mem[dist.get_rank()], mem[PP + dist.get_rank()] = float(self.held), float(self.peak)
        mem = across(mem, dist.ReduceOp.SUM)
        cpu = _agree(self.cpu_samples, self.num_stages)
        return {"step": statistics.median(self.walls), "cost": dict(zip(KINDS, means)),
                "pred": _predict(self.prog, cost, comm), "cpu_pred": _predict(self.prog, cpu, comm),
                "recompute": (lo, -neg_hi), "held": mem[:PP], "peak": mem[PP:]}


def _cpu_costs(trace, num_stages: int) -> list:
    """Like bench_bubble._costs, with each compute action's thread CPU time (ms): what the
    action cost this rank, less what other processes took of its core meanwhile."""
    out = [[[] for _ in range(num_stages)] for _ in KINDS]
    for r in trace:
        hit = re.fullmatch(r"(\d+)([FBIW])\d+", r["action"])
        if hit:
            out[KINDS.index(hit[2])][int(hit[1])].append(r["cpu_ns"] / 1e6)
    return out


# ---- table 2: per-stage memory deltas, and the memory model over each program -------------

def _live_bytes(track: "_PeakBytes", exclude: set[int] = frozenset()) -> int:
    return sum(n for key, (ref, n) in track.live.items() if not ref.expired() and key not in exclude)


def _stage_deltas(model: str, ac: bool, n_blocks: int, input_grad: bool) -> tuple[int, int]:
    """(mem_f, mem_w) in bytes of one microbatch of a stage of n_blocks blocks, its output
    excluded; its input counts where it needs a gradient (a receive buffer in the pipeline, held
    until the first Linear's W), not on the first stage (the caller's data)."""
    import gc

    from zbpipe import _C
    from zbpipe.checkpointing import recompute_once

    mod = Stage(model, ac, 0, n_blocks, 1)
    shape = SHAPES[model]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen).requires_grad_(input_grad)
    g = torch.randn(shape, generator=gen)
    with _PeakBytes([x, g, *mod.parameters()]) as track:
        with recompute_once():
            out = mod(x)
        gc.collect()
        mem_f = _live_bytes(track, {out.untyped_storage()._cdata})
        (dx,), work = _C.backward_input([out], [g], [x])
        del out, dx
        gc.collect()
        mem_w = _live_bytes(track)
        _C.backward_weight(work)
    received = x.untyped_storage().nbytes() if input_grad else 0
    return mem_f + received, mem_w + received


def _model_peak(prog, rank: int, deltas: dict[int, tuple[int, int]]) -> int:
    """The simulator's memory model over the rank's program: F +mem_f, I -(mem_f - mem_w),
    W -mem_w, B -mem_f; the largest total."""
    total = peak = 0
    for action in prog.compute_actions(rank):
        for stage, kind, _mb in re.findall(r"(\d+)([FBIW])(\d+)", action):
            mem_f, mem_w = deltas[int(stage)]
            total += {"F": mem_f, "I": mem_w - mem_f, "W": -mem_w, "B": -mem_f}[kind]
            peak = max(peak, total)
    return peak


def _bench(rank: int, world: int, a: dict) -> None:
    import zbpipe

    for model in a["models"]:
        comm = _comm_ms(rank, world, SHAPES[model])
        runs = {(n, ac): _Run(n, model, ac, rank, a["microbatches"]) for n in a["schedules"] for ac in (True, False)}
        for _ in range(a["warmup"]):
            for r in runs.values():
                r.step(timed=False)
        for _ in range(a["reps"]):
            for r in runs.values():
                r.step(timed=True)
        for r in runs.values():
            r.step(timed=False, measure=True)
        rows = {key: r.result(comm) for key, r in runs.items()}
        if rank != 0:
            continue
        base = rows.get(("1f1b", True), {}).get("step")
        print(f"\n**{model}**, {BLOCKS[model]} blocks per rank, {a['microbatches']} microbatches of "
              f"{list(SHAPES[model])}, pp={PP}, 1 thread per rank, comm {comm:.2f} ms\n")
        print("| schedule | AC | recompute min-max | F ms | I ms | W ms | B ms | step ms | /1f1b+AC | AC/none "
              "| predicted ms | pred AC/none | CPU pred AC/none | held MiB r0 / r1 | peak MiB r0 / r1 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for (name, ac), r in rows.items():
            rec = f"{r['recompute'][0]:.2f}-{r['recompute'][1]:.2f}" if ac else "-"
            c = r["cost"]
            ratio = r["step"] / rows[(name, False)]["step"]
            rel = f"{r['step'] / base:.2f}" if base else "n/a"
            held, peak = (" / ".join(f"{p / 2**20:.1f}" for p in r[k]) for k in ("held", "peak"))
            pred_ratio = r["pred"] / rows[(name, False)]["pred"]
            cpu_ratio = r["cpu_pred"] / rows[(name, False)]["cpu_pred"]
            print(f"| {name} | {'yes' if ac else 'no'} | {rec} | {c['F']:.1f} | {c['I']:.1f} | {c['W']:.1f} "
                  f"| {c['B']:.1f} | {r['step']:.1f} | {rel} | {ratio:.2f} | {r['pred']:.1f} | {pred_ratio:.2f} "
                  f"| {cpu_ratio:.2f} | {held} | {peak} |", flush=True)
        if ("1f1b", True) in rows:
            ref = rows[("1f1b", True)]["step"] / rows[("1f1b", False)]["step"]
            pref = rows[("1f1b", True)]["pred"] / rows[("1f1b", False)]["pred"]
            cref = rows[("1f1b", True)]["cpu_pred"] / rows[("1f1b", False)]["cpu_pred"]
            print(f"\nGoals: recomputations 1.00 everywhere; AC/none <= 1f1b's {ref:.2f} + 0.05 "
                  f"(predicted: {pref:.2f} + 0.05; from CPU times: {cref:.2f} + 0.05):")
            for name in a["schedules"]:
                if name == "1f1b":
                    continue
                ratio = rows[(name, True)]["step"] / rows[(name, False)]["step"]
                pred = rows[(name, True)]["pred"] / rows[(name, False)]["pred"]
                cpu = rows[(name, True)]["cpu_pred"] / rows[(name, False)]["cpu_pred"]
                lo, hi = rows[(name, True)]["recompute"]
                print(f"- {name}: recompute {lo:.2f}-{hi:.2f}, AC/none {ratio:.2f} "
                      f"({'met' if ratio <= ref + 0.05 and lo == hi == 1.0 else 'NOT met'}), predicted "
                      f"{pred:.2f} ({'met' if pred <= pref + 0.05 else 'NOT met'}), from CPU times "
                      f"{cpu:.2f} ({'met' if cpu <= cref + 0.05 else 'NOT met'})")
        # Table 2 and the memory model.
        print(f"\nPer stage microbatch (table 2), {model}:\n")
        print("| AC | blocks | input grad | mem_f KiB | mem_w KiB |")
        print("|---|---|---|---|---|")
        deltas = {}
        for ac in (True, False):
            for n_blocks in sorted({PP * BLOCKS[model] // zbpipe.compile(n, PP, a["microbatches"]).num_stages
                                    for n in a["schedules"]}):
                for input_grad in (False, True):
                    deltas[ac, n_blocks, input_grad] = d = _stage_deltas(model, ac, n_blocks, input_grad)
                    print(f"| {'yes' if ac else 'no'} | {n_blocks} | {'yes' if input_grad else 'no'} "
                          f"| {d[0] / 1024:.0f} | {d[1] / 1024:.0f} |")
        print("\n| schedule | AC | model MiB r0 / r1 | held MiB r0 / r1 |")
        print("|---|---|---|---|")
        for (name, ac), r in rows.items():
            prog = runs[(name, ac)].prog
            per = PP * BLOCKS[model] // prog.num_stages
            stage_deltas = {s: deltas[ac, per, s != 0] for s in range(prog.num_stages)}
            modelled = " / ".join(f"{_model_peak(prog, k, stage_deltas) / 2**20:.1f}" for k in range(PP))
            measured = " / ".join(f"{p / 2**20:.1f}" for p in r["held"])
            print(f"| {name} | {'yes' if ac else 'no'} | {modelled} | {measured} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(BLOCKS), help=f"comma list from {list(BLOCKS)}")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma list (1f1b is the reference)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="timed steps per run (medians)")
    ns = p.parse_args(argv)
    models, schedules = ns.models.split(","), ns.schedules.split(",")
    for m in models:
        if m not in BLOCKS:
            p.error(f"unknown model {m!r}; choose from {list(BLOCKS)}")
    print(f"# bench_ac: pp={PP}, {ns.microbatches} microbatches, torch {torch.__version__}, Gloo on one "
          f"host, 1 thread per rank; {ns.warmup} warm-up and {ns.reps} timed steps per run", flush=True)
    a = vars(ns) | {"models": models, "schedules": schedules}
    run_local(_bench, PP, (a,), timeout_s=3600, pg_timeout_s=300, threads=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
