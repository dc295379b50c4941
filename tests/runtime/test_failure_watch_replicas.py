"""A failure reaches every rank of every data-parallel replica in bounded time: world 4 =
pp 2 x dp 2 on Gloo, stages wrapped in DistributedDataParallel (and one FSDP2 case), a stage of
replica 1 raising while its process stays alive (as a trainer that catches and logs would), or
its process SIGKILLed mid-step, on 1F1B and ZBV. The other replica would otherwise block in the
gradient sync's collective until its group's timeout (600 s here): every rank must instead end
with a PipelineError naming the failing rank, within the schedule's timeout (the run's own
bound, far below the groups' timeout, catches a hang; no timed assertion)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.nn.functional as F
from helpers.model_registry import FaultyLinear
from helpers.schedule_registry import rank_schedule
from zbpipe.train.launcher import RankFailure

PP, DP, M = 2, 2, 4
CULPRIT = 3  # dp 1, pp 1: stage 1 of replica 1
GROUP_TIMEOUT = datetime.timedelta(seconds=600)  # what a blocked collective would wait
STEP_TIMEOUT = 20.0  # the schedule's bound on every wait
RUN_BOUND_S = 90     # the test's bound on a whole scenario, far below GROUP_TIMEOUT


def _groups(rank):
    """Fresh pipeline and data-parallel groups (every rank creates all four, in order)."""
    import torch.distributed as dist

    pp = [dist.new_group([d * PP + p for p in range(PP)], timeout=GROUP_TIMEOUT) for d in range(DP)]
    dp = [dist.new_group([d * PP + p for d in range(DP)], timeout=GROUP_TIMEOUT) for p in range(PP)]
    return pp[rank // PP], dp[rank % PP]


def _scenario(rank, world, name, wrapper, failure):
    """One step on fresh groups; stage 1 of the culprit raises (or its process dies) at its
    second forward. Returns (exception type, message)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    pp_group, dp_group = _groups(rank)
    torch.manual_seed(0)
    num_stages = 4 if name == "zbv" else 2
    fault = {"raise": {"fail_at": 2}, "kill": {"die_at": 2}}.get(failure, {})
    mods = [FaultyLinear(**(fault if rank == CULPRIT and s == 1 else {})) for s in range(num_stages)]

    def wrap(mod):
        if wrapper == "ddp":
            return DDP(mod, process_group=dp_group)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        return fully_shard(mod, mesh=DeviceMesh.from_group(dp_group, "cpu"))

    sched, mine = rank_schedule(name, mods, rank % PP, PP, M, group=pp_group, wrap=wrap,
                                loss_fn=F.mse_loss, timeout=STEP_TIMEOUT)
    x, y = torch.randn(2 * M, 8), torch.randn(2 * M, 8)
    try:
        sched.step(*((x,) if 0 in mine else ()), target=y if num_stages - 1 in mine else None)
    except Exception as e:  # noqa: BLE001 - the result is the point
        return type(e).__name__, str(e)
    return "ok", ""


def _warm(rank, world):
    """First use (imports, lazy init) outside the bounded runs."""
    return _scenario(rank, world, "1f1b", "ddp", "none")


@pytest.fixture(scope="module")
def world(spawn_world):
    w = spawn_world(PP * DP)
    assert [r[0] for r in w.run(_warm, timeout_s=300)] == ["ok"] * (PP * DP)
    return w


CASES = [("1f1b", "ddp"), ("zbv", "ddp"), ("1f1b", "fsdp")]


@pytest.mark.parametrize("name,wrapper", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_a_raising_rank_fails_both_replicas(world, name, wrapper):
    culprit = f"rank {CULPRIT} failed in stage 1 at action 1F1 (microbatch 1): ValueError: boom from inside the stage"
    results = world.run(_scenario, name, wrapper, "raise", timeout_s=RUN_BOUND_S)
    for rank, (kind, msg) in enumerate(results):
        assert kind == "PipelineError", (rank, kind, msg)
        first = msg.splitlines()[0]
        assert first == (culprit if rank == CULPRIT else "aborted because " + culprit), (rank, msg)
        if rank != CULPRIT:  # told, not timed out
            assert "did not reach it within" not in msg and "timeout 20" not in msg, (rank, msg)
    # The culprit names its place in its pipeline group (group rank 1 of world rank 3).
    assert f"rank {CULPRIT} is rank 1 of its pipeline group" in results[CULPRIT][1]


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_killed_rank_fails_both_replicas(world, name):
    world.run(_warm, timeout_s=300)  # the world a previous kill ended starts again here
    with pytest.raises(RankFailure, match=f"rank {CULPRIT} failed first: exited with code 3") as info:
        world.run(_scenario, name, "ddp", "kill", timeout_s=RUN_BOUND_S, settle_s=60)
    assert sorted(info.value.results) == [0, 1, 2]  # every survivor returned, each with its error
    for rank, (kind, msg) in info.value.results.items():
        assert kind == "PipelineError", (rank, kind, msg)
        # Its pipeline peer saw the connection drop and is the first to fail; every other rank
        # is told, through the pipeline or the data-parallel group, and names the dead rank.
        first = msg.splitlines()[0]
        assert f"from rank {CULPRIT} " in first or f"to rank {CULPRIT} " in first, (rank, msg)
        if rank != 2:
            assert first.startswith("aborted because rank 2 failed in stage "), (rank, msg)


def _lone_replicas(rank, world):
    """pp 1 x dp 2: one DDP stage per rank; rank 1 dies at its first training forward, rank 0
    sleeps 4 s in its own (Gloo sees the connection close meanwhile) and then reaches its
    gradient sync's meeting, whose post to the dead replica Gloo refuses."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zbpipe

    pipe = [dist.new_group([r], timeout=GROUP_TIMEOUT) for r in range(2)][rank]
    dp = dist.new_group([0, 1], timeout=GROUP_TIMEOUT)
    mod = FaultyLinear(die_at=1 if rank == 1 else None, sleep_at=1 if rank == 0 else None)
    stage = zbpipe.PipelineStage(DDP(mod, process_group=dp), 0, 1, "cpu", group=pipe)
    sched = zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss, timeout=STEP_TIMEOUT)
    try:
        sched.step(torch.randn(4, 8), target=torch.randn(4, 8))
    except Exception as e:  # noqa: BLE001 - the result is the point
        return type(e).__name__, str(e)
    return "ok", ""


def test_a_replica_dead_before_the_gradient_sync_is_named_not_glooed(spawn_world):
    """Nobody can report a lone replica's death (it has no pipeline peer): the survivor's meeting
    before the gradient sync, whose post Gloo refuses once the connection closed, names the
    replica after its grace for a report, instead of raising Gloo's own error at the post."""
    with pytest.raises(RankFailure, match="rank 1 failed first: exited with code 3") as info:
        spawn_world(2).run(_lone_replicas, timeout_s=RUN_BOUND_S, settle_s=60)
    kind, msg = info.value.results[0]
    assert kind == "PipelineError", (kind, msg)
    first = msg.splitlines()[0]
    assert "to reach its gradient sync failed" in first and "data-parallel group rank 1" in first, msg
