"""What zbpipe's control plane asks of the job's one shared store.

    PYTHONPATH=. python benchmarks/bench_control_plane.py training            # requests per rank per step
    PYTHONPATH=. python benchmarks/bench_control_plane.py training --window 8 --rate 5
    PYTHONPATH=. python benchmarks/bench_control_plane.py scale --ranks 1024 --pp 4 --procs 8

`training`: steady 1F1B training on Gloo (CPU), one pipeline of 4 ranks and pp=2 x dp=2 with
DDP stages, against a TCPStore server in a process of its own (benchmarks/store_server.py
counts the requests it serves from its own per-request log). After warm-up steps the ranks run
`--window` seconds of steps at full speed and at `--rate` steps per second, zbpipe's schedule
and torch.distributed.pipelining's on the same stages and groups in the same run (torch's is the
0 baseline: it puts nothing on the store after setup). Printed: store requests per rank per
step and per rank per second, by operation.

`scale`: the store-facing control plane of `--ranks` simulated ranks (pipelines of `--pp`,
the replicas of each stage a data-parallel group), `--procs` processes of ranks/procs each, every
rank the real objects (zbpipe._C._ControlPlaneRank: its failure watch on its pipeline's and its
replicas' stores with their inboxes, the program agreement, the replicas' meeting through the
store) against one TCPStore server in a process of its own. Phases, each bracketed by marker
requests: setup (the watches, the agreement of every pipeline and the first meeting of every
stage's replicas; its wall time), idle (`--idle` seconds: the server's requests and CPU, from
/proc), failure (one rank publishes a failure; the latency until each rank's watcher heard of
it, on the machine's one monotonic clock, and the worst). Per-step traffic (each step's
signature, the later meetings) travels over the groups' control groups and never reaches the
store: `training` counts it.
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
            dist.barrier()  # no rank drops its schedule (requests: its watch stops) before the marker
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
            reqs = server.requests(label, keys=args.keys)
            total = sum(reqs.values())
            ops = ", ".join(f"{op} {n}" for op, n in reqs.most_common())
            engine, paced = label.split("/")
            print(f"{name:<18} {engine:<7} {('%g/s' % args.rate) if paced == 'paced' else 'full':<10} "
                  f"{steps / (t1 - t0):8.1f} {total / world / steps:14.3f} {total / world / (t1 - t0):11.2f}  "
                  f"{ops or '-'}")
        server.close()


def _scale_rank_process(proc: int, procs: int, port: int, ranks: int, pp: int, timeout: float, barrier, out) -> None:
    import threading

    from zbpipe import _C

    torch.set_num_threads(1)
    dp = ranks // pp
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=timeout))
    mine = list(range(proc, ranks, procs))
    me = []
    for g in mine:  # rank g: stage s of replica d
        d, s = divmod(g, pp)
        me.append(_C._ControlPlaneRank(dist.PrefixStore(f"pp{d}/", client), s, pp,
                                       dist.PrefixStore(f"dp{s}/", client), d, dp, g))
    barrier.wait()  # every rank constructed: the setup phase starts

    def setup(rank):
        rank.agree("schedule=1f1b pp=%d (the benchmark's)" % pp, timeout)
        rank.meet(timeout)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=setup, args=(r,)) for r in me]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    setup_s = time.perf_counter() - t0
    barrier.wait()  # setup done everywhere
    barrier.wait()  # idle window over (the parent measured it)
    failed_at = None
    if proc == 0:  # global rank 0 fails
        failed_at = _C._steady_clock_ns()
        me[0].fail("RuntimeError: injected by the benchmark")
    deadline = time.monotonic() + timeout
    while any(r.seen_at_ns < 0 for r in me[1 if proc == 0 else 0:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    out.put((proc, setup_s, failed_at, {g: (r.seen_at_ns, r.seen) for g, r in zip(mine, me)}))
    barrier.wait()  # results sent: the ranks go (their watches' stop requests follow the last marker)
    del me


def scale(args) -> None:
    ranks, pp, procs = args.ranks, args.pp, args.procs
    assert ranks % pp == 0 and ranks % procs == 0, "ranks must divide by pp and by procs"
    server = StoreServer(count=True)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=args.timeout))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs + 1), ctx.Queue()
    ps = [ctx.Process(target=_scale_rank_process, args=(i, procs, server.port, ranks, pp, args.timeout, barrier, out))
          for i in range(procs)]
    mark(client, "construct/start")
    for p in ps:
        p.start()
    barrier.wait(timeout=600)
    mark(client, "construct/end")
    mark(client, "setup/start")
    barrier.wait(timeout=600)
    mark(client, "setup/end")
    settle()
    mark(client, "idle/start")
    cpu0, t0 = server.cpu_s(), time.monotonic()
    time.sleep(args.idle)
    cpu1, t1 = server.cpu_s(), time.monotonic()
    mark(client, "idle/end")
    mark(client, "failure/start")
    barrier.wait(timeout=600)
    got = [out.get(timeout=args.timeout + 60) for _ in ps]
    mark(client, "failure/end")
    barrier.wait(timeout=600)
    for p in ps:
        p.join(120)
    settle(1.0)
    failed_at = next(f for _, _, f, _ in got if f is not None)
    latencies, unseen = [], []
    for _, _, _, seen in got:
        for g, (at, what) in seen.items():
            if g == 0:
                continue
            if at < 0 or not what.startswith("rank 0 failed"):
                unseen.append(g)
            else:
                latencies.append((at - failed_at) / 1e9)
    setup_s = max(s for _, s, _, _ in got)
    construct, setup, idle, failure = (server.requests(k) for k in ("construct", "setup", "idle", "failure"))
    idle_n = sum(idle.values())
    print(f"control plane of {ranks} ranks (pp={pp} x dp={ranks // pp}) in {procs} processes, one TCPStore server")
    print(f"{'phase':<28} {'value':>12}  {'store requests':>14}  by operation")
    print(f"{'construct (ids, watches)':<28} {'':>12}  {sum(construct.values()):>14}  "
          f"{', '.join(f'{o} {n}' for o, n in construct.most_common())}")
    print(f"{'setup agreement (s)':<28} {setup_s:12.2f}  {sum(setup.values()):>14}  "
          f"{', '.join(f'{o} {n}' for o, n in setup.most_common())}")
    print(f"{'idle: requests/s':<28} {idle_n / (t1 - t0):12.2f}  {idle_n:>14}  "
          f"{', '.join(f'{o} {n}' for o, n in idle.most_common()) or '-'}")
    print(f"{'idle: server CPU (% core)':<28} {100 * (cpu1 - cpu0) / (t1 - t0):12.2f}")
    lat = sorted(latencies)
    print(f"{'failure: ranks told':<28} {len(lat):>12}  {sum(failure.values()):>14}  "
          f"{', '.join(f'{o} {n}' for o, n in failure.most_common())}")
    if lat:
        print(f"{'failure: median latency (s)':<28} {lat[len(lat) // 2]:12.3f}")
        print(f"{'failure: worst latency (s)':<28} {lat[-1]:12.3f}")
    if unseen:
        print(f"NOT TOLD: ranks {unseen[:20]}{' ...' if len(unseen) > 20 else ''} ({len(unseen)})")
    server.close()
    if unseen:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("training", help="store requests per rank per step of steady training")
    t.add_argument("--window", type=float, default=8.0, help="seconds of steps per measurement")
    t.add_argument("--rate", type=float, default=5.0, help="steps per second of the paced runs")
    t.add_argument("--keys", action="store_true", help="name the key of every request counted")
    c = sub.add_parser("scale", help="the control plane of N simulated ranks against one store")
    c.add_argument("--ranks", type=int, default=1024)
    c.add_argument("--pp", type=int, default=4)
    c.add_argument("--procs", type=int, default=8, help="processes the ranks are spread over")
    c.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    c.add_argument("--timeout", type=float, default=120.0, help="bound of every wait")
    args = p.parse_args()
    {"training": training, "scale": scale}[args.mode](args)


if __name__ == "__main__":
    main()
