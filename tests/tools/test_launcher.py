"""The package's launcher (zbpipe.train.launcher): a world returns every rank's result, keeps its
processes across runs, ends every rank when one fails or the deadline passes (no hang, no
orphan), and starts afresh after a failure."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from zbpipe.train.launcher import LocalWorld, RankFailure, run_local


def _rank1_fails(rank, world):
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.recv(torch.empty(1), src=1)  # would wait for the process-group timeout without cleanup


def _sleeps(rank, world):
    time.sleep(60)


def _sums(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), os.getpid(), os.environ["GLOO_SOCKET_IFNAME"]


def _rank1_exits(rank, world):
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    return "survived"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_failed_rank_stops_the_others():
    # Rank 0 would wait in its recv for the group's timeout (600 s) without the cleanup.
    with LocalWorld(2, pg_timeout_s=600) as world:
        world.run(_sums, timeout_s=120)
        pids = world.pids
        with pytest.raises(RankFailure, match="rank 1 failed first: ValueError: rank 1 broke on purpose") as info:
            world.run(_rank1_fails, timeout_s=300)
        assert "rank 1 broke on purpose" in info.value.tracebacks[1]
        assert world.pids == [] and not any(_alive(p) for p in pids)


def test_deadline_stops_all_ranks():
    with pytest.raises(TimeoutError, match="exceeded 3 s"):
        run_local(_sleeps, 2, timeout_s=3)


def test_a_world_keeps_its_ranks_across_runs_and_restarts_after_a_failure():
    with LocalWorld(3, gloo_devices=2) as world:
        first = world.run(_sums, timeout_s=60)
        assert [r[0] for r in first] == [6.0, 6.0, 6.0]  # every rank's result
        assert len({r[1] for r in first}) == 3
        assert {r[2] for r in first} == {"lo,lo"}
        pids = world.pids
        assert [r[1] for r in world.run(_sums, timeout_s=30)] == pids  # the same processes
        with pytest.raises(RankFailure, match="rank 1 failed first: exited with code 3") as info:
            world.run(_rank1_exits, timeout_s=30, settle_s=10)
        assert info.value.results == {0: "survived", 2: "survived"}  # waited for by settle_s
        assert world.pids == []  # stopped
        again = world.run(_sums, timeout_s=60)
        assert [r[0] for r in again] == [6.0, 6.0, 6.0]
        assert not set(pids) & {r[1] for r in again}


def _store_kind(rank, world):
    from zbpipe import _C

    return _C._store_polled(dist.group.WORLD)


def test_the_world_rendezvous_on_a_tcp_store_the_control_plane_need_not_poll():
    # A FileStore (the launcher's rendezvous before) has no blocking wait: zbpipe's control plane
    # then polls it and every schedule of the world warns once.
    assert run_local(_store_kind, 2, timeout_s=120) == [False, False]
