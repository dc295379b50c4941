"""The setup checks of a schedule's stages (zbpipe/device_checks.py), run when it builds its
executor: a CUDA stage on a group that cannot carry CUDA tensors (no CUDA backend, or Gloo) is
refused naming the stage and the group; a CUDA stage compiled with CUDA graphs is refused;
TORCH_NCCL_BLOCKING_WAIT=1 on an NCCL group draws a warning naming its cost. And the
executor's own refusal to send the output of a CUDA graph replay (a cached tensor of
cudagraph trees), for graphs no module check sees. The CPU torch here has no CUDA: stages
declared on "cuda" never compute, the checks refuse them before the executor is built."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers.loopback import run_threads

import zbpipe
import zbpipe.device_checks as dc
from zbpipe import _C


def _cuda_step(rank, size, group_kind):
    """A 1F1B step of CUDA stages on `group_kind`: the world's Gloo group or a CPU-only one."""
    group = dist.group.WORLD if group_kind == "world" else dist.new_group(list(range(size)), backend="cpu:gloo")
    stage = zbpipe.PipelineStage(nn.Linear(4, 4), rank, size, "cuda", group=group)
    sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=10)
    x = torch.randn(4, 4)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=x if rank == size - 1 else None)
    except ValueError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize("group_kind, has", [
    ("world", "Gloo for cuda tensors, whose send and receive take CPU tensors only"),
    ("cpu_only", "no backend for cuda tensors"),
])
def test_a_cuda_stage_on_a_group_without_a_cuda_backend_is_refused_at_setup(spawn_world, group_kind, has):
    out = spawn_world(2).run(_cuda_step, group_kind, timeout_s=120)
    for rank, text in enumerate(out):
        assert text.startswith(f"stage {rank} computes on cuda, but its process group has {has}"), text
        assert "NCCL" in text


def test_a_cpu_stage_or_a_one_rank_pipeline_passes_the_transport_check():
    world = _C._LoopbackWorld(2)
    dc.check_transport(world.group(0), torch.device("cuda"), 0)  # a custom backend serves CUDA: passes
    alone = _C._LoopbackWorld(1)
    dc.check_transport(alone.group(0), torch.device("cuda"), 0)  # one rank sends nothing
    dc.check_transport(world.group(0), torch.device("cpu"), 0)


def test_the_compiled_module_with_cuda_graphs_is_found_by_name():
    lin = nn.Linear(4, 4)
    assert dc.cuda_graph_module(nn.Sequential(lin, nn.Tanh())) is None
    assert dc.cuda_graph_module(nn.Sequential(nn.Tanh(), torch.compile(lin))) is None  # default mode
    assert dc.cuda_graph_module(nn.Sequential(nn.Tanh(), torch.compile(lin, mode="reduce-overhead"))) == "1"
    assert dc.cuda_graph_module(torch.compile(lin, mode="max-autotune")) == ""
    assert dc.cuda_graph_module(torch.compile(lin, mode="max-autotune-no-cudagraphs")) is None
    assert dc.cuda_graph_module(torch.compile(lin, options={"triton.cudagraphs": True})) == ""
    inplace = nn.Sequential(nn.Linear(4, 4))
    inplace[0].compile(mode="reduce-overhead")  # nn.Module.compile: compiled in place
    assert dc.cuda_graph_module(inplace) == "0"
    patched = nn.Linear(4, 4)
    patched.forward = torch.compile(patched.forward, mode="reduce-overhead")
    assert dc.cuda_graph_module(patched) == ""


def test_a_cuda_stage_compiled_with_cuda_graphs_is_refused_at_setup():
    world = _C._LoopbackWorld(2)  # serves CUDA tensors: only the graphs are refused

    def rank_main(r):
        mod = nn.Sequential(nn.Tanh(), torch.compile(nn.Linear(4, 4), mode="reduce-overhead"))
        stage = zbpipe.PipelineStage(mod, r, 2, "cuda", group=world.group(r))
        sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=10)
        x = torch.randn(4, 4)
        sched.step(*((x,) if r == 0 else ()), target=x if r == 1 else None)

    out = run_threads(world, rank_main, timeout=60)
    for r in range(2):
        assert isinstance(out[r], ValueError), out[r]
        assert str(out[r]).startswith(f"stage {r}: its submodule '1' is compiled with CUDA graphs"), out[r]
        assert "max-autotune-no-cudagraphs" in str(out[r])


def test_a_cpu_stage_compiled_with_cuda_graphs_passes():
    # On the CPU inductor captures no CUDA graph: nothing to refuse.
    world = _C._LoopbackWorld(2)
    stage = zbpipe.PipelineStage(torch.compile(nn.Linear(4, 4), mode="reduce-overhead"), 0, 2, "cpu",
                                 group=world.group(0))
    dc.check_stages([stage], world.group(0))


class _NcclGroup:
    """A group whose backend for CUDA tensors is NCCL (none here): what check_stages reads."""

    def size(self):
        return 2

    def _get_backend(self, device):
        return type("B", (), {"name": lambda self: "NCCL"})()


@pytest.mark.parametrize("var", ["TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"])
def test_blocking_wait_on_nccl_warns_naming_its_cost(var):
    with pytest.warns(UserWarning, match=rf"{var}=1 makes every wait on NCCL block the host .* each of the "
                                         r"step's stream waits .* becomes a host wait"):
        assert dc.warn_blocking_wait(_NcclGroup(), torch.device("cuda"), environ={var: "1"})


def test_no_blocking_wait_warning_without_it_or_off_nccl():
    world = _C._LoopbackWorld(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dc.warn_blocking_wait(_NcclGroup(), torch.device("cuda"), environ={}) is None
        assert dc.warn_blocking_wait(_NcclGroup(), torch.device("cuda"),
                                     environ={"TORCH_NCCL_BLOCKING_WAIT": "0"}) is None
        assert dc.warn_blocking_wait(world.group(0), torch.device("cuda"),
                                     environ={"TORCH_NCCL_BLOCKING_WAIT": "1"}) is None  # loopback, not NCCL


def test_the_schedule_warns_of_blocking_wait_when_it_builds_its_executor(monkeypatch):
    seen = []
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setattr(dc, "backend_name", lambda group, device: seen.append(group) or "nccl")
    world = _C._LoopbackWorld(1)
    stage = zbpipe.PipelineStage(nn.Linear(4, 4), 0, 1, "cpu", group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss)
    with pytest.warns(UserWarning, match=r"TORCH_NCCL_BLOCKING_WAIT=1 makes every wait on NCCL block the host"):
        sched.step(torch.randn(4, 4), target=torch.randn(4, 4))
    assert seen and seen[0] is world.group(0)


# ---- the executor refuses to send a CUDA graph replay's output ----------------------------


class _Replayed(nn.Module):
    """x * w, marked as cudagraph trees mark a replay's outputs (a cached tensor). `how`:
    "whole" returns it; "view" a contiguous view of a marked [2x, 4] tensor (its first rows);
    "strided" a non-contiguous view of a marked [x, 8] tensor (its first columns), which the
    executor sends as a copy."""

    def __init__(self, how):
        super().__init__()
        self.w, self.how, self.marked = nn.Parameter(torch.ones(4)), how, []

    def forward(self, x):
        y = x * self.w
        out = {"whole": y, "view": torch.cat([y, x]), "strided": torch.cat([y, x], dim=1)}[self.how]
        torch._C._add_cached_tensor(out)
        self.marked.append(out)
        return {"whole": out, "view": out[: x.size(0)], "strided": out[:, :4]}[self.how]


@pytest.fixture
def cached_tensors():
    torch._C._set_cached_tensors_enabled(True)
    marked = []
    yield marked
    for t in marked:
        torch._C._remove_cached_tensor(t)
    torch._C._set_cached_tensors_enabled(False)


@pytest.mark.parametrize("how", ["whole", "view"])
def test_the_send_of_a_cuda_graph_replays_output_is_refused(cached_tensors, how):
    # Stream-like waits: a receive that never comes does not hold the peer's host (as on NCCL).
    world = _C._LoopbackWorld(2, stream_waits=True, store=True)
    first = _Replayed(how)

    def rank_main(r):
        mod = first if r == 0 else nn.Linear(4, 4)
        stage = zbpipe.PipelineStage(mod, r, 2, "cpu", group=world.group(r))
        sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, stream_ordered=True, timeout=10)
        x = torch.randn(4, 4)
        try:
            sched.step(*((x,) if r == 0 else ()), target=x if r == 1 else None)
        except zbpipe.PipelineError as e:
            return str(e)
        return "ok"

    try:
        out = run_threads(world, rank_main, timeout=60)
    finally:
        cached_tensors.extend(first.marked)
    assert out[0].startswith("rank 0 failed in stage 0 at action 0F0"), out[0]
    assert "stage 0's output 0, sent to another rank, is the output of a CUDA graph replay" in out[0], out[0]
    assert "aborted because rank 0 failed" in out[1], out[1]


def test_a_non_contiguous_view_of_a_replays_output_is_sent_as_a_copy(cached_tensors):
    world = _C._LoopbackWorld(2, store=True)
    first = _Replayed("strided")

    def rank_main(r):
        mod = first if r == 0 else nn.Linear(4, 4)
        stage = zbpipe.PipelineStage(mod, r, 2, "cpu", group=world.group(r))
        sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, stream_ordered=True, timeout=10)
        x = torch.randn(4, 4)
        sched.step(*((x,) if r == 0 else ()), target=x if r == 1 else None)
        return "ok"

    try:
        out = run_threads(world, rank_main, timeout=60)
    finally:
        cached_tensors.extend(first.marked)
    assert out == {0: "ok", 1: "ok"}, out
