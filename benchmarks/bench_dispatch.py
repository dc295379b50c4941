"""Per-step time of zbpipe vs torch.distributed.pipelining on the same stages and schedule.

    PYTHONPATH=. python benchmarks/bench_dispatch.py            # CPU, Gloo, pp=2, 16 microbatches
    PYTHONPATH=. python benchmarks/bench_dispatch.py --device cuda   # NCCL, one GPU per rank
    PYTHONPATH=. python benchmarks/bench_dispatch.py --gloo-devices 1   # a plain one-device Gloo group
    PYTHONPATH=. python benchmarks/bench_dispatch.py --overlap   # DualPipeV, OVERLAP_F_B on vs off
    PYTHONPATH=. python benchmarks/bench_dispatch.py --pp 1 --device cuda --sizes tiny   # one GPU:
        # host overhead of multi-stage schedules on one rank (no communication)

Both libraries run in the same spawned ranks, alternating repetition by repetition, after
warm-up; each cell is the median over repetitions of (time of `--steps` steps) / steps, measured
between barriers on rank 0. Sizes: `tiny` = four nn.Linear(16, 16) layers split over the stages
(host dispatch overhead dominates), `medium` = four nn.Linear(1024, 1024) layers, `block` (not in
the default set) = four pre-norm transformer blocks (d=256, seq 64). Extra columns:
`floor` is the busiest rank's own compute, the same stages' F and full backward over all
microbatches run locally with no communication (what a perfect runtime could approach, bubbles
aside); `1proc` is all four layers and all microbatches in one process; `min` columns are the
best repetition (on a shared, oversubscribed machine Gloo's P2P latency swings by several times
from one repetition to the next, for both libraries: compare medians of the same run only).
`static ms` is zbpipe with static_shapes=True (library `zbpipe-static`): no per-step message
naming the step's input signature; `zb/static` is the per-step cost of being ready to
renegotiate shapes (zbpipe's default). Target: zbpipe/torch <= 0.5.
`--overlap` compares zbpipe with itself instead: DualPipeV on compute-bound stages (`medium`,
`block`) with its OVERLAP_F_B units run overlapped (the backward half on a worker thread while
the forward half runs) and in sequence (`overlap_f_b=False`); `ovl/seq` is the ratio of the
medians. On a CPU the two halves share the rank's cores (torch threads per rank: `--threads`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zbpipe
from zbpipe.bench.worker import all_agree, sync_device
from zbpipe.launch import rank_device, run_local
from zbpipe.train.model import Block, TinyConfig
from zbpipe.train.pipeline import build_pipeline, local_stages, topology, training_schedules

# size -> (one layer, shape of one microbatch)
SIZES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "tiny": (lambda: nn.Linear(16, 16), (4, 16)),
    "medium": (lambda: nn.Linear(1024, 1024), (8, 1024)),
    "block": (lambda: Block(TinyConfig(seq_len=64, d_model=256, n_heads=4)), (2, 64, 256)),
}
LAYERS = 4


def _modules(size: str, num_stages: int, seed: int) -> list[nn.Module]:
    """LAYERS layers of `size` (same init everywhere), grouped evenly into num_stages stages."""
    torch.manual_seed(seed)
    layers = [SIZES[size][0]() for _ in range(LAYERS)]
    per = LAYERS // num_stages
    return [nn.Sequential(*layers[s * per:(s + 1) * per]) for s in range(num_stages)]


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)



def _time_steps(sched, local, params, num_stages, x, y, steps, device) -> float:
    first, last = 0 in local, num_stages - 1 in local
    args = (x,) if first else ()
    tgt = y if last else None
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        for p in params:
            p.grad = None
        sched.step(*args, target=tgt)
    sync_device(device)
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _compute_floor(modules, local, mbs, shape, reps, device) -> float:
    """This rank's stages: F then full backward for every microbatch, no communication."""
    modules = [m.to(device) for m in modules]
    xs = [torch.randn(shape, device=device) for _ in range(mbs)]
    times = []
    for _ in range(reps + 1):
        sync_device(device)
        t0 = time.perf_counter()
        for s in local:
            outs = []
            for x in xs:
                x = x.requires_grad_(s != 0)
                outs.append((x, modules[s](x)))
            for _x, out in outs:
                out.backward(torch.ones_like(out))
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _one_process(size, mbs, reps, device) -> float:
    model = nn.Sequential(*_modules(size, 1, 0)).to(device)
    xs = [torch.randn(SIZES[size][1], device=device) for _ in range(mbs)]
    times = []
    for _ in range(reps + 1):
        sync_device(device)
        t0 = time.perf_counter()
        for x in xs:
            _mse(model(x), x).backward()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# Library variants: "zbpipe:seq" is zbpipe with OVERLAP_F_B units run in sequence.
VARIANTS = {"zbpipe:seq": ("zbpipe", {"overlap_f_b": False}),
            "zbpipe-static": ("zbpipe", {"static_shapes": True})}


def _build(lib, program, size, rank, device):
    """(schedule, local stages, params), or None on every rank if any rank cannot build it."""
    modules = _modules(size, program.num_stages, 0)
    base, kwargs = VARIANTS.get(lib, (lib, None))
    try:
        sched, local = build_pipeline(base, program, modules, rank, device, _mse, schedule_kwargs=kwargs)
        err = None
    except (ValueError, TypeError, AttributeError, NotImplementedError, RuntimeError) as e:
        err = f"{type(e).__name__}: {e}"
    if not all_agree(err is None, device):
        if rank == 0:
            print(f"# {program.schedule} {lib}: n/a ({err or 'failed on another rank'})", flush=True)
        return None
    return sched, local, [p for s in local for p in modules[s].parameters()]


def _bench(rank: int, world: int, a: dict) -> None:
    device = rank_device()
    mbs, reps = a["microbatches"], a["reps"]
    for size in a["sizes"]:
        shape = SIZES[size][1]
        batch = (shape[0] * mbs, *shape[1:])
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, generator=g).to(device)
        y = torch.randn(batch, generator=g).to(device)
        one_proc = _one_process(size, mbs, reps, device) if rank == 0 and not a["overlap"] else 0.0
        for schedule in a["schedules"]:
            try:  # the same answer on every rank
                program = topology(schedule, world, mbs)
            except zbpipe.ScheduleError as e:
                if rank == 0:
                    print(f"# {schedule}: n/a ({e})", flush=True)
                continue
            num_stages = program.num_stages
            runs = {}
            for lib in a["libs"]:
                run = _build(lib, program, size, rank, device)
                if run is not None:
                    runs[lib] = run
                    for _ in range(a["warmup"]):
                        _time_steps(*run, num_stages, x, y, 1, device)
            times: dict[str, list[float]] = {lib: [] for lib in runs}
            for _ in range(reps):  # alternate libraries so drift on a shared machine hits both
                for lib, run in runs.items():
                    times[lib].append(_time_steps(*run, num_stages, x, y, a["steps"], device))
            local = local_stages(program, rank)
            floor = _compute_floor(_modules(size, num_stages, 0), local, mbs, shape, reps, device)
            floor_t = torch.tensor([floor], device=device)
            dist.all_reduce(floor_t, op=dist.ReduceOp.MAX)
            med = {lib: statistics.median(t) for lib, t in times.items()}
            best = {lib: min(t) for lib, t in times.items()}
            if rank == 0 and a["overlap"]:
                _print_overlap_row(size, schedule, med.get("zbpipe:seq"), med.get("zbpipe"), float(floor_t),
                                   med.get("torch"), best.get("zbpipe:seq"), best.get("zbpipe"))
                if "zbpipe" in runs:
                    print(_trace_overlap(runs["zbpipe"][0].trace()), flush=True)
            elif rank == 0:
                _print_row(size, schedule, med.get("torch"), med.get("zbpipe"), float(floor_t), one_proc,
                           best.get("torch"), best.get("zbpipe"), med.get("zbpipe-static"))


def _ms(t: float | None) -> str:
    return f"{t * 1e3:9.2f}" if t is not None else f"{'n/a':>9}"


def _print_row(size, schedule, torch_t, zb_t, floor, one_proc, torch_min, zb_min, static_t) -> None:
    ratio = f"{zb_t / torch_t:8.2f}" if torch_t and zb_t else f"{'n/a':>8}"
    dyn = f"{zb_t / static_t:9.3f}" if static_t and zb_t else f"{'n/a':>9}"
    print(f"{size:<7} {schedule:<17} {_ms(torch_t)} {_ms(zb_t)} {ratio} {_ms(floor)} {_ms(one_proc)}"
          f" {_ms(torch_min)} {_ms(zb_min)} {_ms(static_t)} {dyn}", flush=True)


def _trace_overlap(trace: list[dict]) -> str:
    """Rank 0's last step: how much of each unit's backward half (the worker's record) overlaps
    the forward half recorded at the same program index."""
    units, overlap, backward = 0, 0.0, 0.0
    for b in (r for r in trace if r.get("worker")):
        f = next((r for r in trace if r["index"] == b["index"] and not r.get("worker")), None)
        if f is None:
            continue
        units += 1
        backward += (b["host_end_ns"] - b["host_start_ns"]) / 1e6
        overlap += max(0, min(f["host_end_ns"], b["host_end_ns"]) - max(f["host_start_ns"], b["host_start_ns"])) / 1e6
    return (f"#   trace, rank 0, last step: {units} OVERLAP_F_B units, forward and backward halves "
            f"overlapped {overlap:.1f} ms of the backward halves' {backward:.1f} ms")


def _print_overlap_row(size, schedule, seq_t, ov_t, floor, torch_t, seq_min, ov_min) -> None:
    ratio = f"{ov_t / seq_t:8.2f}" if seq_t and ov_t else f"{'n/a':>8}"
    print(f"{size:<7} {schedule:<17} {_ms(seq_t)} {_ms(ov_t)} {ratio} {_ms(floor)} {_ms(torch_t)}"
          f" {_ms(seq_min)} {_ms(ov_min)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zbv,dualpipev,zb_h1",
                   help=f"comma list from {sorted(training_schedules())}")
    p.add_argument("--sizes", default="tiny,medium", help=f"comma list from {sorted(SIZES)}")
    p.add_argument("--libs", default="torch,zbpipe,zbpipe-static",
                   help="torch, zbpipe, zbpipe-static (zbpipe with static_shapes=True)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per library and row")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
    p.add_argument("--steps", type=int, default=5, help="steps per repetition")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--gloo-devices", type=int, default=2,
                   help="Gloo devices (connections + transport threads) on loopback; both libraries "
                        "share the group, zbpipe routes each direction of a rank pair through its own")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--overlap", action="store_true",
                   help="DualPipeV with OVERLAP_F_B overlapped vs in sequence (zbpipe only, plus torch)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ns = p.parse_args(argv)
    if ns.overlap:
        defaults = {"schedules": "gpipe,1f1b,interleaved_1f1b,zbv,dualpipev,zb_h1", "sizes": "tiny,medium",
                    "libs": "torch,zbpipe,zbpipe-static"}
        if ns.schedules == defaults["schedules"]:
            ns.schedules = "dualpipev"
        if ns.sizes == defaults["sizes"]:
            ns.sizes = "medium,block"
        if ns.libs == defaults["libs"]:
            ns.libs = "zbpipe:seq,zbpipe,torch"
    a = vars(ns) | {k: getattr(ns, k).split(",") for k in ("schedules", "sizes", "libs")}
    unknown = sorted(set(a["schedules"]) - set(training_schedules()))
    if unknown:
        p.error(f"unknown schedules {unknown}; choose from {sorted(training_schedules())}")
    if ns.device == "cuda" and torch.cuda.device_count() < ns.pp:
        p.error(f"--device cuda needs {ns.pp} GPUs, found {torch.cuda.device_count()}")
    backend = "NCCL" if ns.device == "cuda" else "Gloo"
    if ns.device == "cpu":
        backend += f" ({ns.gloo_devices} device{'s' if ns.gloo_devices > 1 else ''})"
    print(f"# bench_dispatch: pp={ns.pp} microbatches={ns.microbatches} {backend} on {ns.device}, "
          f"torch {torch.__version__}; median of {ns.reps} reps x {ns.steps} steps after {ns.warmup} warm-up")
    if ns.overlap:
        print(f"{'size':<7} {'schedule':<17} {'seq ms':>9} {'ovl ms':>9} {'ovl/seq':>8} "
              f"{'floor ms':>9} {'torch ms':>9} {'seq min':>9} {'ovl min':>9}", flush=True)
    else:
        print(f"{'size':<7} {'schedule':<17} {'torch ms':>9} {'zbpipe ms':>9} {'zb/torch':>8} "
              f"{'floor ms':>9} {'1proc ms':>9} {'torch min':>9} {'zb min':>9} {'static ms':>9} {'zb/static':>9}",
              flush=True)
    run_local(_bench, ns.pp, (a,), device=ns.device, timeout_s=ns.timeout, pg_timeout_s=300,
              gloo_devices=ns.gloo_devices, threads=ns.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
