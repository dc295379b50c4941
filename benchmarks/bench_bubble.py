"""Is the bubble really removed? Measured step time of 1F1B and the zero-bubble schedules on
compute-bound stages, against zbpipe.simulate fed with the F, B, I and W costs measured from
the executor's own trace.

    PYTHONPATH=. python benchmarks/bench_bubble.py                   # one thread per rank
    PYTHONPATH=. python benchmarks/bench_bubble.py --threads 2 --models linear --reps 2   # 2-core distortion

pp=2, two spawned ranks on one host joined by Gloo (zbpipe.launch, two loopback
devices), 8 microbatches of 64 rows, fp32 CPU. Models (benchmarks/_split_models.py), per rank:
`linear` = four nn.Linear(1024, 1024) (1F1B/ZB-H1/ZB-H2/zb_auto: one stage of four per rank;
ZBV: two stages of two), `block` = two transformer encoder blocks (attention + MLP, d=512;
one stage of two, or two stages of one).

For every schedule, over the timed steps: `step ms` is the median wall time of a step on rank
0 between barriers; `span ms` the median of the executor's makespan from the traces (first
action start to last action end over both ranks, one host clock); `predicted ms` is
zbpipe.simulate's makespan for that schedule's program fed, step by step, with that step's
per-stage means of F, B, I and W host time from the trace (receive waits excluded) and the
measured one-way latency of a Gloo send of one activation (`comm`), median over the steps;
`span/pred` is the median of the per-step ratios (checks the simulator: what it does not
model, host time outside compute actions and the cores' contention, shows there),
`step/1f1b` compares the schedules. The cost lines are the means over all timed steps.
zb_auto is compiled with the costs measured in zb_h1's warm-up steps (both ranks agree on
them). The schedules alternate step by step, so drift on a shared machine hits all of them.
Goal (issue #8): the zero-bubble schedules' step below 1F1B's and within 10% of prediction.

The 2-core distortion. Both ranks run on one 2-core host, shared with other work. With
`--threads 2` (torch's default there) each rank runs two OpenMP intra-op threads, four on two
cores: every action slows by several times (threads waiting at OpenMP barriers hold cores the
other rank's threads need), and most while the other rank computes too. Per-action costs then
depend on how much of the time both ranks are busy, which is what a zero-bubble schedule
raises: filling the bubbles slows every action, so 1F1B's bubbles cost less than on separate
devices and the zero-bubble schedules lose to it. With `--threads 1` (the default) each rank
gets about one core, closer to one device per rank; what is left is Gloo's transport
threads, the host work and other processes competing for the same two cores, and the memory
bandwidth both ranks share (W's accumulation into .grad reads and writes a weight-sized tensor
per microbatch, memory-bound work the ranks contend on). The per-step prediction absorbs
drift in the costs; the step times across schedules do not: numbers from a shared machine are
noisy, compare within one run.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _split_models import MODELS
from zbpipe.bench.worker import measure_hop
from zbpipe.launch import run_local

PP = 2
SCHEDULES = ("1f1b", "zb_h1", "zb_h2", "zbv", "zb_auto")
LAYERS = {"linear": 4, "block": 2}  # per rank
KINDS = "FBIW"


def _unit(model: str) -> nn.Module:
    return nn.Linear(1024, 1024) if model == "linear" else MODELS["block"][0]()


def _stage_modules(model: str, num_stages: int) -> list[nn.Module]:
    """The model's PP * LAYERS[model] layers (one seed), grouped evenly into num_stages stages."""
    torch.manual_seed(0)
    layers = [_unit(model) for _ in range(PP * LAYERS[model])]
    per = len(layers) // num_stages
    return [nn.Sequential(*layers[s * per:(s + 1) * per]) for s in range(num_stages)]


def _comm_ms(rank: int, world: int, shape) -> float:
    """One-way Gloo latency of one float32 activation of `shape` (zbpipe bench's ping-pong), the
    same value on every rank (zb_auto's program must agree)."""
    return measure_hop(rank, world, 4 * math.prod(shape), torch.device("cpu"))["hop_s"] * 1e3


def _costs(trace, num_stages: int) -> list:
    """This rank's compute durations (ms) of one step, receive waits excluded: [kind][stage]
    lists of samples (kinds F, B, I, W)."""
    out = [[[] for _ in range(num_stages)] for _ in KINDS]
    for r in trace:
        hit = re.fullmatch(r"(\d+)([FBIW])\d+", r["action"])
        if hit:
            ms = (r["host_end_ns"] - r["host_start_ns"] - r["wait_ns"]) / 1e6
            out[KINDS.index(hit[2])][int(hit[1])].append(ms)
    return out


def _agree(local: list, num_stages: int) -> list[list[float]]:
    """Per-stage means over this step's (or steps') samples of both ranks: [kind][stage], 0
    where never run. Means, not medians: a step's time is a sum of action times."""
    t = torch.tensor([[statistics.fmean(v) if v else 0.0 for v in kind] for kind in local], dtype=torch.float64)
    dist.all_reduce(t)  # each stage lives on one rank: the other contributes zeros
    return t.tolist()


def _predict(prog, cost, comm: float) -> float:
    import zbpipe

    f, b_full, i, w = cost
    if any(w):
        return zbpipe.simulate(prog, f=f, b=i, w=w, comm=comm).makespan
    return zbpipe.simulate(prog, f=f, b=b_full, w=0.0, b_full=b_full, comm=comm).makespan  # B only


class _Run:
    """One schedule on this rank's stages, with the per-step samples of its timed steps."""

    def __init__(self, name, model, rank, a, comm: float, compile_costs=None):
        import zbpipe

        self.name, self.m, self.comm = name, a["microbatches"], comm
        opts = dict(zip("fbw", compile_costs), comm=comm) if compile_costs else {}
        self.prog = zbpipe.compile(name, PP, self.m, **opts)
        self.num_stages = self.prog.num_stages
        self.mods = _stage_modules(model, self.num_stages)
        self.mine = [s for s in range(self.num_stages) if self.prog.stage_to_rank[s] == rank]
        stages = [zbpipe.PipelineStage(self.mods[s], s, self.num_stages, "cpu") for s in self.mine]
        self.sched = zbpipe.get_schedule_class(name)(
            stages if len(stages) > 1 else stages[0], self.m, loss_fn=F.mse_loss,
            **({"compile_options": opts} if opts else {}))
        shape = MODELS[model][1]
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn((shape[0] * self.m, *shape[1:]), generator=g)
        self.y = torch.randn(self.x.shape, generator=g)
        self.samples = [[[] for _ in range(self.num_stages)] for _ in KINDS]
        self.walls: list[float] = []
        self.spans: list[float] = []
        self.preds: list[float] = []  # each timed step's prediction from its own costs

    def step(self, timed: bool) -> None:
        for m in self.mods:
            for p in m.parameters():
                p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        self.sched.step(*((self.x,) if 0 in self.mine else ()),
                        target=self.y if self.num_stages - 1 in self.mine else None)
        dist.barrier()
        wall = time.perf_counter() - t0
        tr = self.sched.trace()
        step_samples = _costs(tr, self.num_stages)
        for kind, per_stage in zip(self.samples, step_samples):
            for s, v in enumerate(per_stage):
                kind[s].extend(v)
        if not timed:
            return
        ends = torch.tensor([-min(r["host_start_ns"] for r in tr), max(r["host_end_ns"] for r in tr)],
                            dtype=torch.float64)
        dist.all_reduce(ends, op=dist.ReduceOp.MAX)
        self.spans.append((ends[1] + ends[0]).item() / 1e6)
        self.walls.append(wall * 1e3)
        self.preds.append(_predict(self.prog, _agree(step_samples, self.num_stages), self.comm))

    def reset_costs(self) -> None:
        self.samples = [[[] for _ in range(self.num_stages)] for _ in KINDS]

    def result(self) -> dict:
        return {"step": statistics.median(self.walls), "span": statistics.median(self.spans),
                "pred": statistics.median(self.preds),
                "ratio": statistics.median(s / p for s, p in zip(self.spans, self.preds)),
                "cost": _agree(self.samples, self.num_stages)}


def _bench(rank: int, world: int, a: dict) -> None:
    for model in a["models"]:
        comm = _comm_ms(rank, world, MODELS[model][1])
        runs = {n: _Run(n, model, rank, a, comm) for n in a["schedules"] if n != "zb_auto"}
        for _ in range(a["warmup"]):
            for r in runs.values():
                r.step(timed=False)
        if "zb_auto" in a["schedules"]:  # compiled with the costs zb_h1's warm-up measured
            f, _, i, w = _agree(runs["zb_h1"].samples, 2)
            runs["zb_auto"] = _Run("zb_auto", model, rank, a, comm, (f, i, w))
            for _ in range(a["warmup"]):
                runs["zb_auto"].step(timed=False)
        for r in runs.values():
            r.reset_costs()
        for _ in range(a["reps"]):  # alternating, so drift on a shared machine hits every schedule
            for name in a["schedules"]:
                runs[name].step(timed=True)
        rows = {name: runs[name].result() for name in a["schedules"]}
        if rank != 0:
            continue
        base = rows.get("1f1b", {}).get("step")
        print(f"\n**{model}**, {a['threads']} thread(s) per rank, comm {comm:.2f} ms; per-stage F/B/I/W ms "
              "(means from the trace):\n")
        for name, r in rows.items():
            costs = "; ".join(f"{k} " + "/".join(f"{v:.1f}" for v in r["cost"][j])
                              for j, k in enumerate(KINDS) if any(r["cost"][j]))
            print(f"- {name}: {costs}")
        print("\n| schedule | step ms | span ms | predicted ms | span/pred | step/1f1b |")
        print("|---|---|---|---|---|---|")
        for name, r in rows.items():
            rel = f"{r['step'] / base:.2f}" if base else "n/a"
            print(f"| {name} | {r['step']:.1f} | {r['span']:.1f} | {r['pred']:.1f} | {r['ratio']:.2f} "
                  f"| {rel} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="linear,block", help=f"comma list from {list(LAYERS)}")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma list (zb_auto needs zb_h1)")
    p.add_argument("--threads", default="1", help="torch.set_num_threads per rank, one run each (comma list)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="timed steps per schedule (medians)")
    ns = p.parse_args(argv)
    models, schedules = ns.models.split(","), ns.schedules.split(",")
    if "zb_auto" in schedules and "zb_h1" not in schedules:
        p.error("zb_auto is compiled with the costs measured in the zb_h1 run: list zb_h1 too")
    for m in models:
        if m not in LAYERS:
            p.error(f"unknown model {m!r}; choose from {list(LAYERS)}")
    print(f"# bench_bubble: pp={PP}, {ns.microbatches} microbatches, torch {torch.__version__}, Gloo on one "
          f"host; {ns.warmup} warm-up and {ns.reps} timed steps per schedule", flush=True)
    for threads in (int(t) for t in ns.threads.split(",")):
        a = vars(ns) | {"models": models, "schedules": schedules, "threads": threads}
        run_local(_bench, PP, (a,), timeout_s=1800, pg_timeout_s=300, threads=threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
