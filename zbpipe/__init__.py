"""zbpipe: pipeline-parallel training with zero-bubble schedules and a C++ core.

Schedules are built, lowered, validated and simulated in C++ (``zbpipe._C``); a C++ executor
runs them over a torch.distributed process group; this package keeps thin Python wrappers.
"""

import sys as _sys

import torch  # must load before _C: _C links against torch's libraries

__version__ = "0.1.0"

# Before _C: a _C compiled against another torch may not even load (zbpipe/_build_check.py).
from ._build_check import built_torch as _built_torch, check_torch as _check_torch  # noqa: E402

_check_torch(_built_torch(), torch.__version__, __version__)

from ._C import Action, Kind, PipelineError, Program, ScheduleError, SimResult, SpanBound  # noqa: E402
from .clipping import clip_grad_norm_  # noqa: E402
from .module_split import split_by_fqn  # noqa: E402
from .partition import PartitionPlan, plan_partition  # noqa: E402
from .programs import (  # noqa: E402
    compile,
    lower_bound,
    refine,
    schedule_names,
    schedule_options,
    simulate,
)
from .schedules import (  # noqa: E402
    PipelineContext,
    PipelineSchedule,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInference,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleVHalf,
    ScheduleVMin,
    ScheduleZBAuto,
    ScheduleZBH1,
    ScheduleZBH2,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from .tuning.schedule_auto import ScheduleAuto  # noqa: E402
from .stage import PipelineStage  # noqa: E402
from .tuning.stage_costs import profile_from_trace  # noqa: E402
from .vocab_embedding import VocabParallelEmbedding  # noqa: E402
from .vocab_parallel import VocabParallelOutput  # noqa: E402
from . import tuning  # noqa: E402

# The tuning modules' old paths (before zbpipe/tuning/): zbpipe.schedule_auto is
# zbpipe.tuning.schedule_auto, the module itself, so imports, attributes and patches all reach it.
for _name in tuning.MODULES:
    globals()[_name] = _sys.modules[f"{__name__}.{_name}"] = _sys.modules[f"{__name__}.tuning.{_name}"]
del _name

__all__ = [
    "Action",
    "Kind",
    "PartitionPlan",
    "Pipe",
    "PipeInfo",
    "PipelineContext",
    "PipelineError",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Program",
    "Schedule1F1B",
    "ScheduleAuto",
    "ScheduleDualPipeV",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInference",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleVHalf",
    "ScheduleVMin",
    "ScheduleZBAuto",
    "ScheduleZBH1",
    "ScheduleZBH2",
    "ScheduleZBVZeroBubble",
    "SimResult",
    "SpanBound",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "SplitPoint",
    "build_stage",
    "clip_grad_norm_",
    "compile",
    "get_schedule_class",
    "lower_bound",
    "pipe_split",
    "pipeline",
    "plan_partition",
    "profile_from_trace",
    "refine",
    "schedule_names",
    "schedule_options",
    "simulate",
    "split_by_fqn",
]

# The tracer front end (zbpipe/pipe.py) loads torch.distributed.pipelining and torch.export:
# imported on first use, so `import zbpipe` stays fast.
_PIPE_NAMES = ("Pipe", "PipeInfo", "SplitPoint", "build_stage", "pipe_split", "pipeline")


def __getattr__(name):
    if name in _PIPE_NAMES:
        from . import pipe

        return getattr(pipe, name)
    raise AttributeError(f"module 'zbpipe' has no attribute '{name}'")
