"""Schedule-class lookup, per-action trace and Chrome-trace export, and a one-rank pipeline
(same-rank stage hand-off only, no communication)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from helpers.asserts import assert_close, assert_grads_close
from helpers.model_registry import build, call_chain, data

import zbpipe


@pytest.mark.parametrize("name,expected", [
    ("GPipe", "gpipe"), ("1F1B", "1f1b"), ("schedule1f1b", "1f1b"), ("LoopedBFS", "looped_bfs"),
    ("Interleaved1F1B", "interleaved_1f1b"), ("InterleavedZeroBubble", "interleaved_zb"),
    ("ZBVZeroBubble", "zbv"), ("ScheduleZBVZeroBubble", "zbv"), ("DualPipeV", "dualpipev"),
    ("zb_h1", "zb_h1"), ("ZBH2", "zb_h2"), ("interleaved_zb", "interleaved_zb"),
])
def test_get_schedule_class_accepts_pytorch_and_compile_names(name, expected):
    assert zbpipe.get_schedule_class(name).schedule == expected


def test_every_compile_name_has_a_class():
    for name in zbpipe.schedule_names():
        cls = zbpipe.get_schedule_class(name)
        assert issubclass(cls, zbpipe.PipelineSchedule) and cls.schedule == name


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(ValueError, match="unknown schedule 'nope'.*ScheduleGPipe"):
        zbpipe.get_schedule_class("nope")


def _trace_world(rank, pp, path):
    mods = build("mlp", 2 * pp)
    stages = [zbpipe.PipelineStage(mods[s], s, 2 * pp, "cpu") for s in range(2 * pp) if s % pp == rank]
    sched = zbpipe.ScheduleInterleaved1F1B(stages, 2 * pp, loss_fn=F.mse_loss, timeout=20, device_timing=True)
    x, y = data("mlp", 4 * pp)
    sched.step(x if rank == 0 else None, target=y) if rank == 0 else sched.step(target=y)
    # A program loaded from PyTorch's CSV layout runs as well (here: this run's own, saved).
    csv = os.path.join(path, "prog.csv")
    if rank == 0:
        sched.program.to_csv(csv)
    torch.distributed.barrier()
    loaded = zbpipe.PipelineSchedule.from_program(stages, zbpipe.Program.from_csv(csv), loss_fn=F.mse_loss, timeout=20)
    before = [p.grad.clone() for st in stages for p in st.submod.parameters()]
    loaded.step(x if rank == 0 else None, target=y) if rank == 0 else loaded.step(target=y)
    # Same batch again through the CSV program: gradients accumulate (double).
    assert_close([p.grad for st in stages for p in st.submod.parameters()], [2 * b for b in before])
    # zb_auto through its class: compile_options (measured costs, memory cap) reach compile().
    opts = dict(f=[1.0, 3.0], b=[1.0, 3.0], w=[1.0, 1.0], comm=0.1, memory_cap=3)
    mlp = build("mlp", pp)
    auto = zbpipe.ScheduleZBAuto(zbpipe.PipelineStage(mlp[rank], rank, pp, "cpu"), 4,
                                 loss_fn=F.mse_loss, timeout=20, compile_options=opts)
    auto_actions = auto.program.actions(rank)
    xa, ya = data("mlp", 8)
    auto.step(xa if rank == 0 else None, target=ya) if rank == 0 else auto.step(target=ya)
    out = os.path.join(path, f"trace{rank}.json")
    sched.export_chrome_trace(out)
    with open(out) as f:
        events = json.load(f)["traceEvents"]
    return {"trace": sched.trace(), "untimed": loaded.trace(), "events": events, "actions": sched.program.actions(rank),
            "auto_actions": auto_actions, "auto_opts": opts}


def test_trace_records_every_action_and_exports_chrome_json(spawn_world, tmp_path):
    results = spawn_world(2).run(_trace_world, str(tmp_path), timeout_s=120)
    for rank, res in enumerate(results):
        names = "+".join(r["action"] for r in res["trace"]).split("+")
        assert names == res["actions"]  # comm batches join their actions with '+'
        for r in res["trace"]:
            assert r["rank"] == rank and r["host_end_ns"] >= r["host_start_ns"] >= 0
            assert 0 <= r["wait_ns"] <= r["host_end_ns"] - r["host_start_ns"]
            # The thread's CPU time (device_timing=True): within the host time (1 ms for the clocks' granularity),
            # and more than nothing for a compute action (a forward or backward of a Linear).
            assert r["cpu_ns"] <= r["host_end_ns"] - r["host_start_ns"] + 1_000_000
            if re.fullmatch(r"\d+[FBIW]\d+", r["action"]):
                assert r["cpu_ns"] > 0, r
            assert r["device_start_us"] == -1.0  # CPU: no device events
        # Without device_timing no CPU time is read (a system call per read).
        assert all(r["cpu_ns"] == -1 for r in res["untimed"]), res["untimed"]
        assert [e["name"] for e in res["events"]] == [r["action"] for r in res["trace"]]
        assert all(e["ph"] == "X" and e["pid"] == rank for e in res["events"])
        assert res["auto_actions"] == zbpipe.compile("zb_auto", 2, 4, **res["auto_opts"]).actions(rank)
    # ...and the options matter here, so the equality above shows they were passed.
    assert zbpipe.compile("zb_auto", 2, 4, **results[0]["auto_opts"]).actions(0) != \
        zbpipe.compile("zb_auto", 2, 4).actions(0)


def _one_rank(rank, pp, name):
    num_stages = zbpipe.compile(name, 1, 4).num_stages
    mods = build("twice", num_stages)
    ref = build("twice", num_stages)
    x, y = data("twice", 8)
    F.mse_loss(call_chain(ref, x), y).backward()
    stages = [zbpipe.PipelineStage(m, s, num_stages, "cpu") for s, m in enumerate(mods)]
    zbpipe.get_schedule_class(name)(stages, 4, loss_fn=F.mse_loss).step(x, target=y)
    assert_grads_close(mods, ref, msg=name)
    return num_stages


@pytest.mark.parametrize("name", ["zbv", "interleaved_zb", "gpipe"])
def test_one_rank_pipeline_hands_tensors_over_locally(spawn_world, name):
    assert spawn_world(1).run(_one_rank, name, timeout_s=60) == [zbpipe.compile(name, 1, 4).num_stages]
