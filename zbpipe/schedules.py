"""Schedule classes with torch.distributed.pipelining's names and step() semantics, each a
thin mapping to a zbpipe.compile() name; the C++ executor runs the compiled program.

    sched = zbpipe.Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    out = sched.step(x, target=y, losses=losses)   # x on the first stage, y on the last
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import _C
from .schedule_api import compile as _compile
from .stage import PipelineStage


@functools.lru_cache(maxsize=256)
def _cached_program(name: str, pp: int, microbatches: int, stages_per_rank: int, forward_only: bool,
                    options: tuple = ()):
    """Compiled (lowered, validated) program, cached per schedule, microbatch count and compile
    options (costs and memory cap for cost-driven schedules such as zb_auto)."""
    if not forward_only:
        return _compile(name, pp, microbatches, stages_per_rank or None, **dict(options))
    # Forward only: the schedule's forwards, in its order and topology, lowered and validated.
    return _C.lower(_C.strip_backward(_C.build(name, pp, microbatches, stages_per_rank)))


def _split(value: Any, n: int, what: str) -> list:
    """Chunks along dim 0 into n equal microbatches (tensors); other values are replicated."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.size(0) % n != 0:
            size = value.size(0) if value.dim() else "a 0-d tensor"
            raise ValueError(
                f"zbpipe: {what} has batch size {size}, which is not divisible by "
                f"n_microbatches={n}"
            )
        return list(value.split(value.size(0) // n))
    if isinstance(value, (tuple, list)):
        cols = [_split(v, n, f"{what}[{i}]") for i, v in enumerate(value)]
        return [type(value)(c[i] for c in cols) for i in range(n)]
    if isinstance(value, dict):
        cols = {k: _split(v, n, f"{what}[{k!r}]") for k, v in value.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(n)]
    return [value] * n


def _merge(chunks: list) -> Any:
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(chunks) if first.dim() > 0 else torch.stack(chunks)
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([c[i] for c in chunks]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _merge([c[k] for c in chunks]) for k in first}
    return chunks


class PipelineSchedule:
    """Base of every schedule class: `schedule` is the zbpipe.compile() name.

    Args:
        stages: this rank's PipelineStage, or the list of them (multi-stage schedules).
        n_microbatches: microbatches per step (the batch must split evenly).
        loss_fn: loss_fn(output, target) on the last stage; None runs forward only.
        scale_grads: gradients of the mean microbatch loss (as one full-batch mean loss); the
            scaling is applied to each microbatch loss before its backward, so gradients
            accumulated from earlier steps are not rescaled.
        timeout: seconds any single wait may take before the step fails on this rank.
        device_timing: record per-action device times (accelerators) in trace().
        compile_options: extra zbpipe.compile() arguments, e.g. for zb_auto
            dict(f=..., b=..., w=..., comm=..., memory_cap=...) (measured stage costs).
        prepost_receives: on Gloo, post every receive of a step when it starts (a send then
            finds its receive waiting); False posts each at its RECV action, as on NCCL,
            holding fewer receive buffers at a time.
        stream_ordered: post and wait as on NCCL (every batch coalesced where the backend
            can, receives at their RECV action, waits polled against the timeout). None: from
            the device (True off the CPU); True on a CPU group runs NCCL's discipline over Gloo.
        overlap_f_b: run the two halves of each OVERLAP_F_B unit (DualPipeV) at the same time:
            the backward (C++ autograd) on a worker thread, with its own stream on
            accelerators, while this thread runs the forward; the forward's SEND goes out as
            soon as it finishes. False runs them in sequence. Only the executor's own halves
            overlap: no hook for model-level overlap (MoE dispatch/combine) yet.
    """

    schedule: str = ""
    forward_only: bool = False  # the schedule has no backward (inference)

    def __init__(
        self,
        stages: PipelineStage | list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        *,
        args_chunk_spec=None,
        kwargs_chunk_spec=None,
        output_merge_spec=None,
        scale_grads: bool = True,
        timeout: float = 300.0,
        device_timing: bool = False,
        compile_options: dict | None = None,
        prepost_receives: bool = True,
        stream_ordered: bool | None = None,
        overlap_f_b: bool = True,
        _program: _C.Program | None = None,
    ):
        if args_chunk_spec is not None or kwargs_chunk_spec is not None or output_merge_spec is not None:
            raise NotImplementedError(
                "zbpipe splits tensors along dim 0 and concatenates outputs along dim 0; custom "
                "chunk/merge specs are not supported")
        self._stages = [stages] if isinstance(stages, PipelineStage) else sorted(stages, key=lambda s: s.stage_index)
        if not self._stages:
            raise ValueError("a schedule needs at least one stage")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        group = self._stages[0].group
        for s in self._stages:
            if s.group is not group and s.group_size != self._stages[0].group_size:
                raise ValueError("all stages of a schedule must share one process group")
        self._n = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None and not self.forward_only
        self._scale_grads = scale_grads
        self._timeout = float(timeout)
        self._device_timing = device_timing
        self._prepost_receives = prepost_receives
        self._stream_ordered = stream_ordered
        self._overlap_f_b = overlap_f_b
        self._group = group
        pp = self._stages[0].group_size
        num_stages = self._stages[0].num_stages
        if num_stages % pp != 0:
            raise ValueError(f"num_stages={num_stages} is not a multiple of the group size {pp}")
        if _program is not None:
            if _program.pp != pp or _program.num_stages != num_stages:
                raise ValueError(
                    f"program '{_program.schedule}' has pp={_program.pp}, num_stages="
                    f"{_program.num_stages}; the stages say pp={pp}, num_stages={num_stages}")
            self._program = _program
        else:
            options = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                   for k, v in (compile_options or {}).items()))
            self._program = _cached_program(self.schedule, pp, n_microbatches, num_stages // pp,
                                            not self._has_backward, options)
        self._executor: _C.Executor | None = None

    @property
    def program(self) -> _C.Program:
        return self._program

    @classmethod
    def from_program(cls, stages, program: _C.Program, loss_fn: Callable | None = None, **kwargs) -> "PipelineSchedule":
        """A schedule running a given lowered program (e.g. zbpipe.Program.from_csv of a
        PyTorch CSV); its microbatch count is the program's."""
        self = cls.__new__(cls)
        self.schedule = program.schedule
        PipelineSchedule.__init__(self, stages, program.microbatches, loss_fn, _program=program, **kwargs)
        return self

    def _get_executor(self) -> _C.Executor:
        if self._executor is None:
            self._executor = _C.Executor(
                self._program,
                self._group,
                {s.stage_index: s for s in self._stages},
                self._stages[0].device,
                self._timeout,
                self._device_timing,
                self._prepost_receives,
                self._stream_ordered,
                self._overlap_f_b,
            )
        return self._executor

    def step(self, *args, target=None, losses: list | None = None, **kwargs):
        """One pipelined step over the whole batch: args on the first stage's rank, target on
        the last; kwargs (chunked when they are tensors) reach every stage. Gradients
        accumulate into .grad. Returns the merged output on the last stage, else None."""
        n = self._n
        mb_args = _split(tuple(args), n, "argument") if any(s.is_first for s in self._stages) else None
        mb_kwargs = _split(dict(kwargs), n, "keyword argument") if kwargs else None
        mb_targets = None
        has_last = any(s.is_last for s in self._stages)
        if has_last and self._loss_fn is not None and (target is not None or self._has_backward):
            if target is None:
                raise ValueError("zbpipe: the last stage needs target= when a loss_fn is set")
            mb_targets = _split(target, n, "target")
        for s in self._stages:
            s._begin(mb_args if s.is_first else None, mb_kwargs, mb_targets if s.is_last else None,
                     self._loss_fn if mb_targets is not None else None, self._has_backward)
        try:
            self._get_executor().run(1.0 / n if self._scale_grads else 1.0)
            last = next((s for s in self._stages if s.is_last), None)
            if last is None:
                return None
            if losses is not None and mb_targets is not None:
                losses.extend(last.losses[i] for i in range(n))
            return _merge([last.outputs[i] for i in range(n)])
        finally:
            for s in self._stages:
                s._end()

    def trace(self) -> list[dict]:
        """Per-action timing of the last step (host ns; device us when timed)."""
        return self._executor.trace() if self._executor is not None else []

    def export_chrome_trace(self, path: str) -> None:
        if self._executor is None:
            raise RuntimeError("no step has run yet")
        self._executor.export_chrome_trace(path)


def _schedule_class(class_name: str, schedule: str, doc: str = "", forward_only: bool = False) -> type:
    """A schedule class for a compile() name: one line per schedule."""
    attrs = {"schedule": schedule, "forward_only": forward_only,
             "__doc__": doc or f"zbpipe '{schedule}' schedule.", "__module__": __name__}
    return type(class_name, (PipelineSchedule,), attrs)


ScheduleGPipe = _schedule_class("ScheduleGPipe", "gpipe", "All forwards, then all backwards.")
Schedule1F1B = _schedule_class("Schedule1F1B", "1f1b", "One forward, one backward (PipeDream-flush).")
ScheduleLoopedBFS = _schedule_class("ScheduleLoopedBFS", "looped_bfs", "Looped breadth-first, several stages per rank.")
ScheduleInterleaved1F1B = _schedule_class("ScheduleInterleaved1F1B", "interleaved_1f1b", "Interleaved 1F1B (Megatron virtual stages).")
ScheduleInterleavedZeroBubble = _schedule_class("ScheduleInterleavedZeroBubble", "interleaved_zb", "Interleaved zero bubble (ZB1P).")
ScheduleZBVZeroBubble = _schedule_class("ScheduleZBVZeroBubble", "zbv", "Zero bubble V schedule (two stages per rank).")
ScheduleDualPipeV = _schedule_class("ScheduleDualPipeV", "dualpipev", "DualPipeV on a V: the forward and backward of each OVERLAP_F_B pair run concurrently (overlap_f_b=False: in sequence).")
ScheduleZBH1 = _schedule_class("ScheduleZBH1", "zb_h1", "Zero bubble H1 (1F1B memory).")
ScheduleZBH2 = _schedule_class("ScheduleZBH2", "zb_h2", "Zero bubble H2 (zero bubble, more memory).")
ScheduleZBAuto = _schedule_class("ScheduleZBAuto", "zb_auto", "Cost-driven zero bubble under an activation cap (pass compile_options with measured costs).")
ScheduleVHalf = _schedule_class("ScheduleVHalf", "v_half", "Controllable-memory V schedule, about 1/2 of 1F1B's activations.")
ScheduleVMin = _schedule_class("ScheduleVMin", "v_min", "Controllable-memory V schedule, about 1/3 of 1F1B's activations.")
ScheduleInference = _schedule_class("ScheduleInference", "inference", "Forward only (a loss_fn is still applied to report losses).", forward_only=True)

_CLASSES = [
    ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleZBH1,
    ScheduleZBH2, ScheduleZBAuto, ScheduleVHalf, ScheduleVMin, ScheduleInference,
]


def _norm(name: str) -> str:
    n = name.lower().replace("_", "").replace("-", "")
    return n[len("schedule"):] if n.startswith("schedule") else n


def get_schedule_class(name: str) -> type:
    """PyTorch's schedule names (case-insensitive: "1F1B", "Interleaved1F1B", "ZBVZeroBubble",
    "ScheduleGPipe", ...) or zbpipe.compile() names ("zbv", "zb_h1", ...). A compile() name
    without a named class gets a generated one."""
    key = _norm(name)
    for cls in _CLASSES:
        if key in (_norm(cls.__name__), _norm(cls.schedule)):
            return cls
    for sched in _C.schedule_names():
        if key == _norm(sched):
            cls = _schedule_class("Schedule_" + sched, sched)
            _CLASSES.append(cls)
            return cls
    valid = sorted({c.__name__ for c in _CLASSES} | set(_C.schedule_names()))
    raise ValueError(f"unknown schedule '{name}' (valid: {', '.join(valid)})")
