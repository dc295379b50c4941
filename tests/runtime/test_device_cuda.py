"""CUDA path: every multi-stage schedule on one rank on a GPU (zbv, interleaved, v_half, v_min,
dualpipev with and without OVERLAP_F_B overlap, ...), exact against a CPU reference, with
per-action device timing through c10 events; with two GPUs, NCCL P2P (device_id bound, every
batch coalesced, waits polled to a deadline): exactness for several schedules and a stopped
peer failing the other rank in bounded time; pp=2 on one GPU through the loopback group (each
rank on a stream of its own, the group's copies kernels and its waits CUDA events): exact, no
host-blocking wait nor host read inside a steady step, sends released when posted, a stopped
peer failing the other within the timeout; the loopback's copy into a posted receive ordered
after the receiver's stream. Skipped without a GPU (the CPU torch of CI has none);
benchmarks/gpu_quick.sh and gpu_check.sh run this file on a GPU machine."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.asserts import assert_grads_close
from helpers.hot_path import STOP_TIMEOUT_S, loopback_steps, stopped_peer
from helpers.model_registry import build, call_chain, data
from zbpipe.train.launcher import LocalWorld

import zbpipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this torch has none)")

ONE_RANK = ["zbv", "interleaved_1f1b", "interleaved_zb", "looped_bfs", "v_half", "v_min", "dualpipev"]
UNIT = re.compile(r"^\((\d+)F(\d+);(\d+)[BI](\d+)\)OVERLAP_F_B$")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("one_rank_group") / "store"
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{store}",
                                rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return dist.distributed_c10d._get_default_group()


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
    assert_grads_close(mods, ref)
    trace = sched.trace()
    assert trace and all(r["device_end_us"] >= r["device_start_us"] >= 0.0 for r in trace), trace
    if name == "dualpipev" and overlap:  # the halves of each unit overlap on the host
        for a in prog.actions(0):
            if u := UNIT.match(a):
                fs, fm, bs, bm = map(int, u.groups())
                f = next(r for r in trace if r["action"] == f"{fs}F{fm}")
                b = next(r for r in trace if r["action"] in (f"{bs}B{bm}", f"{bs}I{bm}"))
                assert b["host_start_ns"] < f["host_end_ns"], (f, b)


def test_schedule_auto_times_on_device_events_on_one_gpu(one_rank_group):
    # ScheduleAuto on a GPU plans from device times (c10 events, taken after any receive wait),
    # with gradients exact across the switch; V placement on one rank (stages 0 and 1).
    dev = torch.device("cuda", 0)
    m = 4
    ref = build("block", 2)
    mods = [copy.deepcopy(r).to(dev) for r in ref]
    stages = [zbpipe.PipelineStage(mod, s, 2, dev) for s, mod in enumerate(mods)]
    sched = zbpipe.ScheduleAuto(stages, m, loss_fn=F.mse_loss)
    for k in range(6):  # memory (step 1), three timing steps, then the choice
        x, y = data("block", 2 * m, seed=k + 1)
        F.mse_loss(call_chain(ref, x), y).backward()
        sched.step(x.to(dev), target=y.to(dev))
    torch.cuda.synchronize()
    assert_grads_close(mods, ref)
    t = sched.tuning
    assert t.clock == "device" and "(device times) over 3 timing steps" in t.table() and t.step == 4, t.table()
    assert all(c[k] > 0 for c in t.costs.values() for k in "fiw"), t.costs
    records = [r for r in sched.trace() if re.fullmatch(r"\d+[FIW]\d+", r["action"])]
    assert records and all(r["device_end_us"] >= r["device_start_us"] >= 0.0 for r in records), records
    # The costs are the device durations' medians (profile_from_trace, clock="device").
    assert zbpipe.profile_from_trace(sched.trace(), clock="device")[1]["f"] > 0


def _nccl_step(rank, pp, name, stop_rank):
    """One step on this rank's GPU; (outcome, message, seconds). With stop_rank, that rank's
    first stage raises in its second forward."""
    import time

    from zbpipe.train.launcher import rank_device

    dev = rank_device()
    m = 4 * pp
    prog = zbpipe.compile(name, pp, m)
    ns = prog.num_stages
    ref = build("block", ns)
    mods = [copy.deepcopy(r).to(dev) for r in ref]
    x, y = data("block", 2 * m)
    F.mse_loss(call_chain(ref, x), y).backward()
    mine = prog.stages_of(rank)
    if rank == stop_rank:
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
        with warnings.catch_warnings():  # the world's group timeout (NCCL_PG_TIMEOUT_S) is above the schedule's
            warnings.filterwarnings("error", message="zbpipe: timeout=")
            sched.step(*((x.to(dev),) if 0 in mine else ()), target=y.to(dev) if ns - 1 in mine else None)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported
        return (type(e).__name__, str(e)[:3000], time.monotonic() - t0)
    assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine])
    assert all(r["device_end_us"] >= r["device_start_us"] >= 0 for r in sched.trace()
               if "SEND" not in r["action"] and "RECV" not in r["action"]), sched.trace()
    return ("ok", "", time.monotonic() - t0)


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs two GPUs for NCCL P2P (NCCL refuses two ranks on one GPU)")


NCCL_PG_TIMEOUT_S = 300.0  # the group's own timeout: above every schedule timeout here


@pytest.fixture(scope="module")
def nccl_world():
    """Two ranks on two GPUs, NCCL for CUDA tensors (Gloo for CPU ones), shared by the module."""
    with LocalWorld(2, device="cuda", pg_timeout_s=NCCL_PG_TIMEOUT_S) as world:
        yield world


@TWO_GPUS
@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev", "interleaved_zb"])
def test_nccl_two_gpus_exact(nccl_world, name):
    results = nccl_world.run(_nccl_step, name, None, timeout_s=240)
    assert all(kind == "ok" for kind, _, _ in results), results


@TWO_GPUS
def test_nccl_stopped_peer_fails_the_other_in_bounded_time(nccl_world):
    kind, msg, seconds = nccl_world.run(_nccl_step, "1f1b", 1, timeout_s=240)[0]
    assert kind == "PipelineError" and "from rank 1" in msg, (kind, msg)  # a timeout or NCCL's own error
    assert seconds < 3 * 5.0 + 30, seconds


# ---- pp=2 on one GPU through the loopback group (the stream-ordered path on real streams) ----


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev"])
def test_pp2_on_one_gpu_through_the_loopback_group(name):
    # Two ranks on one GPU, each computing on a stream of its own; the loopback group's copies
    # are kernels and its waits CUDA events (csrc/runtime/loopback.h). Exact, the host never
    # blocks on a message inside a steady step (at its end it may: how long the GPU lags the
    # host is not zbpipe's), nothing read on the host, and a rank's peak of saved activations
    # and boundary buffers (sends released when posted) is the model's.
    prog, out = loopback_steps(name, 2, 4, track=True, device="cuda")
    for r, res in sorted(out.items()):
        assert res["host_waits_inside"] == 0 and res["host_reads"] == 0, (name, r, res["events"], res["settles"],
                                                                          res["host_reads"])
        tr = res["tracker"]
        mem_f = [float(tr.per_forward[0])] * prog.num_stages
        assert max(tr.snapshots) == zbpipe.simulate(prog, mem_f=mem_f).peak_memory[r], (name, r, tr.snapshots)
        assert not tr.live(), (name, r, tr.live())


def test_pp2_on_one_gpu_a_stopped_peer_fails_the_other_within_the_timeout():
    out = stopped_peer("cuda")
    assert out[1][0] == "PipelineError" and "this rank stops here" in out[1][1], out[1]
    kind, msg, seconds = out[0]
    assert kind == "PipelineError" and "rank 1" in msg, out[0]
    assert seconds < STOP_TIMEOUT_S + 10, seconds


def test_loopback_copy_into_a_posted_receive_waits_for_the_receivers_stream():
    # The receiver's stream still reads a block when it frees it and posts a receive into the
    # same block (the caching allocator reuses it at once on that stream); NCCL runs the
    # receive after what the receiver queued before posting it, and so must the loopback's
    # copy, which runs on the sender's stream: without that order it overwrites the block
    # before the queued kernel read it.
    from zbpipe import _C

    world = _C._LoopbackWorld(2)
    dev = torch.device("cuda", 0)
    n = 1 << 20
    recv_stream, send_stream = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(recv_stream):
        a = torch.full((n,), 1.0, device=dev)
        torch.cuda._sleep(200_000_000)  # the receiver's stream runs far behind its host
        b = a * 2                        # queued: reads a after the sleep
        a_ptr = a.data_ptr()
        del a
        buf = torch.empty(n, device=dev)
        if buf.data_ptr() != a_ptr:
            pytest.skip("the caching allocator did not reuse the freed block for the receive")
        work = world.group(1).recv([buf], 0, 0)
    with torch.cuda.stream(send_stream):
        src = torch.full((n,), 7.0, device=dev)
        world.group(0).send([src], 1, 0).wait()
    with torch.cuda.stream(recv_stream):
        work.wait()
    torch.cuda.synchronize()
    assert bool((b == 2).all()), "the copy overwrote the buffer before the receiver's queued kernel read it"
    assert bool((buf == 7).all())


# ---- the vocabulary-parallel head on NCCL (two GPUs) ----------------------------------------

def _nccl_vocab_step(rank, size, name):
    """A small LM with its head split by rows over both GPUs: the collectives on a NCCL group
    zbpipe makes at the first step, the head's passes on a stream of their own (vocab_run.h);
    losses and gradients against the whole model in one process on the CPU."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    vocab, width, seq, m = 37, 16, 6, 4
    program = zbpipe.compile(name, size, m)
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(*([torch.nn.Embedding(vocab, width)] if s == 0 else []),
                                torch.nn.Linear(width, width), torch.nn.Tanh()) for s in range(program.num_stages)]
    head = torch.nn.Linear(width, vocab)
    ref, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(vocab, (2 * m, seq), generator=g), torch.randint(vocab, (2 * m, seq), generator=g)
    h = x
    for mod in ref:
        h = mod(h)
    want = [F.cross_entropy(ref_head(hc).flatten(0, 1), yc.flatten()) for hc, yc in zip(h.chunk(m), y.chunk(m))]
    torch.stack(want).mean().backward()
    mine = [s for s in range(program.num_stages) if program.stage_to_rank[s] == rank]
    stages = [zbpipe.PipelineStage(mods[s].to(dev), s, program.num_stages, dev) for s in mine]
    out = zbpipe.VocabParallelOutput(head.to(dev))
    cls = zbpipe.get_schedule_class(name)
    sched = cls(stages if len(stages) > 1 else stages[0], m, output=out, timeout=120.0)
    losses = []
    try:
        sched.step(*((x.to(dev),) if 0 in mine else ()), target=y.to(dev), losses=losses)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported
        return (type(e).__name__, str(e)[:3000])
    assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine])
    b, e = out.shard_range
    torch.testing.assert_close(out.weight.grad.cpu(), ref_head.weight.grad[b:e], rtol=1e-3, atol=1e-5)
    if program.stage_to_rank[-1] == rank:
        torch.testing.assert_close(torch.stack(losses).cpu(), torch.stack(want).detach(), rtol=1e-3, atol=1e-5)
    return ("ok", "")


@TWO_GPUS
@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved_zb"])
def test_nccl_two_gpus_vocab_parallel_head_exact(nccl_world, name):
    results = nccl_world.run(_nccl_vocab_step, name, timeout_s=240)
    assert all(kind == "ok" for kind, _ in results), results
