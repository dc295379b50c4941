"""What zbpipe's control plane asks of the job's one shared store.

    PYTHONPATH=. python benchmarks/bench_control_plane.py training            # requests per rank per step
    PYTHONPATH=. python benchmarks/bench_control_plane.py training --window 8 --rate 5

`training`: steady 1F1B training on Gloo (CPU), one pipeline of 4 ranks and pp=2 x dp=2 with
DDP stages, against a TCPStore server in a process of its own (benchmarks/store_server.py
counts the requests it serves from its own per-request log). After warm-up steps the ranks run
`--window` seconds of steps at full speed and at `--rate` steps per second, zbpipe's schedule
and torch.distributed.pipelining's on the same stages and groups in the same run (torch's is the
0 baseline: it puts nothing on the store after setup). Printed: store requests per rank per
step and per rank per second, by operation.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from store_server import StoreServer, mark, settle  # noqa: E402

WIDTH, MICROBATCHES = 64, 4
SETUPS = {"pipeline of 4": (4, 1), "pp=2 x dp=2, DDP": (2, 2)}


def _schedule(engine: str, rank: int, pp: int, dp: int, pp_group, dp_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    stage_index = rank % pp
    module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    if dp > 1:
        module = DDP(module, process_group=dp_group)
    if engine == "zbpipe":
        import zbpipe

        stage = zbpipe.PipelineStage(module, stage_index, pp, "cpu", group=pp_group)
        return zbpipe.Schedule1F1B(stage, MICROBATCHES, loss_fn=F.mse_loss, timeout=60)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(module, stage_index, pp, torch.device("cpu"), group=pp_group)
    return Schedule1F1B(stage, MICROBATCHES, loss_fn=F.mse_loss)


def _training_rank(rank: int, world: int, port: int, pp: int, dp: int, window: float, rate: float, out) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    pp_groups = [dist.new_group([d * pp + p for p in range(pp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * pp + p for d in range(dp)]) for p in range(pp)]
    pp_group, dp_group = pp_groups[rank // pp], dp_groups[rank % pp]
    x, y = torch.randn(2 * MICROBATCHES, WIDTH), torch.randn(2 * MICROBATCHES, WIDTH)
    first, last = rank % pp == 0, rank % pp == pp - 1
    results = {}
    for engine in ("zbpipe", "torch"):
        sched = _schedule(engine, rank, pp, dp, pp_group, dp_group)

        def step():
            if first:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=[])
            else:
                sched.step()

        for _ in range(3):  # shapes, DDP's bucket rebuild
            step()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(5):
            step()
        per_step = [(time.perf_counter() - t) / 5]
        dist.broadcast_object_list(per_step, src=0)  # every rank runs the same number of steps
        for paced in (False, True):
            steps = max(5, int(window * rate)) if paced else max(5, int(window / per_step[0]))
            label = f"{engine}/{'paced' if paced else 'full'}"
            if rank == 0:
                mark(store, label + "/start")
            dist.barrier()  # Gloo: no store request
            t0 = time.time()
            for k in range(steps):
                if paced:
                    time.sleep(max(0.0, t0 + k / rate - time.time()))
                step()
            t1 = time.time()
            dist.barrier()
            if rank == 0:
                mark(store, label + "/end")
            results[label] = (t0, t1, steps)
        del sched
    out.put((rank, results))
    dist.destroy_process_group()


def training(args) -> None:
    print(f"store requests of steady 1F1B training (Gloo, {MICROBATCHES} microbatches of "
          f"Linear({WIDTH}, {WIDTH})), counted at a TCPStore server in its own process; "
          f"window {args.window:g} s")
    print(f"{'setup':<18} {'engine':<7} {'speed':<10} {'steps/s':>8} {'req/rank/step':>14} "
          f"{'req/rank/s':>11}  by operation")
    ctx = mp.get_context("spawn")
    for name, (pp, dp) in SETUPS.items():
        world = pp * dp
        server = StoreServer(count=True)
        q = ctx.Queue()
        procs = [ctx.Process(target=_training_rank, args=(r, world, server.port, pp, dp, args.window, args.rate, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)
        settle()
        for label in got[0]:
            t0 = min(got[r][label][0] for r in got)
            t1 = max(got[r][label][1] for r in got)
            steps = got[0][label][2]
            reqs = server.requests(label)
            total = sum(reqs.values())
            ops = ", ".join(f"{op} {n}" for op, n in reqs.most_common())
            engine, paced = label.split("/")
            print(f"{name:<18} {engine:<7} {('%g/s' % args.rate) if paced == 'paced' else 'full':<10} "
                  f"{steps / (t1 - t0):8.1f} {total / world / steps:14.3f} {total / world / (t1 - t0):11.2f}  "
                  f"{ops or '-'}")
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("training", help="store requests per rank per step of steady training")
    t.add_argument("--window", type=float, default=8.0, help="seconds of steps per measurement")
    t.add_argument("--rate", type=float, default=5.0, help="steps per second of the paced runs")
    args = p.parse_args()
    {"training": training}[args.mode](args)


if __name__ == "__main__":
    main()
