"""How long a failure on one rank takes to reach the others (zbpipe's failure propagation).

    PYTHONPATH=. python benchmarks/bench_failure.py                 # pp=2 and pp=4, Gloo, CPU
    PYTHONPATH=. python benchmarks/bench_failure.py --pp 4 --reps 20

Each repetition builds a fresh group and a 1F1B schedule (wait timeout `--timeout`, 60 s: what
a peer would wait without propagation), runs one good step, then rank 0's stage raises in the
forward of microbatch 2 of the second step while its peers wait for messages from it. The
latency of rank r is the wall-clock time (one machine, one clock) from the raise on rank 0 to
rank r catching zbpipe.PipelineError that names rank 0's failure. Median, min and max over
repetitions per rank; the ratio column is the median over the timeout the peer would have waited.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpipe.launch import run_local


class _FailingStage(nn.Module):
    def __init__(self, fail_at: int | None):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls, self.fail_at, self.failed_at = 0, fail_at, None

    def forward(self, x):
        self.calls += torch.is_grad_enabled()
        if self.calls == self.fail_at:
            self.failed_at = time.time()
            raise RuntimeError("injected failure")
        return self.lin(x)


def _bench(rank: int, world: int, a: dict) -> None:
    import zbpipe

    n = 4
    lat: list[float] = []
    for _ in range(a["reps"]):
        group = dist.new_group(list(range(world)))
        mod = _FailingStage(n + 3 if rank == 0 else None)  # step 2, microbatch 2
        stage = zbpipe.PipelineStage(mod, rank, world, "cpu", group=group)
        sched = zbpipe.Schedule1F1B(stage, n, loss_fn=F.mse_loss, timeout=a["timeout"])
        x, y = torch.randn(4 * n, 16), torch.randn(4 * n, 16)
        seen = None
        for _step in range(2):
            try:
                sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
            except zbpipe.PipelineError as e:
                seen = time.time()
                if rank != 0 and "rank 0 failed in stage 0 at action 0F2" not in str(e):
                    raise RuntimeError(f"rank {rank}: the error does not name rank 0's failure:\n{e}") from e
                break
        t = torch.tensor([mod.failed_at or 0.0, seen or 0.0], dtype=torch.float64)
        dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)  # rank 0's raise time, to everyone
        lat.append(t[1].item() - t[0].item())
        dist.barrier()
    out = [None] * world
    dist.all_gather_object(out, lat)
    if rank == 0:
        for r in range(1, world):
            med = statistics.median(out[r])
            print(f"{world:>3} {r:>5} {med * 1e3:10.1f} {min(out[r]) * 1e3:9.1f} {max(out[r]) * 1e3:9.1f}"
                  f" {a['timeout']:10.0f} {med / a['timeout']:10.5f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", default="2,4", help="comma list of pipeline sizes")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=60.0, help="the schedules' wait timeout (s)")
    ns = p.parse_args(argv)
    a = vars(ns)
    print(f"# bench_failure: 1F1B, rank 0 raises in step 2; {ns.reps} reps; torch {torch.__version__}")
    print(f"{'pp':>3} {'rank':>5} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'timeout s':>10} {'med/tmo':>10}",
          flush=True)
    for pp in (int(v) for v in ns.pp.split(",")):
        run_local(_bench, pp, (a,), timeout_s=600, pg_timeout_s=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
