"""The local launcher ends every rank when one fails or the deadline passes (no hang, no orphan)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from zbpipe.examples.launcher import run_local


def _rank1_fails(rank, world, device):
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.recv(torch.empty(1), src=1)  # would wait for the process-group timeout without cleanup


def _sleeps(rank, world, device):
    time.sleep(60)


def _sums(rank, world, device, out_dir):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(f"{out_dir}/r{rank}", "w") as f:
        f.write(str(t.item()))


def test_failed_rank_stops_the_others():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed first: ValueError: rank 1 broke on purpose"):
        run_local(_rank1_fails, 2, timeout_s=30, pg_timeout_s=30)
    assert time.monotonic() - t0 < 20


def test_deadline_stops_all_ranks():
    with pytest.raises(TimeoutError, match="exceeded 3 s"):
        run_local(_sleeps, 2, timeout_s=3)


def test_ranks_share_a_process_group(tmp_path):
    run_local(_sums, 3, (str(tmp_path),), timeout_s=30)
    assert [float((tmp_path / f"r{r}").read_text()) for r in range(3)] == [6.0, 6.0, 6.0]
