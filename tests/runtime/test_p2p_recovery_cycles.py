"""Recovery is repeatable: each failure plus the recovery recipe of docs/runtime.md (destroy
the failed group, build a new group and schedule) releases the failed step's resources once
the old group is gone, so fds and threads stay flat over many cycles. pp=2 on Gloo, rank 1's
stage raises at its second training forward of every cycle (a step with receives in flight).

The long run (200 cycles under `ulimit -n 1024`, the figure reported in the issue):
    ulimit -n 1024; PYTHONPATH=. python tests/runtime/test_p2p_recovery_cycles.py 200
"""

from __future__ import annotations

import os
import sys
import threading

PP = 2


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _cycles(rank, size, n):
    """n failure + recovery cycles; returns the (fds, threads) seen after each one."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from helpers.model_registry import FaultyLinear

    import zbpipe

    seen = []
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(n):
        group = dist.new_group(list(range(size)), backend="gloo")
        stage = zbpipe.PipelineStage(FaultyLinear(fail_at=2 if rank == 1 else None), rank, size, "cpu", group=group)
        sched = zbpipe.Schedule1F1B(stage, 4, loss_fn=F.mse_loss, timeout=30)
        try:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == size - 1 else None)
        except zbpipe.PipelineError:
            pass
        else:
            raise AssertionError("the step was meant to fail")
        del sched, stage
        dist.destroy_process_group(group)
        del group
        dist.barrier()  # every rank dropped its group before the next cycle counts
        seen.append((_fds(), threading.active_count(), len(os.listdir("/proc/self/task"))))
    return seen


def _flat(seen, warmup):
    """The counts after the warm-up cycles never grow."""
    base = seen[warmup - 1]
    return all(s[0] <= base[0] and s[2] <= base[2] for s in seen[warmup:])


def test_failure_and_recovery_leave_fds_and_threads_flat(spawn_world):
    for rank, seen in enumerate(spawn_world(PP).run(_cycles, 16, timeout_s=120)):
        assert _flat(seen, 4), f"rank {rank}: (fds, python threads, os threads) per cycle {seen}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from zbpipe.train.launcher import LocalWorld

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    with LocalWorld(PP, gloo_devices=1) as world:
        for rank, seen in enumerate(world.run(_cycles, n, timeout_s=3600)):
            print(f"rank {rank}: cycle 1 {seen[0]}, cycle {n // 2} {seen[n // 2 - 1]}, cycle {n} {seen[-1]} "
                  f"(fds, python threads, os threads); flat after 4: {_flat(seen, 4)}")
