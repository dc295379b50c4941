"""zbpipe: pipeline-parallel training with zero-bubble schedules and a C++ core.

Schedules are built, lowered, validated and simulated in C++ (``zbpipe._C``); this package
keeps thin Python wrappers around it.
"""

import torch  # noqa: F401  (must load before _C: _C links against torch's libraries)

from ._C import Action, Kind, Program, ScheduleError, SimResult  # noqa: E402
from .schedule_api import compile, schedule_names, simulate  # noqa: E402

__all__ = [
    "Action",
    "Kind",
    "Program",
    "ScheduleError",
    "SimResult",
    "compile",
    "schedule_names",
    "simulate",
]
__version__ = "0.1.0"

# Runtime: stages, schedule classes and the C++ executor's errors.
from ._C import PipelineError  # noqa: E402
from .schedules import (  # noqa: E402
    PipelineSchedule,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInference,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBH1,
    ScheduleZBH2,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from .stage import PipelineStage  # noqa: E402

__all__ += [
    "PipelineError",
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInference",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBH1",
    "ScheduleZBH2",
    "ScheduleZBVZeroBubble",
    "get_schedule_class",
]
