"""Host overhead per action: one rank, no communication, every training schedule against the
same forwards and backwards run in a plain Python loop.

    PYTHONPATH=. python benchmarks/bench_host_overhead.py                  # 32 microbatches
    PYTHONPATH=. python benchmarks/bench_host_overhead.py --torch          # + torch.distributed.pipelining

One spawned rank (a Gloo group of one, torch.set_num_threads(1)) holds every stage of each
schedule's pp=1 program; each stage is one nn.Linear(16, 16) on 4-row microbatches, so the
compute is tiny and the step time is host work. `loop` runs, for every microbatch, each stage's
forward (detached hand-off between stages), the MSE loss, and each stage's full backward in
reverse order with `.backward()` (what the schedule computes, with no schedule); `engine`
runs the same forwards and the backward calls the executor makes (B, or I for every stage and
then W, through zbpipe._C, one analysis cache per stage) from Python. `us/act` is
(step - loop) / compute actions of the program (F, B, I, W; an OVERLAP_F_B counts its parts),
and the same against `engine`: the executor's dispatch and hand-offs (and, against `loop`, the
split-backward analysis and the second engine run of I/W schedules) land there. `--torch`
adds torch.distributed.pipelining's schedules at world size 1 where it has them (`torch us/act`
is against the same loop). Each cell is the median over repetitions of (time of `--steps`
steps) / steps; the loop and the peers are timed in the same repetitions. Goal (issue #8):
every schedule within 5 us per action of the loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from zbpipe.launch import run_local

ROWS, WIDTH = 4, 16


def _modules(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(num_stages)]


def _forwards(mods, x):
    """Each stage's forward on a detached copy of the previous stage's output (the executor's
    hand-off): (stage outputs, stage inputs)."""
    outs, ins = [], []
    h = x
    for s, m in enumerate(mods):
        h_in = h.detach().requires_grad_(s > 0)
        ins.append(h_in)
        h = m(h_in)
        outs.append(h)
    return outs, ins


def _plain_loop(mods, xs, ys, n):
    for x, y in zip(xs, ys):
        outs, ins = _forwards(mods, x)
        (F.mse_loss(outs[-1], y) / n).backward()
        grad = ins[-1].grad
        for s in range(len(mods) - 2, -1, -1):
            outs[s].backward(grad)
            grad = ins[s].grad


def _engine_loop(mods, xs, ys, n, split, caches):
    """The same forwards, and the backward calls the executor makes (B, or I then W, through
    zbpipe._C with a per-stage analysis cache), issued from Python."""
    from zbpipe import _C

    works = []
    for x, y in zip(xs, ys):
        outs, ins = _forwards(mods, x)
        roots = [F.mse_loss(outs[-1], y)]
        grads = [torch.full_like(roots[0], 1.0 / n)]
        for s in range(len(mods) - 1, -1, -1):
            if split:
                (g,), w = _C.backward_input(roots, grads, [ins[s]], caches[s])
                works.append(w)
            else:
                (g,) = _C.backward_full(roots, grads, [ins[s]])
            roots, grads = [outs[s - 1]], [g]
    for w in works:
        _C.backward_weight(w)


def _zero(mods):
    for m in mods:
        for p in m.parameters():
            p.grad = None


def _bench(rank: int, world: int, a: dict) -> None:
    import zbpipe
    from zbpipe.train.pipeline import schedule_class, torch_schedules

    in_torch = set(torch_schedules())

    n = a["microbatches"]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS * n, WIDTH, generator=g), torch.randn(ROWS * n, WIDTH, generator=g)
    xs, ys = list(x.split(ROWS)), list(y.split(ROWS))
    cols = ["schedule", "actions", "loop ms", "engine ms", "step ms", "us/act vs loop", "us/act vs engine"]
    cols += ["torch ms", "torch us/act vs loop"] if a["torch"] else []
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
    for name in a["schedules"]:
        prog = zbpipe.compile(name, 1, n)
        acts = sum(len(s.split(";")) for s in prog.compute_actions(0))
        mods = _modules(prog.num_stages)
        loop_mods = _modules(prog.num_stages)
        stages = [zbpipe.PipelineStage(m, s, prog.num_stages, "cpu") for s, m in enumerate(mods)]
        sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], n,
                                               loss_fn=F.mse_loss)
        eng_mods = _modules(prog.num_stages)
        split = any("I" in c for c in prog.compute_actions(0))
        caches = [zbpipe._C.SplitPlanCache() for _ in eng_mods]
        tmods: list[nn.Module] = []
        runs = {"zb": lambda: sched.step(x, target=y), "loop": lambda: _plain_loop(loop_mods, xs, ys, n),
                "engine": lambda: _engine_loop(eng_mods, xs, ys, n, split, caches)}
        if a["torch"] and name in in_torch:
            try:
                import torch.distributed.pipelining as tp

                cls = schedule_class("torch", name)
                tmods = _modules(prog.num_stages)
                tst = [tp.PipelineStage(m, s, prog.num_stages, "cpu") for s, m in enumerate(tmods)]
                tsched = cls(tst if len(tst) > 1 else tst[0], n, loss_fn=F.mse_loss)
                tsched.step(x, target=y)
                runs["torch"] = lambda: tsched.step(x, target=y)
            except Exception as e:  # noqa: BLE001 - reported, the row goes on
                print(f"# {name} torch: n/a ({type(e).__name__}: {str(e)[:80]})", flush=True)
        all_mods = {"zb": mods, "loop": loop_mods, "engine": eng_mods, "torch": tmods}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for rep in range(a["warmup"] + a["reps"]):
            for k, fn in runs.items():
                t0 = time.perf_counter()
                for _ in range(a["steps"]):
                    _zero(all_mods[k])
                    fn()
                dt = (time.perf_counter() - t0) / a["steps"]
                if rep >= a["warmup"]:
                    times[k].append(dt)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [name, str(acts), f"{med['loop'] * 1e3:.2f}", f"{med['engine'] * 1e3:.2f}", f"{med['zb'] * 1e3:.2f}",
                 f"{(med['zb'] - med['loop']) / acts * 1e6:.1f}", f"{(med['zb'] - med['engine']) / acts * 1e6:.1f}"]
        if a["torch"]:
            cells += ([f"{med['torch'] * 1e3:.2f}", f"{(med['torch'] - med['loop']) / acts * 1e6:.1f}"]
                      if "torch" in med else ["n/a", "n/a"])
        row = "| " + " | ".join(cells) + " |"
        print(row, flush=True)


def main(argv: list[str] | None = None) -> int:
    import zbpipe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--schedules", default=",".join(s for s in zbpipe.schedule_names() if s != "inference"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--torch", action="store_true", help="also time torch.distributed.pipelining")
    ns = p.parse_args(argv)
    a = vars(ns) | {"schedules": ns.schedules.split(",")}
    print(f"# bench_host_overhead: 1 rank, {ns.microbatches} microbatches of {ROWS}x{WIDTH}, one "
          f"nn.Linear({WIDTH}, {WIDTH}) per stage, torch {torch.__version__}; median of {ns.reps} "
          f"reps x {ns.steps} steps after {ns.warmup} warm-up")
    run_local(_bench, 1, (a,), timeout_s=1800)
    return 0


if __name__ == "__main__":
    sys.exit(main())
