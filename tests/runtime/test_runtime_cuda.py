"""CUDA path: every multi-stage schedule on one rank on a GPU (zbv, interleaved, v_half, v_min,
dualpipev with and without OVERLAP_F_B overlap, ...), exact against a CPU reference, with
per-action device timing through c10 events; with two GPUs, NCCL P2P (device_id bound, every
batch coalesced, waits polled to a deadline): exactness for several schedules and a stopped
peer failing the other rank in bounded time. Skipped without a GPU (the CPU torch of CI has
none); benchmarks/gpu_check.sh runs this file on a GPU machine."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import zbpipe
from _models import build, call_chain, data
from _pp_world import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this torch has none)")

ONE_RANK = ["zbv", "interleaved_1f1b", "interleaved_zb", "looped_bfs", "v_half", "v_min", "dualpipev"]
UNIT = re.compile(r"^\((\d+)F(\d+);(\d+)[BI](\d+)\)OVERLAP_F_B$")


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return dist.distributed_c10d._get_default_group()


def _grads_close(mods, ref):
    for s, (m, r) in enumerate(zip(mods, ref)):
        for (name, p), q in zip(m.named_parameters(), r.parameters()):
            if q.grad is None:
                assert p.grad is None, (s, name)
                continue
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-5, msg=f"stage {s} {name}")


@pytest.mark.parametrize("model", ["block", "ckpt"])
@pytest.mark.parametrize("name,overlap", [(n, True) for n in ONE_RANK] + [("dualpipev", False)])
def test_multi_stage_schedule_on_one_gpu_exact_against_cpu(one_rank_group, name, overlap, model):
    dev = torch.device("cuda", 0)
    m = 4
    prog = zbpipe.compile(name, 1, m)
    ref = build(model, prog.num_stages)  # CPU reference
    mods = [copy.deepcopy(r).to(dev) for r in ref]
    x, y = data(model, 2 * m)
    F.mse_loss(call_chain(ref, x), y).backward()
    stages = [zbpipe.PipelineStage(mod, s, prog.num_stages, dev) for s, mod in enumerate(mods)]
    sched = zbpipe.get_schedule_class(name)(stages, m, loss_fn=F.mse_loss, device_timing=True,
                                            overlap_f_b=overlap)
    sched.step(x.to(dev), target=y.to(dev))
    torch.cuda.synchronize()
    _grads_close(mods, ref)
    trace = sched.trace()
    assert trace and all(r["device_end_us"] >= r["device_start_us"] >= 0.0 for r in trace), trace
    if name == "dualpipev" and overlap:  # the halves of each unit overlap on the host
        for a in prog.actions(0):
            if u := UNIT.match(a):
                fs, fm, bs, bm = map(int, u.groups())
                f = next(r for r in trace if r["action"] == f"{fs}F{fm}")
                b = next(r for r in trace if r["action"] in (f"{bs}B{bm}", f"{bs}I{bm}"))
                assert b["host_start_ns"] < f["host_end_ns"], (f, b)


def _nccl_world(rank, pp, port, out, name, stop_rank):
    import time

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=pp, device_id=dev)
    try:
        m = 4 * pp
        prog = zbpipe.compile(name, pp, m)
        ns = prog.num_stages
        ref = build("block", ns)
        mods = [copy.deepcopy(r).to(dev) for r in ref]
        x, y = data("block", 2 * m)
        F.mse_loss(call_chain(ref, x), y).backward()
        mine = prog.stages_of(rank)
        if stop_rank is not None and rank == stop_rank:
            calls = {"n": 0}
            inner = mods[mine[0]].forward

            def stopping(*a, **k):
                calls["n"] += torch.is_grad_enabled()
                if calls["n"] == 2:
                    raise RuntimeError("this rank stops here")
                return inner(*a, **k)

            mods[mine[0]].forward = stopping
        stages = [zbpipe.PipelineStage(mods[s], s, ns, dev) for s in mine]
        cls = zbpipe.get_schedule_class(name)
        sched = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=F.mse_loss, device_timing=True,
                    timeout=5.0 if stop_rank is not None else 120.0)
        t0 = time.monotonic()
        try:
            sched.step(*((x.to(dev),) if 0 in mine else ()), target=y.to(dev) if ns - 1 in mine else None)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported
            out.put((rank, type(e).__name__, str(e)[:3000], time.monotonic() - t0))
            return
        ok = all(torch.allclose(mods[s].get_parameter(n).grad.cpu(), q.grad, rtol=1e-3, atol=1e-5)
                 for s in mine for n, q in ref[s].named_parameters() if q.grad is not None)
        timed = all(r["device_end_us"] >= r["device_start_us"] >= 0 for r in sched.trace()
                    if "SEND" not in r["action"] and "RECV" not in r["action"])
        out.put((rank, "ok" if ok and timed else f"grads ok={ok} timed={timed}", "", time.monotonic() - t0))
    finally:
        import os

        out.close()
        out.join_thread()  # flush to the parent before the hard exit
        os._exit(0)  # a stopped peer leaves NCCL work behind: no teardown


def _run_nccl(pp, name, stop_rank=None):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_world, args=(r, pp, port, out, name, stop_rank)) for r in range(pp)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, kind, msg, seconds = out.get(timeout=240)
            results[rank] = (kind, msg, seconds)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for NCCL P2P (NCCL refuses two ranks on one GPU)")
@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev", "interleaved_zb"])
def test_nccl_two_gpus_exact(name):
    results = _run_nccl(2, name)
    assert all(kind == "ok" for kind, _, _ in results.values()), results


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for NCCL P2P (NCCL refuses two ranks on one GPU)")
def test_nccl_stopped_peer_fails_the_other_in_bounded_time():
    results = _run_nccl(2, "1f1b", stop_rank=1)
    kind, msg, seconds = results[0]
    assert kind == "PipelineError" and "from rank 1" in msg, results  # a timeout or NCCL's own error
    assert seconds < 3 * 5.0 + 30, seconds
