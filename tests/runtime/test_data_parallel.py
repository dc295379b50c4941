"""Stages wrapped in DistributedDataParallel or sharded with fully_shard (FSDP2) compose with the
pipeline: world 4 = pp 2 x dp 2 on Gloo, each replica a pipeline of its own on half of the global
batch. After two steps (gradients accumulate across steps) every local
parameter's gradient equals the one of the whole global batch run in one process, and the two
replicas of a stage hold the same gradients. Schedules 1f1b, zb_h1 (split I/W), zbv (V, two
stages per rank) and interleaved_zb (loop, two stages per rank), plus the deferred_linear
option on the split schedules.

One case per configuration; all run in the module's one spawned world of 4 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.asserts import assert_grads_close
from helpers.model_registry import MODELS, build, call_chain, data
from helpers.schedule_registry import rank_schedule

import zbpipe

PP, DP = 2, 2
SCHEDULES = [("1f1b", False), ("zb_h1", False), ("zbv", False), ("interleaved_zb", False),
             ("zb_h1", True), ("zbv", True)]
M = 4  # microbatches per replica per step
_STATE: dict = {}  # per rank process: the device mesh and the reshard counter, made once


def _mesh_and_reshards():
    if not _STATE:
        from torch.distributed.device_mesh import init_device_mesh

        _STATE["mesh"] = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
        _STATE["reshards"] = _count_reshards()
    return _STATE["mesh"], _STATE["reshards"]


def _config(rank, world, name, deferred, wrapper, custom=False):
    """Two steps of one configuration, checked against the global batch in one process (an
    AssertionError names the parameter); returns (this rank's gradients flattened, the FSDP
    reshards during the steps). custom: every backward action runs through a registered
    function (register_custom_function), which must sync gradients as the built-in path does."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh, reshards = _mesh_and_reshards()
    dp_rank, pp_rank = mesh.get_coordinate()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    num_stages = zbpipe.compile(name, PP, M).num_stages
    loss_fn = MODELS["mlp"][2]
    mods = build("mlp", num_stages)
    ref = copy.deepcopy(mods)
    steps = [data("mlp", 2 * M * DP, seed=3 + k) for k in range(2)]
    for x, y in steps:  # the whole global batch at once: the mean loss over every row
        loss_fn(call_chain(ref, x), y).backward()

    def wrap(mod):
        return DDP(mod, process_group=dp_group) if wrapper == "ddp" else fully_shard(mod, mesh=mesh["dp"])

    sched, mine = rank_schedule(name, mods, pp_rank, PP, M, group=pp_group, wrap=wrap,
                                stage_kwargs=dict(deferred_linear=deferred), loss_fn=loss_fn, timeout=60)
    if custom:
        for kind in (zbpipe.Kind.B, zbpipe.Kind.I, zbpipe.Kind.W):
            sched.register_custom_function(kind, lambda action, ctx: ctx.run(action))
    before = reshards["n"]
    rows = slice(dp_rank * 2 * M, (dp_rank + 1) * 2 * M)  # this replica's half of the batch
    for x, y in steps:
        sched.step(*((x[rows],) if 0 in mine else ()), target=y[rows] if num_stages - 1 in mine else None)
    assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine], msg=f"{wrapper} {name} deferred={deferred}")
    grads = [(p.grad.full_tensor() if wrapper == "fsdp" else p.grad).flatten() for s in mine for p in mods[s].parameters()]
    return torch.cat(grads).tolist(), reshards["n"] - before


def _count_reshards():
    """Counts the FSDP parameter-group reshards that free unsharded parameters: zbpipe keeps a
    stage unsharded for the whole step, so one per group and step (FSDP alone: one per
    microbatch backward)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    counts = {"n": 0}
    original = FSDPParamGroup._to_sharded  # where every reshard that frees memory ends up

    def to_sharded(self):
        counts["n"] += not self.is_sharded
        return original(self)

    FSDPParamGroup._to_sharded = to_sharded
    return counts


def _refusals(rank, world):
    """What the DDP reducer cannot do under a pipeline schedule is refused at construction."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh, _ = _mesh_and_reshards()
    pp_rank = mesh.get_coordinate()[1]
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    out = {}
    cases = {
        "static_graph": (dict(static_graph=True), "1f1b", False),
        "find_unused_split": (dict(find_unused_parameters=True), "zb_h1", False),
        "comm_hook_deferred": ({}, "zb_h1", True),
    }
    for key, (kw, name, deferred) in cases.items():
        ddp = DDP(build("mlp", PP)[pp_rank], process_group=dp_group, **kw)
        if key == "comm_hook_deferred":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(dp_group, allreduce_hook)
        stage = zbpipe.PipelineStage(ddp, pp_rank, PP, "cpu", group=pp_group, deferred_linear=deferred)
        try:
            zbpipe.get_schedule_class(name)(stage, M, loss_fn=MODELS["mlp"][2])
            out[key] = "accepted"
        except ValueError as e:
            out[key] = str(e)
    return out


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("name,deferred", SCHEDULES, ids=[f"{n}{'-deferred' if d else ''}" for n, d in SCHEDULES])
def test_stages_match_the_global_batch(spawn_world, wrapper, name, deferred):
    results = spawn_world(PP * DP).run(_config, name, deferred, wrapper, timeout_s=300)
    # The replicas of a pipeline position (ranks p and p + PP) hold identical gradients.
    for p in range(PP):
        assert results[p][0] and results[p][0] == results[p + PP][0], f"replicas of pp rank {p} disagree"
    if wrapper == "fsdp":
        # One group per stage module (fully_shard of the stage root), two steps.
        stages_here = zbpipe.compile(name, PP, M).num_stages // PP
        assert [r[1] for r in results] == [2 * stages_here] * (PP * DP), results


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_custom_backward_functions_sync_gradients(spawn_world, name):
    # The last backward of a stage syncs its replicas' gradients also when a registered
    # function runs it (the gradients equal the global batch's, checked on every rank).
    results = spawn_world(PP * DP).run(_config, name, False, "ddp", True, timeout_s=300)
    for p in range(PP):
        assert results[p][0] and results[p][0] == results[p + PP][0], f"replicas of pp rank {p} disagree"


def test_ddp_options_the_pipeline_cannot_honour_are_refused(spawn_world):
    for ref in spawn_world(PP * DP).run(_refusals, timeout_s=120):
        assert "DDP(static_graph=True) is not supported" in ref["static_graph"], ref
        assert "find_unused_parameters=True" in ref["find_unused_split"] and "splits" in ref["find_unused_split"], ref
        assert "communication hook" in ref["comm_hook_deferred"], ref
