"""Where `zbpipe bench` runs: a spawned local world of pp processes (zbpipe/launch.py), or,
under torchrun (its variables set), torchrun's world, one rank per process, across nodes: it
joins as `zbpipe train` does (zbpipe.torchrun: --device cuda takes LOCAL_RANK's GPU, NCCL, with
Gloo for the CPU objects) and needs WORLD_SIZE == pp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import torchrun
from ..launch import rank_device, run_local
from .config import BenchConfig, BenchError
from .worker import bench_rank


def _local_rank_main(rank: int, world: int, cfg: BenchConfig) -> dict | None:
    gathered = bench_rank(rank, world, cfg, rank_device())
    return gathered if rank == 0 else None


def _torchrun(env: torchrun.TorchrunEnv, cfg: BenchConfig) -> dict | None:
    if env.world_size != cfg.pp:
        raise BenchError(f"under torchrun the world is the pipeline: WORLD_SIZE={env.world_size} but --pp={cfg.pp}")
    try:
        torchrun.rank_device(env, cfg.device)  # before joining: a clear error, not a hang
    except ValueError as e:
        raise BenchError(str(e)) from None
    device = torchrun.init_process_group(env, cfg.device, timeout_s=cfg.group_timeout_s)
    try:
        gathered = bench_rank(env.rank, env.world_size, cfg, device)
    finally:
        dist.destroy_process_group()
    return gathered if env.rank == 0 else None


def launch(cfg: BenchConfig) -> dict | None:
    """The gathered measurements on the reporting process (the parent, or torchrun's rank 0);
    None on torchrun's other ranks."""
    try:
        env = torchrun.torchrun_env()
    except ValueError as e:
        raise BenchError(str(e)) from None
    if env is not None:
        return _torchrun(env, cfg)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: torch.cuda.is_available() is False")
    return run_local(_local_rank_main, cfg.pp, (cfg,), device=cfg.device, timeout_s=cfg.timeout_s,
                     pg_timeout_s=cfg.group_timeout_s)[0]
