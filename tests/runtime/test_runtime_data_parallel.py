"""Stages wrapped in DistributedDataParallel or sharded with fully_shard (FSDP2) compose with the
pipeline: world 4 = pp 2 x dp 2 on Gloo, each replica a pipeline of its own on half of the global
batch. After two steps (gradients accumulate across steps) every local
parameter's gradient equals the one of the whole global batch run in one process, and the two
replicas of a stage hold the same gradients. Schedules 1f1b, zb_h1 (split I/W), zbv (V, two
stages per rank) and interleaved_zb (loop, two stages per rank), plus the deferred_linear
option on the split schedules.

All configurations run inside ONE spawned world of 4 ranks (2 CPU cores in CI).
"""

from __future__ import annotations

import copy

import torch

from _models import MODELS, build, call_chain, data
from _pp_world import run_world

PP, DP = 2, 2
RTOL, ATOL = 1e-4, 1e-6
SCHEDULES = [("1f1b", False), ("zb_h1", False), ("zbv", False), ("interleaved_zb", False),
             ("zb_h1", True), ("zbv", True)]
M = 4  # microbatches per replica per step


def _config(zbpipe, mesh, rank, name, deferred, wrapper):
    """One configuration; returns (max abs gradient error, failure or None, local grads)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dp_rank, pp_rank = mesh.get_coordinate()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    prog = zbpipe._C.build(name, PP, M)
    num_stages, stage_to_rank = prog.num_stages, list(prog.stage_to_rank)
    loss_fn = MODELS["mlp"][2]
    mods = build("mlp", num_stages)
    ref = copy.deepcopy(mods)
    steps = [data("mlp", 2 * M * DP, seed=3 + k) for k in range(2)]
    for x, y in steps:  # the whole global batch at once: the mean loss over every row
        loss_fn(call_chain(ref, x), y).backward()

    mine = [s for s in range(num_stages) if stage_to_rank[s] == pp_rank]
    wrapped = {}
    for s in mine:
        if wrapper == "ddp":
            wrapped[s] = DDP(mods[s], process_group=dp_group)
        else:
            wrapped[s] = fully_shard(mods[s], mesh=mesh["dp"])
    stages = [zbpipe.PipelineStage(wrapped[s], s, num_stages, "cpu", group=pp_group,
                                   deferred_linear=deferred) for s in mine]
    sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M,
                                            loss_fn=loss_fn, timeout=60)
    rows = slice(dp_rank * 2 * M, (dp_rank + 1) * 2 * M)  # this replica's half of the batch
    for x, y in steps:
        sched.step(*((x[rows],) if 0 in mine else ()), target=y[rows] if num_stages - 1 in mine else None)

    tag = f"{wrapper} {name} deferred={deferred} rank={rank}"
    worst, failure, grads = 0.0, None, []
    for s in mine:
        for (pname, p), q in zip(mods[s].named_parameters(), ref[s].parameters()):
            g = p.grad
            if g is not None and wrapper == "fsdp":
                g = g.full_tensor()  # collective over the replicas: same order on both
            if g is None:
                failure = failure or f"{tag}: stage {s} {pname} has no gradient"
                continue
            err = (g - q.grad).abs().max().item()
            worst = max(worst, err)
            if not torch.allclose(g, q.grad, rtol=RTOL, atol=ATOL) and failure is None:
                failure = f"{tag}: stage {s} grad of {pname} differs by {err:.3g}"
            grads.append(g.detach().flatten())
    dist.barrier()
    return worst, failure, torch.cat(grads).tolist() if grads else []


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


def _refusals(zbpipe, mesh, rank):
    """What the DDP reducer cannot do under a pipeline schedule is refused at construction."""
    from torch.nn.parallel import DistributedDataParallel as DDP

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


def _dp_world(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import zbpipe

    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    reshards = _count_reshards()
    out = {"errors": {}, "failures": [], "grads": {}, "reshards": {}}
    for wrapper in ("ddp", "fsdp"):
        for name, deferred in SCHEDULES:
            key = f"{wrapper}/{name}{'/deferred' if deferred else ''}"
            before = reshards["n"]
            try:
                worst, failure, grads = _config(zbpipe, mesh, rank, name, deferred, wrapper)
                out["reshards"][key] = reshards["n"] - before
            except Exception as e:  # noqa: BLE001 - reported, the world goes on
                import traceback

                out["failures"].append(f"{key} rank={rank}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
                return out  # a failed collective leaves the groups unusable
            out["errors"][key] = worst
            out["grads"][key] = grads
            if failure:
                out["failures"].append(failure)
    out["refusals"] = _refusals(zbpipe, mesh, rank)
    dist.barrier()
    return out


def test_ddp_and_fsdp_stages_match_the_global_batch():
    results, codes, leftover = run_world(PP * DP, _dp_world, timeout=400)
    assert not leftover, f"ranks {leftover} had to be killed"
    assert sorted(results) == list(range(PP * DP)), f"missing results: {results} (exit codes {codes})"
    for rank, res in results.items():
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert not res["failures"], "\n".join(res["failures"])
        assert len(res["errors"]) == 2 * len(SCHEDULES), res["errors"]
    print("max |grad - global batch| per configuration (worst rank):")
    for key in results[0]["errors"]:
        print(f"  {key:<28} {max(r['errors'][key] for r in results.values()):.3g}")
    for rank, res in results.items():
        stages_here = {name: 2 if name in ("zbv", "interleaved_zb") else 1 for name, _ in SCHEDULES}
        for name, deferred in SCHEDULES:
            key = f"fsdp/{name}{'/deferred' if deferred else ''}"
            # One group per stage module (fully_shard of the stage root), two steps.
            assert res["reshards"][key] == 2 * stages_here[name], (rank, key, res["reshards"][key])
        ref = res["refusals"]
        assert "DDP(static_graph=True) is not supported" in ref["static_graph"], ref
        assert "find_unused_parameters=True" in ref["find_unused_split"] and "splits" in ref["find_unused_split"], ref
        assert "communication hook" in ref["comm_hook_deferred"], ref
    # The replicas of a pipeline position (ranks p and p + PP) hold identical gradients.
    for p in range(PP):
        for key, g in results[p]["grads"].items():
            other = results[p + PP]["grads"][key]
            assert g and g == other, f"{key}: replicas of pp rank {p} disagree"
