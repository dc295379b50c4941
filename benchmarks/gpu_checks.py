"""The Python checks of benchmarks/gpu_quick.sh, one per subcommand; each prints one line
"PASS <check>: ...", "FAIL <check>: ..." or "SKIP <check>: <why>" and exits 0, 1 or 77.

    python benchmarks/gpu_checks.py autocast  [--device cuda|cpu] [--boundaries both|bf16|float32]  # under autocast(bf16)
    python benchmarks/gpu_checks.py sync      [--device cuda]      # set_sync_debug_mode("warn") around a steady zbv step
    python benchmarks/gpu_checks.py nccl      [--device cuda|cpu]  # a world of one: abort, destroy, init again, all-reduce
    python benchmarks/gpu_checks.py memory    [--device cuda|cpu]  # the step's peak memory against the simulated peak
    python benchmarks/gpu_checks.py recovery  [--device cuda|cpu] [--stopped-s 90]  # two ranks: a stopped peer, then the recipe
    python benchmarks/gpu_checks.py bench     [--device cuda|cpu] [--pp 1] [--json PATH]  # zbpipe bench's gaps

--device cpu runs the same logic on the CPU where it has a meaning there (autocast("cpu",
bfloat16), Gloo instead of NCCL, the saved-bytes tracker instead of the CUDA allocator's
peak), so the script is tested without a GPU (tests/tools/test_gpu_quick.py); sync has no CPU
meaning and answers SKIP. --device cuda without a GPU answers SKIP. One GPU suffices for all
but recovery (two) and bench at pp > 1 (one GPU per rank): SKIP with fewer.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import subprocess
import sys
import threading
import time
import warnings

# The installed zbpipe first (CI runs on the wheel, whose source tree has no _C); a development
# tree's own copy only where none is installed.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import zbpipe._C  # noqa: F401
except ImportError:
    sys.path.insert(0, ROOT)
    for name in [m for m in sys.modules if m == "zbpipe" or m.startswith("zbpipe.")]:
        del sys.modules[name]

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zbpipe  # noqa: E402
from zbpipe import _C  # noqa: E402

PASS, FAIL, SKIP = 0, 1, 77
WIDTH = 64


class Outcome(Exception):
    """Ends a check with its status and line."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status, self.text = status, text


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise Outcome(SKIP, f"no CUDA GPU (torch {torch.__version__}, cuda {torch.version.cuda})")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def _stages_modules(n: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(n)]


def _on_own_stream(dev: torch.device):
    return torch.cuda.stream(torch.cuda.Stream(dev)) if dev.type == "cuda" else contextlib.nullcontext()


def _loopback_step(name: str, pp: int, m: int, mods: list[nn.Module], dev: torch.device, x, y,
                   steps: int = 1, around=None) -> dict:
    """`steps` steps of `name` over an in-process loopback world of `pp` ranks (one thread each,
    each on a stream of its own on CUDA), the last inside around() if given; rank -> error."""
    prog = zbpipe.compile(name, pp, m)
    ns = prog.num_stages
    world = _C._LoopbackWorld(pp, store=True)
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(pp)

    def rank_main(r):
        try:
            mine = [s for s in range(ns) if prog.stage_to_rank[s] == r]
            stages = [zbpipe.PipelineStage(mods[s], s, ns, dev, group=world.group(r)) for s in mine]
            sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], m,
                                                    loss_fn=F.mse_loss, timeout=60.0)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            with _on_own_stream(dev):
                for k in range(steps):
                    scope = around(r) if (around is not None and k == steps - 1) else contextlib.nullcontext()
                    with scope:  # every rank's step inside every rank's scope (a process-wide mode)
                        barrier.wait(60)
                        sched.step(*((x,) if 0 in mine else ()), target=y if ns - 1 in mine else None,
                                   return_outputs=False)
                        barrier.wait(60)
                if dev.type == "cuda":
                    torch.cuda.current_stream().synchronize()
        except BaseException as e:  # noqa: BLE001 - reported
            errors[r] = e
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r, t in enumerate(threads):
        if t.is_alive():
            errors[r] = TimeoutError(f"rank {r} still running after 120 s")
    return errors


# ---- autocast -------------------------------------------------------------------------------


class _ToFloat(nn.Module):
    """The stage's output cast back to float32: a boundary whose dtype autocast leaves alone."""

    def forward(self, h):
        return h.float()


def check_autocast(dev: torch.device, boundaries: str = "both") -> str:
    """One step of zbv at pp=1 (two stages on one rank) and of 1f1b at pp=2 (a loopback world),
    inside torch.autocast(device, bfloat16), against the same microbatches in one process
    under the same autocast: gradients equal within bf16's rounding. `boundaries`: "bf16"
    (the stages' outputs as autocast makes them, as users write it), "float32" (each stage
    casts its output back: autocast inside the stages only) or "both"."""
    m = 4
    torch.manual_seed(1)
    x, y = torch.randn(2 * m, WIDTH, device=dev), torch.randn(2 * m, WIDTH, device=dev)
    cast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # noqa: E731
    said, failed = [], []
    kinds = ("bf16", "float32") if boundaries == "both" else (boundaries,)
    for boundary in kinds:
        for name, pp in (("zbv", 1), ("1f1b", 2)):
            what = f"{name} pp={pp} {boundary} boundaries"
            ns = zbpipe.compile(name, pp, m).num_stages
            ref = [(mod if boundary == "bf16" else nn.Sequential(mod, _ToFloat())).to(dev)
                   for mod in _stages_modules(ns)]
            mods, plain = copy.deepcopy(ref), copy.deepcopy(ref)
            for model, scope in ((ref, cast), (plain, contextlib.nullcontext)):
                with scope():
                    for xb, yb in zip(x.chunk(m), y.chunk(m)):  # the pipeline's microbatches, mean loss
                        h = xb
                        for mod in model:
                            h = mod(h)
                        (F.mse_loss(h, yb) / m).backward()
            # What autocast changes in one process: the pipeline must be much closer to it.
            effect = max((p.grad - q.grad).abs().max().item()
                         for a, b in zip(ref, plain) for p, q in zip(a.parameters(), b.parameters()))
            errors = _loopback_step(name, pp, m, mods, dev, x, y, around=lambda r: cast())
            if errors:
                failed.append(f"{what}: " + "; ".join(f"rank {r}: {str(e).splitlines()[0][:240]}"
                                                      for r, e in sorted(errors.items())))
                continue
            if dev.type == "cuda":
                torch.cuda.synchronize()
            worst, missing = 0.0, [pn for a in mods for pn, p in a.named_parameters() if p.grad is None]
            for a, b in zip(mods, ref):
                for p, q in zip(a.parameters(), b.parameters()):
                    if p.grad is not None:
                        worst = max(worst, (p.grad - q.grad).abs().max().item())
            diff = f"max |grad diff| {worst:.2e}, autocast's own effect {effect:.2e}"
            if missing or not (effect > 0 and worst <= 0.1 * effect):
                failed.append(f"{what}: " + (f"no gradient for {missing}" if missing else diff))
            else:
                said.append(f"{what} {diff}")
    head = f"autocast({dev.type}, bfloat16) against one process: "
    if failed:
        raise Outcome(FAIL, head + "; ".join(failed + said))
    return head + ", ".join(said)


# ---- sync debug mode ------------------------------------------------------------------------


def check_sync(dev: torch.device) -> str:
    """torch.cuda.set_sync_debug_mode("warn") around a steady zbv step (the third), at pp=1
    and at pp=2 through the loopback world: no synchronizing CUDA call, so no warning."""
    if dev.type != "cuda":
        raise Outcome(SKIP, "the sync debug mode is CUDA's (run with --device cuda on a GPU)")
    m = 4
    x, y = torch.randn(2 * m, WIDTH, device=dev), torch.randn(2 * m, WIDTH, device=dev)
    said = []
    for pp in (1, 2):
        mods = [mod.to(dev) for mod in _stages_modules(zbpipe.compile("zbv", pp, m).num_stages)]
        caught: list = []

        @contextlib.contextmanager
        def debug(r, caught=caught):
            if r == 0:  # the mode is process-wide; rank 0 sets it for the step
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if r == 0:
                    torch.cuda.set_sync_debug_mode(0)

        with warnings.catch_warnings(record=True) as caught_all:
            warnings.simplefilter("always")
            errors = _loopback_step("zbv", pp, m, mods, dev, x, y, steps=3, around=debug)
        syncs = [str(w.message) for w in caught_all if "synchroniz" in str(w.message).lower()]
        if errors:
            raise Outcome(FAIL, f"zbv pp={pp}: {errors}")
        if syncs:
            raise Outcome(FAIL, f"zbv pp={pp}: {len(syncs)} synchronizing call(s) in a steady step: {syncs[:3]}")
        said.append(f"pp={pp}: 0 warnings")
    return "set_sync_debug_mode('warn') around a steady zbv step: " + ", ".join(said)


# ---- a world of one: abort, destroy, init again ---------------------------------------------

_NCCL_CHILD = r"""
import os, sys, tempfile, datetime, torch, torch.distributed as dist
dev_type = sys.argv[1]
dev = torch.device("cuda", 0) if dev_type == "cuda" else torch.device("cpu")
backend = "nccl" if dev_type == "cuda" else "gloo"
d = tempfile.mkdtemp()
def init(k):
    kw = {"device_id": dev} if dev_type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{d}/store{k}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), **kw)
init(0)
t = torch.ones(4, device=dev); dist.all_reduce(t)
group = dist.distributed_c10d._get_default_group()
if hasattr(group, "abort"):
    group.abort()
    how = "ProcessGroup.abort()"
else:
    dist.distributed_c10d._abort_process_group(group)
    how = "_abort_process_group"
dist.destroy_process_group()
init(1)
t = torch.full((4,), 3.0, device=dev); dist.all_reduce(t)
if dev_type == "cuda":
    torch.cuda.synchronize()
assert t.tolist() == [3.0] * 4, t
dist.destroy_process_group()
print(f"{how}, destroy_process_group, init again: all-reduce {t.tolist()[0]:g} on torch {torch.__version__}")
"""


def check_nccl(dev: torch.device) -> str:
    """In a subprocess (a hang or a crash stays there): a world of one on NCCL (Gloo on the
    CPU), one all-reduce, abort, destroy_process_group, a new world, one all-reduce."""
    try:
        done = subprocess.run([sys.executable, "-c", _NCCL_CHILD, dev.type], capture_output=True, text=True,
                              timeout=90)
    except subprocess.TimeoutExpired:
        raise Outcome(FAIL, "the world of one did not finish in 90 s (a hang in abort or the re-init)") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Outcome(FAIL, f"exit {done.returncode}: {' | '.join(tail)}")
    return f"{'NCCL' if dev.type == 'cuda' else 'Gloo'} world of one: {done.stdout.strip()}"


# ---- peak memory against the simulation -----------------------------------------------------


def check_memory(dev: torch.device) -> str:
    """1f1b and zbv at pp=1 on emulated blocks that each save SAVED bytes per microbatch (the
    boundary is small): the step's peak of allocated memory above what was allocated before
    it (torch.cuda.max_memory_allocated; on the CPU the saved-bytes tracker) against
    simulate(...).peak_memory under the same memory model as zbpipe bench's."""
    from zbpipe.bench.emulated import EmulatedBlock, SavedBytes

    saved_bytes, m = 8 << 20, 8
    x, y = torch.zeros(m, WIDTH, device=dev), torch.zeros(m, WIDTH, device=dev)
    said = []
    for name in ("1f1b", "zbv"):
        prog = zbpipe.compile(name, 1, m)
        ns = prog.num_stages
        mods = [EmulatedBlock(WIDTH, 0.2, 0.2, 0.2, saved_elems=saved_bytes // 4).to(dev) for _ in range(ns)]
        errors = _loopback_step(name, 1, m, mods, dev, x, y, steps=1)  # warm-up: gradients allocated
        if errors:
            raise Outcome(FAIL, f"{name}: {errors}")
        mem_w = [0.0] * ns
        mem_w[0] = float(saved_bytes)  # the first stage's input path runs in W (zbpipe bench's model)
        predicted = zbpipe.simulate(prog, mem_f=[float(saved_bytes)] * ns, mem_w=mem_w).peak_memory[0]
        if dev.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            errors = _loopback_step(name, 1, m, mods, dev, x, y, steps=1)
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated(dev) - before
            slack = 0.05 * predicted + (4 << 20)  # the boundary's and gradients' transients, block rounding
        else:
            with SavedBytes() as tracker:
                errors = _loopback_step(name, 1, m, mods, dev, x, y, steps=1)
            measured, slack = tracker.peak, 0
        if errors:
            raise Outcome(FAIL, f"{name}: {errors}")
        line = f"{name} peak {measured / 2**20:.1f} MiB, simulated {predicted / 2**20:.1f} MiB"
        if not predicted <= measured <= predicted + slack:
            raise Outcome(FAIL, line + f" (allowed {predicted / 2**20:.1f}..{(predicted + slack) / 2**20:.1f})")
        said.append(line)
    what = "max_memory_allocated" if dev.type == "cuda" else "saved-bytes tracker"
    return f"{what} against the simulated peak: " + ", ".join(said)


# ---- a stopped peer, then the recovery recipe -----------------------------------------------


def _recovery_rank(rank: int, size: int, on_world: bool, stopped_s: float) -> dict:
    import torch.distributed as dist

    from zbpipe.launch import rank_device

    dev = rank_device()
    m = 4
    torch.manual_seed(3)
    x, y = torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH)
    ref = _stages_modules(size, seed=5)
    mods = [copy.deepcopy(r).to(dev) for r in ref]
    group = None if on_world else dist.new_group(list(range(size)))
    calls = {"n": 0}
    inner = mods[1].forward

    def stopping(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("this rank stops here")
        return inner(*a, **k)

    if rank == 1:
        mods[1].forward = stopping
    stage = zbpipe.PipelineStage(mods[rank], rank, size, dev, group=group)
    sched = zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, timeout=30.0)
    t0 = time.monotonic()
    try:
        sched.step(*((x.to(dev),) if rank == 0 else ()), target=y.to(dev) if rank == 1 else None)
        failed = "no error"
    except zbpipe.PipelineError as e:
        failed = str(e).splitlines()[0]
    seconds = time.monotonic() - t0
    if rank == 1:
        mods[1].forward = inner
        time.sleep(stopped_s)  # the stopped peer: alive, its communicators aborted, not stepping
    # The recovery recipe (docs/runtime.md#failures): zero the gradients, a new group and schedule.
    for p in mods[rank].parameters():
        p.grad = None
    fresh = dist.new_group(list(range(size)))
    stage = zbpipe.PipelineStage(mods[rank], rank, size, dev, group=fresh)
    sched = zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, timeout=30.0)
    sched.step(*((x.to(dev),) if rank == 0 else ()), target=y.to(dev) if rank == 1 else None)
    h = x
    for r in ref:
        h = r(h)
    F.mse_loss(h, y).backward()
    exact = all(torch.allclose(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
                for p, q in zip(mods[rank].parameters(), ref[rank].parameters()))
    return {"failed": failed, "seconds": seconds, "exact": exact}


def check_recovery(dev: torch.device, stopped_s: float) -> str:
    """Two ranks (NCCL on two GPUs; Gloo on the CPU): rank 1 fails in its second forward and is
    then kept alive `stopped_s` seconds, its communicators aborted; rank 0 must raise within
    seconds (not wait for the watchdog); then both run the recovery recipe and a step on a new
    group, exact against one process. Once with the pipeline on WORLD, once on a new_group."""
    from zbpipe.launch import run_local

    if dev.type == "cuda" and torch.cuda.device_count() < 2:
        raise Outcome(SKIP, f"needs two GPUs (NCCL refuses two ranks on one), {torch.cuda.device_count()} here")
    said = []
    for on_world in (True, False):
        where = "WORLD" if on_world else "a new_group"
        out = run_local(_recovery_rank, 2, (on_world, stopped_s), device=dev.type, timeout_s=stopped_s + 240,
                        pg_timeout_s=stopped_s + 120)
        r0, r1 = out
        if "rank 1 failed" not in r0["failed"] or "this rank stops here" not in r1["failed"]:
            raise Outcome(FAIL, f"on {where}: rank 0 saw {r0['failed']!r}, rank 1 {r1['failed']!r}")
        if r0["seconds"] > 30.0:
            raise Outcome(FAIL, f"on {where}: rank 0 raised after {r0['seconds']:.1f} s (bound 30 s)")
        if not (r0["exact"] and r1["exact"]):
            raise Outcome(FAIL, f"on {where}: the recovered step is not exact (rank 0 {r0['exact']}, 1 {r1['exact']})")
        said.append(f"on {where}: rank 0 raised in {r0['seconds']:.1f} s, recovered exact after {stopped_s:g} s")
    return "stopped peer kept alive, then the recovery recipe: " + "; ".join(said)


# ---- zbpipe bench on the device -------------------------------------------------------------


def check_bench(dev: torch.device, pp: int, json_path: str | None) -> str:
    """zbpipe bench (emulated stages: sleep kernels on CUDA, one rank per GPU) at `pp`: the
    realization gap and the run-queue delay of each schedule; PASS when every gap is finite."""
    import math

    from zbpipe.bench.command import measure
    from zbpipe.bench.config import BenchConfig
    from zbpipe.bench.report import write_json

    if dev.type == "cuda" and torch.cuda.device_count() < pp:
        raise Outcome(SKIP, f"pp={pp} needs {pp} GPUs (one rank per GPU), {torch.cuda.device_count()} here")
    cfg = BenchConfig(pp=pp, microbatches=max(8, 2 * pp), schedules=["1f1b", "zb_h1", "zbv"], device=dev.type,
                      reps=5, warmup=2, timeout_s=240.0).check()
    result = measure(cfg)
    if json_path:
        write_json(json_path, cfg, result)
    cells, bad = [], []
    for r in result["rows"]:
        gap = r.get("gap")
        runq = r.get("runq_fraction")
        cells.append(f"{r['schedule']} gap {gap:.3f}" + (f" (run-queue {runq:.1%})" if runq is not None else "")
                     if gap is not None else f"{r['schedule']} gap n/a")
        if gap is None or not math.isfinite(gap):
            bad.append(r["schedule"])
    if bad:
        raise Outcome(FAIL, f"pp={pp}: no finite gap for {bad}: " + ", ".join(cells))
    return f"zbpipe bench --device {dev.type} --pp {pp}: " + ", ".join(cells)


CHECKS = {"autocast": check_autocast, "sync": check_sync, "nccl": check_nccl, "memory": check_memory,
          "recovery": check_recovery, "bench": check_bench}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--stopped-s", type=float, default=90.0, help="recovery: how long the stopped peer stays alive")
    p.add_argument("--pp", type=int, default=1, help="bench: pipeline ranks (one per GPU)")
    p.add_argument("--json", default=None, help="bench: write its rows there")
    p.add_argument("--boundaries", choices=("both", "bf16", "float32"), default="both",
                   help="autocast: the stages' output dtypes (bf16: as autocast makes them)")
    a = p.parse_args(argv)
    try:
        dev = _device(a.device)
        if a.check == "recovery":
            text = check_recovery(dev, a.stopped_s)
        elif a.check == "bench":
            text = check_bench(dev, a.pp, a.json)
        elif a.check == "autocast":
            text = check_autocast(dev, a.boundaries)
        else:
            text = CHECKS[a.check](dev)
        status = PASS
    except Outcome as o:
        status, text = o.status, o.text
    except Exception as e:  # noqa: BLE001 - a failing check, reported on its line
        status, text = FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    word = {PASS: "PASS", FAIL: "FAIL", SKIP: "SKIP"}[status]
    print(f"{word} {a.check}: {text}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
