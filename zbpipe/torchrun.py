"""Joining the world torchrun started, for zbpipe's programs that otherwise spawn local ranks
(`zbpipe train`): one rank per process, on as many nodes as torchrun was given.

    env = torchrun_env()                  # None outside torchrun; ValueError if set only in part
    if env is not None:
        device = init_process_group(env, "cuda")   # LOCAL_RANK's GPU (NCCL, Gloo for CPU tensors)

torchrun (torch.distributed.run) sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
in every process it starts; the group joins through them (init_method env://, which also uses
the store of torchrun's agent). Gloo picks its network interface from GLOO_SOCKET_IFNAME, as
the user sets it (the local launcher's lo,lo would not reach another node).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

# What torchrun sets and a rank needs: its place in the world and where the world meets.
VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    """One process's place in a torchrun world."""

    world_size: int  # processes in the whole job, all nodes
    rank: int  # this process's rank in it
    local_rank: int  # its index on its node: which GPU it takes
    master_addr: str
    master_port: int


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"torchrun's {name} must be an integer, got {environ[name]!r}") from None


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's TorchrunEnv when torchrun's variables are set (os.environ by default),
    None when none is. Raises ValueError naming what is missing when only some are set, or
    naming the value that makes no sense."""
    environ = os.environ if environ is None else environ
    present = [v for v in VARIABLES if environ.get(v, "") != ""]
    if not present:
        return None
    missing = [v for v in VARIABLES if v not in present]
    if missing:
        raise ValueError(
            f"torchrun's variables are set only in part: {', '.join(missing)} missing "
            f"({', '.join(f'{v}={environ[v]}' for v in present)} set); launch with torchrun, which "
            "sets them all, or unset them to run on local processes")
    world, rank, local = (_integer(environ, v) for v in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    port = _integer(environ, "MASTER_PORT")
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"torchrun's RANK={rank}, LOCAL_RANK={local} and WORLD_SIZE={world} do not fit: "
                         "0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
    if not 0 < port < 65536:
        raise ValueError(f"torchrun's MASTER_PORT must be a TCP port, got {port}")
    return TorchrunEnv(world, rank, local, environ["MASTER_ADDR"], port)


def rank_device(env: TorchrunEnv, device: str) -> torch.device:
    """The device this rank computes on: cpu, or for "cuda" the GPU of its LOCAL_RANK on this
    node. ValueError when this node has no GPU for LOCAL_RANK."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"{count} visible" + (f" under CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "")
        raise ValueError(f"--device cuda: no GPU for LOCAL_RANK {env.local_rank} on this node ({seen}); "
                         "torchrun's --nproc-per-node must not exceed the node's GPUs")
    return torch.device("cuda", env.local_rank)


def init_process_group(env: TorchrunEnv, device: str = "cpu", timeout_s: float = 600.0) -> torch.device:
    """Joins torchrun's world as the default process group and returns this rank's device:
    Gloo on CPU; on CUDA, NCCL for CUDA tensors (and Gloo for the CPU ones a run exchanges),
    on LOCAL_RANK's GPU, made the current device. `timeout_s` bounds every collective."""
    dev = rank_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo",
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": dev} if dev.type == "cuda" else {}),
    )
    return dev
