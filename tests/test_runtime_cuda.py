"""CUDA path: compute on the current stream, per-action device timing through c10 events, and
(with two GPUs) NCCL P2P where the compute stream waits on communication without blocking the
host. Skipped without a GPU (the CPU torch of CI has none)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zbpipe
from _models import build, call_chain, data
from _pp_world import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this torch has none)")


def _nccl_world(rank, pp, port, out):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp)
    dev = torch.device("cuda", rank)
    mods = [m.to(dev) for m in build("block", 2 * pp)]
    ref = [m.to(dev) for m in build("block", 2 * pp)]
    x, y = (t.to(dev) for t in data("block", 8))
    F.mse_loss(call_chain(ref, x), y).backward()
    mine = [s for s in range(2 * pp) if zbpipe.compile("zbv", pp, 4).stage_to_rank[s] == rank]
    stages = [zbpipe.PipelineStage(mods[s], s, 2 * pp, dev) for s in mine]
    sched = zbpipe.ScheduleZBVZeroBubble(stages, 4, loss_fn=F.mse_loss, device_timing=True)
    sched.step(x, target=y)
    ok = all(torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-5)
             for s in mine for p, q in zip(mods[s].parameters(), ref[s].parameters()) if q.grad is not None)
    timed = all(r["device_end_us"] >= r["device_start_us"] >= 0 for r in sched.trace() if "SEND" not in r["action"] and "RECV" not in r["action"])
    out.put((rank, ok, timed))
    dist.destroy_process_group()


def test_device_timing_on_one_gpu():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    mods = [m.to(dev) for m in build("block", 2)]
    ref = [m.to(dev) for m in build("block", 2)]
    x, y = (t.to(dev) for t in data("block", 8))
    F.mse_loss(call_chain(ref, x), y).backward()
    stages = [zbpipe.PipelineStage(m, s, 2, dev) for s, m in enumerate(mods)]
    sched = zbpipe.ScheduleZBVZeroBubble(stages, 4, loss_fn=F.mse_loss, device_timing=True)
    sched.step(x, target=y)
    trace = sched.trace()
    assert trace and all(r["device_end_us"] >= r["device_start_us"] >= 0.0 for r in trace)
    for m, r in zip(mods, ref):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for NCCL P2P")
def test_nccl_zbv_two_gpus():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_world, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(ok and timed for _, ok, timed in results), results
