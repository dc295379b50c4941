"""One way to build a rank's stages and schedule object with zbpipe or with
torch.distributed.pipelining, from a schedule's compile name (`zbv`, `1f1b`, ...).

zbpipe mirrors torch's class names, so the trainer and the benchmarks drive both libraries
through the same code. Which schedules exist, their classes and where each stage lives all come
from zbpipe itself (zbpipe.schedule_names, zbpipe.get_schedule_class, a compiled program's
stage_to_rank): nothing here repeats the core's registry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zbpipe

LIBRARIES = ("zbpipe", "torch")


def training_schedules() -> list[str]:
    """The compile names of every schedule that trains (all but the forward-only ones)."""
    return [n for n in zbpipe.schedule_names() if not zbpipe.get_schedule_class(n).forward_only]


def torch_schedules() -> list[str]:
    """The compile names of the schedules torch.distributed.pipelining also has."""
    import torch.distributed.pipelining as tp

    return [n for n in zbpipe.schedule_names() if hasattr(tp, zbpipe.get_schedule_class(n).__name__)]


def _library(lib: str) -> Any:
    if lib == "torch":
        import torch.distributed.pipelining as tp

        return tp
    if lib == "zbpipe":
        return zbpipe
    raise ValueError(f"unknown library '{lib}'; choose from {LIBRARIES}")


def schedule_class(lib: str, schedule: str) -> type:
    """The schedule class of `lib` for a compile name; raises ValueError where `lib` has none."""
    name = zbpipe.get_schedule_class(schedule).__name__
    cls = getattr(_library(lib), name, None)
    if cls is None:
        raise ValueError(f"torch.distributed.pipelining has no '{schedule}' schedule")
    return cls


def topology(schedule: str, pp: int, microbatches: int, stages_per_rank: int | None = None) -> zbpipe.Program:
    """The schedule compiled for (pp, microbatches): its num_stages and stage_to_rank place the
    stages for either library. Raises zbpipe.ScheduleError on sizes the schedule refuses."""
    return zbpipe.compile(schedule, pp, microbatches, stages_per_rank)


def local_stages(program: zbpipe.Program, rank: int) -> list[int]:
    """Stage indices that live on `rank`, in increasing order."""
    return [s for s, r in enumerate(program.stage_to_rank) if r == rank]


def build_pipeline(
    lib: str,
    program: zbpipe.Program,
    modules: Sequence[nn.Module],
    rank: int,
    device: torch.device,
    loss_fn: Callable[..., torch.Tensor] | None,
    group: dist.ProcessGroup | None = None,
    io_examples: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    schedule_kwargs: dict[str, Any] | None = None,
    schedule_cls: type | None = None,
) -> tuple[Any, list[int]]:
    """Wraps this rank's stages of `modules` (all stages, indexed by stage) and builds the
    schedule `program` was compiled for (its microbatch count, its stage placement). Returns
    (schedule, local stage indices). `io_examples(stage)` gives example (input, output)
    microbatch tensors for static shape declaration; `wrap(module)` wraps each local stage
    module (e.g. in DistributedDataParallel over its replica group) and `group` is the
    pipeline's process group (default: the world); `schedule_kwargs` go to the schedule class
    (e.g. zbpipe's static_shapes=True); `schedule_cls` replaces the program's class (e.g.
    zbpipe.ScheduleAuto over the program's placement)."""
    cls = schedule_cls or schedule_class(lib, program.schedule)
    mod = _library(lib)
    local = local_stages(program, rank)
    stages = []
    for s in local:
        kwargs: dict[str, Any] = {"group": group}
        if io_examples is not None:
            kwargs["input_args"], kwargs["output_args"] = io_examples(s)
        module = modules[s].to(device)
        stages.append(mod.PipelineStage(wrap(module) if wrap else module, s, len(modules), device, **kwargs))
    # Single-stage schedule classes take the stage itself, multi-stage ones the list (PyTorch's API).
    single = schedule_cls is None and issubclass(zbpipe.get_schedule_class(program.schedule),
                                                 zbpipe.PipelineScheduleSingle)
    arg = stages[0] if single else stages
    return cls(arg, program.microbatches, loss_fn=loss_fn, **(schedule_kwargs or {})), local
