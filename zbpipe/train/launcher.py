"""The old path of the local launcher, which is zbpipe/launch.py now (beside torchrun.py): its
public names, for code that imports them from here."""

from ..launch import LocalWorld, RankFailure, rank_device, run_local

__all__ = ["LocalWorld", "RankFailure", "rank_device", "run_local"]
