"""What one `zbpipe bench` run measures, checked before any process starts: the stages' costs
(per 1F1B stage, spread over a schedule's stages), the schedules and libraries, the launch.

Costs are in milliseconds per 1F1B stage (1/pp of the model), one value for every stage or one
per stage; a schedule with k stages per rank runs each slice as k stages costing 1/k of it and
saving 1/k of its activation, so every schedule runs the same model (as `zbpipe simulate`
spreads costs).
"""

from __future__ import annotations

import dataclasses
import math

from .. import _C
from ..cli import CliError
from ..programs import compile as compile_schedule
from ..programs import schedule_names

LIBRARIES = ("zbpipe", "torch")
DEVICES = ("cpu", "cuda")
MODELS = ("emulated", "trainer")
AC_MODES = ("off", "on", "both")
AUTO = "auto"  # the pseudo-schedule: zbpipe.ScheduleAuto over one stage per rank


class BenchError(CliError, ValueError):
    """Bad input to zbpipe bench, found before any process starts (the command's one-line error;
    a ValueError to Python callers of zbpipe.bench.run)."""


def training_schedules() -> list[str]:
    """Every schedule that trains (the default set)."""
    from ..schedules import get_schedule_class

    return [n for n in schedule_names() if not get_schedule_class(n).forward_only]


def torch_has(schedule: str) -> bool:
    """Whether torch.distributed.pipelining has a class of that schedule."""
    if schedule == AUTO:
        return False
    import torch.distributed.pipelining as tp

    from ..schedules import get_schedule_class

    return hasattr(tp, get_schedule_class(schedule).__name__)


@dataclasses.dataclass
class BenchConfig:
    """The run's settings; `check()` normalises the costs to one value per 1F1B stage."""

    pp: int = 4
    microbatches: int = 8
    schedules: list[str] = dataclasses.field(default_factory=training_schedules)
    f: list[float] = dataclasses.field(default_factory=lambda: [2.0])  # ms per 1F1B stage
    i: list[float] = dataclasses.field(default_factory=lambda: [2.0])
    w: list[float] = dataclasses.field(default_factory=lambda: [2.0])
    act: int = 256 * 1024  # bytes of one microbatch's activation (the message of a hop)
    model: str = "emulated"
    libs: list[str] = dataclasses.field(default_factory=lambda: list(LIBRARIES))
    reps: int = 5
    warmup: int = 2
    device: str = "cpu"
    ac: str = "off"  # torch.utils.checkpoint around every emulated block: off, on, both
    budget: float | None = None  # ScheduleAuto's activation_budget, bytes per rank
    timeout_s: float = 900.0

    def check(self) -> "BenchConfig":
        """Raises BenchError naming the bad value; fills per-stage cost lists. Compiles every
        schedule for (pp, microbatches), so a size a schedule refuses fails here."""
        if not (isinstance(self.pp, int) and self.pp >= 1):
            raise BenchError(f"--pp must be a positive integer, got {self.pp}")
        if not (isinstance(self.microbatches, int) and self.microbatches >= 1):
            raise BenchError(f"--microbatches must be a positive integer, got {self.microbatches}")
        if self.reps < 1 or self.warmup < 0:
            raise BenchError(f"--reps must be >= 1 and --warmup >= 0, got {self.reps}, {self.warmup}")
        for name in ("f", "i", "w"):
            values = [float(v) for v in getattr(self, name)]
            if len(values) not in (1, self.pp):
                raise BenchError(f"--{name} has {len(values)} values: give one, or one per stage (pp={self.pp})")
            bad = [v for v in values if not (math.isfinite(v) and v > 0)]
            if bad:
                raise BenchError(f"--{name}: every time must be a positive number of ms, got {bad[0]}")
            setattr(self, name, values * self.pp if len(values) == 1 else values)
        if not (isinstance(self.act, int) and self.act >= 4):
            raise BenchError(f"--act must be at least 4 bytes (one float), got {self.act}")
        for attr, allowed in (("model", MODELS), ("device", DEVICES), ("ac", AC_MODES)):
            if getattr(self, attr) not in allowed:
                raise BenchError(f"--{attr} must be one of {', '.join(allowed)}, got {getattr(self, attr)!r}")
        bad_libs = [lib for lib in self.libs if lib not in LIBRARIES]
        if bad_libs or not self.libs:
            raise BenchError(f"--lib takes a comma list of {', '.join(LIBRARIES)}, got {self.libs}")
        if self.model == "trainer" and self.ac != "off":
            raise BenchError("--ac applies to the emulated model only")
        if self.budget is not None and not self.budget > 0:
            raise BenchError(f"--budget must be a positive number of bytes, got {self.budget}")
        if not self.schedules:
            raise BenchError("--schedules is empty")
        known = training_schedules()
        for name in self.schedules:
            if name == AUTO:
                if self.model != "emulated":
                    raise BenchError("the 'auto' schedule (ScheduleAuto) runs on the emulated model only")
                continue
            if name not in known:
                raise BenchError(f"unknown or forward-only schedule {name!r}; training schedules: "
                                 f"{', '.join(known)}, or auto")
            try:
                compile_schedule(name, self.pp, self.microbatches)
            except _C.ScheduleError as exc:
                raise BenchError(f"{name} does not fit pp={self.pp} x microbatches={self.microbatches}: "
                                 f"{str(exc).splitlines()[0]}") from None
        if self.model == "trainer":
            self._check_trainer()
        return self

    def _check_trainer(self) -> None:
        from ..train.model import TinyConfig

        layers = TinyConfig().n_layers
        for name in self.schedules:
            n = compile_schedule(name, self.pp, self.microbatches).num_stages
            if n > layers:
                raise BenchError(f"--model trainer has {layers} blocks: {name} needs {n} stages at pp={self.pp}")

    @property
    def group_timeout_s(self) -> float:
        """The process group's own timeout (NCCL's watchdog ends the process past it)."""
        return min(300.0, self.timeout_s / 3)

    @property
    def schedule_timeout_s(self) -> float:
        """Every wait of a step: below the group's own timeout, so zbpipe raises its error
        (naming the rank and action) before NCCL's watchdog ends the process."""
        return 0.75 * self.group_timeout_s

    def stage_costs(self, num_stages: int) -> dict[str, list[float]]:
        """Per schedule stage (ms): each 1F1B stage's costs split evenly over its k stages."""
        k = num_stages // self.pp
        return {kind: [getattr(self, kind)[s // k] / k for s in range(num_stages)] for kind in "fiw"}

    def saved_elems(self, num_stages: int) -> int:
        """Float elements one stage saves per microbatch: the activation, split over k stages."""
        return max(1, self.act // 4 // (num_stages // self.pp))

    @property
    def width(self) -> int:
        """Float elements of one microbatch's activation (the message between stages)."""
        return self.act // 4
