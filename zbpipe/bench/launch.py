"""Where `zbpipe bench` runs: a spawned local world of pp processes (zbpipe.train.launcher), or,
under torchrun (WORLD_SIZE set), torchrun's world, one rank per process, across nodes.

The torchrun handling here is bench's own and minimal: it reads RANK, WORLD_SIZE, LOCAL_RANK
(and MASTER_ADDR / MASTER_PORT through init_method="env://"), binds cuda:LOCAL_RANK on
--device cuda (NCCL; Gloo for the CPU objects) and needs WORLD_SIZE == pp.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .config import BenchConfig, BenchError
from .worker import bench_rank


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _local_rank_main(rank: int, world: int, cfg: BenchConfig) -> dict | None:
    from ..train.launcher import rank_device

    gathered = bench_rank(rank, world, cfg, rank_device())
    return gathered if rank == 0 else None


def _torchrun(cfg: BenchConfig) -> dict | None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != cfg.pp:
        raise BenchError(f"under torchrun the world is the pipeline: WORLD_SIZE={world} but --pp={cfg.pp}")
    timeout = datetime.timedelta(seconds=cfg.timeout_s / 3)
    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method="env://", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    try:
        gathered = bench_rank(rank, world, cfg, device)
    finally:
        dist.destroy_process_group()
    return gathered if rank == 0 else None


def launch(cfg: BenchConfig) -> dict | None:
    """The gathered measurements on the reporting process (the parent, or torchrun's rank 0);
    None on torchrun's other ranks."""
    if under_torchrun():
        return _torchrun(cfg)
    from ..train.launcher import run_local

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: torch.cuda.is_available() is False")
    return run_local(_local_rank_main, cfg.pp, (cfg,), device=cfg.device, timeout_s=cfg.timeout_s,
                     pg_timeout_s=min(300.0, cfg.timeout_s / 3))[0]
