"""What activation checkpointing adds to a split stage's I and W against a full backward B, one
stage in one process, with glibc's default malloc and with the runtime's host-memory policy
(csrc/runtime/host_memory.h; issue #21):

    PYTHONPATH=. python benchmarks/bench_ac_alloc.py
    PYTHONPATH=. python benchmarks/bench_ac_alloc.py --blocks 4 --reps 30

A stage of `--blocks` blocks `x + checkpoint(mlp, x, use_reentrant=False)` (bench_ac's mlp:
Linear(512, 2048) -> GELU -> Linear(2048, 512), microbatches of 64 rows, one thread), its
forward in a stage's training-forward context; per microbatch either B, or I then the previous
microbatch's W (ZB-H1's order on its last stage). The four settings (B or I+W, with or without
AC) alternate microbatch by microbatch. Each setting runs in two child processes: one where a
1-rank CPU executor has run a step first (the policy in force), one with
ZBPIPE_KEEP_HOST_MEMORY=0 (glibc as it is). Printed per action: the medians of the thread's CPU
ms, of its system (kernel) ms -- page faults, zeroing fresh pages -- and `+AC`, the action's
CPU ms with AC less without. The split pays nothing for AC beyond B when `I+W +AC` is no more
than `B +AC`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, statistics, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
import zbpipe
from zbpipe import _C
from zbpipe.checkpointing import recompute_once

blocks, reps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
one = zbpipe.PipelineStage(nn.Linear(8, 8), 0, 1, "cpu")  # a CPU executor: the policy, unless opted out
zbpipe.Schedule1F1B(one, 2, loss_fn=F.mse_loss).step(torch.randn(4, 8), target=torch.randn(4, 8))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ac = False
        self.mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))

    def forward(self, x):
        return x + (checkpoint(self.mlp, x, use_reentrant=False) if self.ac else self.mlp(x))


torch.manual_seed(0)
stage = nn.Sequential(*[Block() for _ in range(blocks)])
g = torch.randn(64, 512)
cpu, sys_ms = {}, {}
pending = {}


def clocks():
    u = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time() * 1e3, u.ru_stime * 1e3


def timed(key, fn):
    c0, s0 = clocks()
    out = fn()
    c1, s1 = clocks()
    cpu.setdefault(key, []).append(c1 - c0)
    sys_ms.setdefault(key, []).append(s1 - s0)
    return out


def microbatch(ac, split):
    for b in stage:
        b.ac = ac
    x = torch.randn(64, 512, requires_grad=True)
    with recompute_once():
        out = stage(x)
    if not split:
        timed((ac, "B"), lambda: _C.backward_full([out], [g], [x]))
        return
    (_dx,), work = timed((ac, "I"), lambda: _C.backward_input([out], [g], [x]))
    del out
    if (ac, split) in pending:
        w = pending.pop((ac, split))
        timed((ac, "W"), lambda: _C.backward_weight(w))
    pending[(ac, split)] = work


settings = [(ac, split) for ac in (False, True) for split in (False, True)]
for _ in range(3):
    for s in settings:
        microbatch(*s)
cpu.clear(); sys_ms.clear()
for _ in range(reps):
    for s in settings:
        microbatch(*s)
med = {f"{int(ac)}{k}": [statistics.median(cpu[ac, k]), statistics.median(sys_ms[ac, k])] for ac, k in cpu}
print(json.dumps(med))
dist.destroy_process_group()
"""


def run(blocks: int, reps: int, keep: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["ZBPIPE_KEEP_HOST_MEMORY"] = "1" if keep else "0"
    out = subprocess.run([sys.executable, "-c", CHILD, str(blocks), str(reps)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2, help="checkpointed blocks in the stage")
    p.add_argument("--reps", type=int, default=30, help="timed microbatches per setting")
    a = p.parse_args(argv)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"# bench_ac_alloc: {a.blocks} blocks, {a.reps} microbatches per setting, 1 thread, "
          f"load average {load}\n")
    print("| malloc | action | CPU ms | sys ms | CPU ms with AC | sys ms with AC | +AC ms |")
    print("|---|---|---|---|---|---|---|")
    for keep in (False, True):
        m = run(a.blocks, a.reps, keep)
        name = "runtime policy" if keep else "glibc default"
        for k in ("B", "I", "W"):
            (c0, s0), (c1, s1) = m[f"0{k}"], m[f"1{k}"]
            print(f"| {name} | {k} | {c0:.2f} | {s0:.2f} | {c1:.2f} | {s1:.2f} | {c1 - c0:+.2f} |")
        iw = (m["1I"][0] + m["1W"][0]) - (m["0I"][0] + m["0W"][0])
        print(f"| {name} | I+W | {m['0I'][0] + m['0W'][0]:.2f} | | {m['1I'][0] + m['1W'][0]:.2f} | "
              f"| {iw:+.2f} (B: {m['1B'][0] - m['0B'][0]:+.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
