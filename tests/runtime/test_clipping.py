"""zbpipe.clip_grad_norm_ clips a pipelined model as torch.nn.utils.clip_grad_norm_ clips the
whole model in one process: same total norm returned on every rank, same gradients after
clipping, for the 2-norm and the inf-norm. World 4 on Gloo: two independent pp=2 pipelines
(1f1b, and zbv with two stages per rank), then pp=2 x dp=2 with DDP stages (replicas hold equal
gradients: not summed twice) and FSDP2 stages (DTensor gradient shards: reduced over the shard
group first). max_norm is half the true norm, so every case really scales the gradients.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.asserts import assert_close, assert_grads_close
from helpers.model_registry import MODELS, build, call_chain, data
from helpers.schedule_registry import local_stages

import zbpipe

PP, DP = 2, 2
M = 4  # microbatches per pipeline per step
_STATE: dict = {}  # per rank process: the device mesh, made once


def _mesh():
    if not _STATE:
        from torch.distributed.device_mesh import init_device_mesh

        _STATE["mesh"] = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    return _STATE["mesh"]


def _clip(rank, world, name, wrapper, norm_type, by):
    """One pipelined step of the mlp model on this rank's pipeline, clipped by zbpipe, against
    the same step clipped by torch in one process (AssertionError on a difference); returns
    the total norm zbpipe returned."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = _mesh()
    dp_rank, pp_rank = mesh.get_coordinate()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    program = zbpipe.compile(name, PP, M)
    loss_fn = MODELS["mlp"][2]
    mods = build("mlp", program.num_stages)
    ref = copy.deepcopy(mods)
    x, y = data("mlp", 2 * M * DP, seed=5)
    # With data parallelism the replicas share one global batch; without, each pipeline is a
    # model of its own, trained on its own half.
    half = slice(dp_rank * 2 * M, (dp_rank + 1) * 2 * M)
    ref_x, ref_y = (x, y) if wrapper else (x[half], y[half])
    loss_fn(call_chain(ref, ref_x), ref_y).backward()
    ref_params = [p for m in ref for p in m.parameters()]
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in ref_params], norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref_params, float(unclipped) / 2, norm_type)

    def wrap(mod):
        if wrapper == "ddp":
            return DDP(mod, process_group=dp_group)
        return fully_shard(mod, mesh=mesh["dp"]) if wrapper == "fsdp" else mod

    mine = local_stages(program, pp_rank)
    stages = [zbpipe.PipelineStage(wrap(mods[s]), s, program.num_stages, "cpu", group=pp_group) for s in mine]
    cls = zbpipe.get_schedule_class(name)
    sched = cls(stages[0] if issubclass(cls, zbpipe.PipelineScheduleSingle) else stages, M, loss_fn=loss_fn)
    sched.step(*((x[half],) if 0 in mine else ()), target=y[half] if program.num_stages - 1 in mine else None)
    what = stages if by == "stages" else [p for s in mine for p in mods[s].parameters()]
    got = zbpipe.clip_grad_norm_(what, float(unclipped) / 2, norm_type, group=None if by == "stages" else pp_group)
    assert_close(got, want, msg=f"{name} {wrapper} {norm_type}: total norm")
    assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine], msg=f"{name} {wrapper} {norm_type}")
    return float(got)


CASES = [("1f1b", None, "stages"), ("zbv", None, "params"), ("1f1b", "ddp", "stages"),
         ("zb_h1", "ddp", "params"), ("1f1b", "fsdp", "stages"), ("zbv", "fsdp", "stages")]


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["norm2", "inf"])
@pytest.mark.parametrize("name,wrapper,by", CASES, ids=[f"{n}-{w or 'pp'}-{b}" for n, w, b in CASES])
def test_clipping_equals_the_whole_model_in_one_process(spawn_world, name, wrapper, by, norm_type):
    norms = spawn_world(PP * DP).run(_clip, name, wrapper, norm_type, by, timeout_s=180)
    # Every rank of a pipeline returns the same total (with data parallelism: every rank).
    assert norms[0] == norms[1] and norms[2] == norms[3], norms
    if wrapper:
        assert norms[0] == norms[2], norms


def _local_only(rank, world):
    """Over a group of one rank (a plain module, no pipeline) the function is torch's."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 4)).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    alone = [torch.distributed.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    got = zbpipe.clip_grad_norm_(b, 0.1, group=alone)
    assert_close(got, want)
    assert_grads_close(b, a)
    return float(got)


def test_a_group_of_one_is_torch_clipping(spawn_world):
    norms = spawn_world(PP * DP).run(_local_only, timeout_s=60)
    assert len(set(norms)) == 1 and norms[0] > 0.1, norms
