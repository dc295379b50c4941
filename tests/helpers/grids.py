"""Process-group layouts shared by tests that run in a spawned world."""

from __future__ import annotations

_GROUPS: dict = {}


def pp2_dp2_grid():
    """(pp group, dp group, pp rank, dp rank) of this rank in a 2 x 2 grid of a 4-rank world
    (ranks 0,1 and 2,3 are the pipelines), made once per process: new_group is a call of every
    rank."""
    if not _GROUPS:
        import torch.distributed as dist

        pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        r = dist.get_rank()
        _GROUPS["grid"] = (pp_groups[r // 2], dp_groups[r % 2], r % 2, r // 2)
    return _GROUPS["grid"]
