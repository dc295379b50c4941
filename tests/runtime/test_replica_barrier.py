"""A replica that skips a step leaves the other replica no unbounded wait: world 4 = pp 2 x dp 2
on Gloo, stages wrapped in DistributedDataParallel, data-parallel groups with a 600 s timeout.
Replica 1 (ranks 2, 3) runs step 1, then stays alive without calling step 2 (as a trainer that
errored before `step` and is logging would). Step 2's first forward on replica 0 runs DDP's
bucket rebuild, a collective on the data-parallel group: before the fix rank 0 blocked in it
for the group's timeout. Now the replicas meet at every training step's start (polled against
the schedule's timeout, 5 s), and the Gloo data-parallel groups' collectives are bounded by the
schedule's timeout during a step (and given their own back after it), so both ranks of replica
0 raise PipelineError (the run's own bound, far below the groups' timeout, catches a hang; no
timed assertion)."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from helpers.model_registry import FaultyLinear
from helpers.schedule_registry import rank_schedule

PP, DP, M = 2, 2, 4
GROUP_TIMEOUT = datetime.timedelta(seconds=600)
STEP_TIMEOUT = 5.0
RUN_BOUND_S = 90


class _SeesTimeout(FaultyLinear):
    """Records its data-parallel group's own (Gloo) timeout at every training forward."""

    def __init__(self, group):
        super().__init__()
        self.group, self.seen = group, []

    def forward(self, x):
        if torch.is_grad_enabled():
            self.seen.append(self.group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        return super().forward(x)


def _own_timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _skips(rank, world, flags):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    pp = [dist.new_group([d * PP + p for p in range(PP)], timeout=GROUP_TIMEOUT) for d in range(DP)]
    dp = [dist.new_group([d * PP + p for d in range(DP)], timeout=GROUP_TIMEOUT) for p in range(PP)]
    pp_group, dp_group = pp[rank // PP], dp[rank % PP]
    torch.manual_seed(0)
    mods = [_SeesTimeout(dp_group) for _ in range(PP)]
    sched, mine = rank_schedule("1f1b", mods, rank % PP, PP, M, group=pp_group,
                                wrap=lambda m: DDP(m, process_group=dp_group), loss_fn=F.mse_loss,
                                timeout=STEP_TIMEOUT)
    x, y = torch.randn(2 * M, 8), torch.randn(2 * M, 8)

    def step():
        sched.step(*((x,) if 0 in mine else ()), target=y if PP - 1 in mine else None)

    step()
    mod = mods[rank % PP]
    # During the step the group's collectives were bounded by the schedule's timeout; after it,
    # the group has its own back.
    assert set(mod.seen) == {STEP_TIMEOUT} and _own_timeout(dp_group) == 600.0, (mod.seen, _own_timeout(dp_group))
    flags = Path(flags)
    if rank >= PP:  # replica 1 skips step 2, alive, until replica 0 has reported
        deadline = time.monotonic() + RUN_BOUND_S - 10
        while not all((flags / f"reported{r}").exists() for r in range(PP)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "skipped", ""
    t0 = time.monotonic()
    try:
        step()
        out = ("ok", "")
    except Exception as e:  # noqa: BLE001 - the result is the point
        out = (type(e).__name__, str(e))
    (flags / f"reported{rank}").touch()
    return out + (time.monotonic() - t0,)


def test_a_replica_skipping_a_step_does_not_freeze_the_other(spawn_world, tmp_path):
    results = spawn_world(PP * DP).run(_skips, str(tmp_path), timeout_s=RUN_BOUND_S + 120)
    assert [r[0] for r in results[PP:]] == ["skipped"] * PP, results
    for rank in range(PP):
        kind, msg, seconds = results[rank]
        print(f"rank {rank}: {kind} after {seconds:.1f} s: {msg.splitlines()[0]}")
        assert kind == "PipelineError", (rank, results[rank])
        # Each waited for its replica at the step's start (or was told the other did), never
        # inside the forward's collective.
        assert "to start step 2" in results[rank][1].splitlines()[0], results[rank][1]
