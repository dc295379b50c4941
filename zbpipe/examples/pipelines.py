"""One table of schedules and one way to build stages + schedule for either library.

zbpipe mirrors torch.distributed.pipelining's names, so the demo and the benchmark drive both
through the same code: pick a library ("zbpipe" or "torch"), a schedule by its compile name
(`zbv`, `1f1b`, ...), and get the rank's local stages and the schedule object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ScheduleSpec:
    class_name: str  # the same in both libraries, minus the "Schedule" prefix
    stages_per_rank: int  # default; loop-style multi-stage schedules accept others
    style: str  # "loop" (stage s on rank s % pp) or "v" (down then back up)
    in_torch: bool  # torch.distributed.pipelining 2.13 has it


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("GPipe", 1, "loop", True),
    "1f1b": ScheduleSpec("1F1B", 1, "loop", True),
    "looped_bfs": ScheduleSpec("LoopedBFS", 2, "loop", True),
    "interleaved_1f1b": ScheduleSpec("Interleaved1F1B", 2, "loop", True),
    "interleaved_zb": ScheduleSpec("InterleavedZeroBubble", 2, "loop", True),
    "zb_h1": ScheduleSpec("ZBH1", 1, "loop", False),
    "zb_h2": ScheduleSpec("ZBH2", 1, "loop", False),
    "zbv": ScheduleSpec("ZBVZeroBubble", 2, "v", True),
    "dualpipev": ScheduleSpec("DualPipeV", 2, "v", True),
}

LIBRARIES = ("zbpipe", "torch")


def stage_to_rank(pp: int, num_stages: int, style: str) -> list[int]:
    """Rank of every stage: loop = round robin, v = 0..pp-1 then pp-1..0 (per V pair)."""
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    if num_stages != 2 * pp:
        raise ValueError(f"V schedules need num_stages == 2 * pp, got {num_stages} and pp={pp}")
    return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]


def num_stages_for(schedule: str, pp: int, stages_per_rank: int | None = None) -> int:
    spec = spec_for(schedule)
    spr = stages_per_rank or spec.stages_per_rank
    if spec.style == "v" and spr != 2:
        raise ValueError(f"schedule '{schedule}' needs exactly 2 stages per rank, got {spr}")
    if spec.stages_per_rank == 1 and spr != 1:
        raise ValueError(f"schedule '{schedule}' is single-stage, got stages_per_rank={spr}")
    return pp * spr


def spec_for(schedule: str) -> ScheduleSpec:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}'; choose from {sorted(SCHEDULES)}")
    return SCHEDULES[schedule]


def local_stages(schedule: str, rank: int, pp: int, num_stages: int) -> list[int]:
    """Stage indices that live on `rank`, in increasing order."""
    mapping = stage_to_rank(pp, num_stages, spec_for(schedule).style)
    return [s for s in range(num_stages) if mapping[s] == rank]


def _library(lib: str) -> Any:
    if lib == "torch":
        import torch.distributed.pipelining as mod
    elif lib == "zbpipe":
        import zbpipe as mod
    else:
        raise ValueError(f"unknown library '{lib}'; choose from {LIBRARIES}")
    return mod


def build_pipeline(
    lib: str,
    schedule: str,
    modules: Sequence[nn.Module],
    rank: int,
    pp: int,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    group: dist.ProcessGroup | None = None,
    io_examples: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    schedule_kwargs: dict[str, Any] | None = None,
) -> tuple[Any, list[int]]:
    """Wraps this rank's stages of `modules` (all stages, indexed by stage) and builds the
    schedule. Returns (schedule, local stage indices). `io_examples(stage)` gives example
    (input, output) microbatch tensors for static shape declaration; `schedule_kwargs` go to
    the schedule class (library-specific options)."""
    spec = spec_for(schedule)
    if lib == "torch" and not spec.in_torch:
        raise ValueError(f"torch.distributed.pipelining 2.13 has no {spec.class_name} schedule")
    mod = _library(lib)
    num_stages = len(modules)
    local = local_stages(schedule, rank, pp, num_stages)
    stages = []
    for s in local:
        kwargs: dict[str, Any] = {"group": group}
        if io_examples is not None:
            kwargs["input_args"], kwargs["output_args"] = io_examples(s)
        stages.append(mod.PipelineStage(modules[s].to(device), s, num_stages, device, **kwargs))
    cls = getattr(mod, "Schedule" + spec.class_name)
    # Single-stage schedule classes take the stage itself, multi-stage ones the list (PyTorch's API).
    arg = stages[0] if spec.stages_per_rank == 1 else stages
    return cls(arg, n_microbatches, loss_fn=loss_fn, **(schedule_kwargs or {})), local
