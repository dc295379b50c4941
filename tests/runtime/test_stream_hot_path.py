"""The stream-ordered (NCCL) hot path, on the in-process loopback world that models stream
waits (one thread per rank, a shared in-process store as real groups have): in a steady step
the host never blocks on a message (the backend counts the host-blocking waits: zero), the
step makes no device-to-host copy and no one-element message (the step's input signature goes
through the store), gradients stay exact, and a sent tensor is released when it is posted, so a rank's measured peak
of saved activations and boundary buffers equals the memory model's (simulate's peak_memory,
mem_f measured per stage). Over Gloo (stream_ordered=True) the step also makes no
device-to-host copy."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from helpers.hot_path import STEPS, STOP_TIMEOUT_S, WIDTH, Counting, Scale, loopback_steps, stopped_peer
from helpers.loopback import run_threads

import zbpipe
from zbpipe import _C


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"])
def test_a_steady_step_never_blocks_the_host_nor_reads_a_device_value(name):
    prog, out = loopback_steps(name, 2, 4)
    for r, res in sorted(out.items()):
        assert res["host_waits"] == 0, (name, r, res["host_waits"], res["events"])
        assert res["host_reads"] == 0, (name, r, res["host_reads"])
        # Every post carries the program's data messages only: no one-element signature message.
        posts = [ops for kind, _, _, ops in res["events"] if kind == "post"]
        assert posts and all(op[3] == 2 * 4 * WIDTH for ops in posts for op in ops), (name, r, posts)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_lagging_device_blocks_the_host_only_at_the_steps_end(name):
    # A GPU may still run the step's kernels when the host reaches the step's end: the works
    # then answer "not complete" (lagging_polls), and the end blocks the host on them. That is
    # the end's wait, not one inside the step, so a count of every host wait (host_waits) is
    # not what a one-GPU run may assert: it depends on how far the device lags.
    prog, out = loopback_steps(name, 2, 4, lagging_polls=1000)
    for r, res in sorted(out.items()):
        assert res["host_waits"] > 0, (name, r, res["events"])  # the end waited for the device
        assert len(res["settles"]) == 1, (name, r, res["settles"])
        assert res["host_waits_inside"] == 0, (name, r, res["events"], res["settles"])


def test_a_host_wait_inside_the_step_is_told_apart_from_the_ends():
    from helpers.hot_path import host_waits_inside_the_step

    events = [("post", 0, True, []), ("sync", 0, False, []), ("wait", 1, False, []), ("sync", 1, False, [])]
    assert host_waits_inside_the_step(events, [3]) == 1   # the first sync came before the end
    assert host_waits_inside_the_step(events, [1]) == 0
    assert host_waits_inside_the_step(events, []) == 2    # no end recorded: every wait counts


def test_without_a_store_the_signature_is_a_message_read_on_the_host():
    # The counters see what the store removes: the storeless loopback world still sends the
    # index as a one-element message, which its receivers wait for on the host and read.
    _, out = loopback_steps("1f1b", 2, 4, store=False)
    assert out[1]["host_waits"] >= 1 and out[1]["host_reads"] >= 1, out[1]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_peak_bytes_equal_the_memory_model_with_boundary_buffers(name):
    pp, m = 2, 4
    prog, out = loopback_steps(name, pp, m, track=True)
    for r, res in sorted(out.items()):
        tr = res["tracker"]
        assert len(tr.per_forward) == m and len(set(tr.per_forward)) == 1, tr.per_forward
        mem_f = [float(tr.per_forward[0]) if prog.stage_to_rank[s] == r else 1.0 for s in range(prog.num_stages)]
        model = zbpipe.simulate(prog, mem_f=mem_f).peak_memory[r]
        assert max(tr.snapshots) == model, (name, r, tr.snapshots, model, tr.per_forward, tr.live_at)
        assert not tr.live(), f"alive after the step: {tr.live()}"


def _gloo_host_reads(rank, pp):
    group = torch.distributed.new_group(list(range(pp)), backend="gloo")
    torch.manual_seed(0)
    m = 4
    stage = zbpipe.PipelineStage(Scale(rank), rank, pp, "cpu", group=group)
    sched = zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, stream_ordered=True, timeout=30)
    x, y = torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH)
    reads = []
    for _ in range(STEPS):
        counting = Counting()
        with counting:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == pp - 1 else None)
        reads.append(counting.host_reads)
    return reads


def test_no_device_to_host_copy_per_step_over_gloo(spawn_world):
    for rank, reads in enumerate(spawn_world(2).run(_gloo_host_reads, timeout_s=120)):
        assert reads[1:] == [0] * (STEPS - 1), (rank, reads)


def test_a_stopped_peer_fails_the_other_through_the_store_while_the_host_runs_ahead():
    # Stream waits return at once: rank 0 runs ahead to the step's end and waits there; rank
    # 1's failure reaches it through the store (its failure watch aborts the wait).
    out = stopped_peer("cpu")
    assert out[1][0] == "PipelineError" and "this rank stops here" in out[1][1], out[1]
    kind, msg, seconds = out[0]
    assert kind == "PipelineError" and msg.startswith("aborted because rank 1 failed"), out[0]
    assert seconds < STOP_TIMEOUT_S, seconds  # the store, not the timeout


def test_a_backend_returning_no_work_is_refused_not_skipped():
    world = _C._LoopbackWorld(2, store=True)
    m = 2
    barrier = threading.Barrier(2)

    def rank_main(r):
        stage = zbpipe.PipelineStage(Scale(r), r, 2, "cpu", group=world.group(r))
        sched = zbpipe.Schedule1F1B(stage, m, loss_fn=F.mse_loss, stream_ordered=True, timeout=5.0)
        x, y = torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH)
        sched.step(*((x,) if r == 0 else ()), target=y if r == 1 else None)  # shapes, with works
        barrier.wait(30)
        world.return_no_work(True)
        try:
            sched.step(*((x,) if r == 0 else ()), target=y if r == 1 else None)
        except Exception as e:  # noqa: BLE001 - the message is the point
            return f"{type(e).__name__}: {e}"
        return "ok"

    out = run_threads(world, rank_main, timeout=60)
    assert any("returned no work" in str(v) for v in out.values()), out
    assert all(str(v).startswith("PipelineError") for v in out.values()), out
