"""ExecutorRunner: a schedule's C++ executors and what lives from one step to the next.

One executor per program a schedule runs (its training program, and the forwards of its eval
steps), built at the first step that runs it; each stage's data parallelism as that executor
read it; the functions registered for custom actions (and the PipelineContext they get); the
call counts that failure messages name; the memory probe; and the executor of the last step,
whose trace (with the memory profile) the schedule reports. PipelineSchedule (schedules.py)
keeps the torch API and the program and builds each step's StepData (step_data.py).
"""

from __future__ import annotations

import json
import weakref
from typing import Callable

import torch.distributed as dist

from . import _C
from .control_plane import gloo_control_group, warn_if_default_nccl_group, warn_if_polled
from .group_timeout import warn_if_not_below
from .memory_probe import MemoryProbe, chrome_memory_events
from .step_data import StepData


class PipelineContext:
    """What a custom function gets besides the action (torch's _PipelineContext fields), plus
    run(part): the built-in computation of the action, or of one of its sub-actions."""

    def __init__(self, schedule, executor, step: StepData, losses):
        self.schedule_ref = schedule
        self.arg_mbs = step.args          # first stage's rank: per-microbatch positional args
        self.kwarg_mbs = step.kwargs      # per-microbatch keyword args (None without any)
        self.target_mbs = step.targets    # last stage's rank: per-microbatch targets
        self.losses = losses              # the list given to step (filled after the step)
        self.loss_kwargs = step.loss_kwargs
        self._executor = executor

    def run(self, part: _C.Action) -> None:
        """Runs `part` (the action itself, or a sub-action of an OVERLAP_F_B) as zbpipe would:
        waits on its receives, computes, hands its result on. Each part exactly once."""
        self._executor.run_part(part)


def _world_ranks(group) -> tuple[int, list[int]]:
    """(this rank's global rank, the global rank of each rank of `group`): messages name the
    world's ranks. (-1, []) for a group torch.distributed does not know (group ranks then)."""
    try:
        return dist.get_rank(), dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - an unregistered group, or no default group
        return -1, []


class ExecutorRunner:
    """The executor side of one schedule over this rank's `stages` (one process group).

    Args:
        stages: this rank's PipelineStages in stage order.
        options: the C++ Executor's keyword options (timeout_s, device_timing,
            prepost_receives, static_shapes, stream_ordered, overlap_f_b).
        measure_memory: measure every training step's memory deltas (memory_profile).

    A program change (bind_program) drops the executors; the next step builds them anew.
    """

    def __init__(self, stages: list, options: dict, measure_memory: bool = False):
        self._stages = stages
        self._group = stages[0].group
        self._world = _world_ranks(self._group)
        self._options = options
        self._split: dict[int, bool] = {}  # stage index -> whether the program splits its backward
        self._executors: dict[bool, _C.Executor] = {}  # training? -> executor of that program
        # training? -> whether each stage synced gradients when that executor was built
        self._syncs: dict[bool, list[bool]] = {}
        self._custom: dict[_C.Kind, Callable] = {}
        self._ctx: PipelineContext | None = None  # the running step's, for the custom functions
        # The user's step()/eval() calls so far: failure messages name the step by them.
        self._calls = {"step": 0, "eval": 0}
        self.measure_memory = measure_memory
        self.memory_profile: dict | None = None  # of the last probing step
        self.last: _C.Executor | None = None  # the executor of the last step (trace)

    @property
    def static_shapes(self) -> bool:
        return self._options["static_shapes"]

    # ---- the program and the stages' data parallelism ---------------------------------------

    def bind_program(self, prog: _C.Program) -> None:
        """Checks that each data-parallel stage can run `prog` (ValueError, the adapter's
        check, naming the stage) and drops the executors of the program before it."""
        # Which stages' backward the program splits into I and W (data parallelism checks it).
        self._split = {s.stage_index: any(a.kind == _C.Kind.I and a.stage == s.stage_index
                                          for a in prog.action_values(s.group_rank)) for s in self._stages}
        for s in self._stages:
            s._bind_data_parallel(self._split[s.stage_index])
        self._executors.clear()

    def _bind_data_parallel(self) -> list[bool]:
        """Every stage's data parallelism as its module is now (torchtitan applies fully_shard
        and assigns stage.submod after building the stages): whether each syncs gradients."""
        return [s._bind_data_parallel(self._split[s.stage_index]) for s in self._stages]

    def check_data_parallel(self, train: bool) -> None:
        """ValueError where a stage's module gained or lost data parallelism (fully_shard in
        place, a new stage.submod) after the executor that runs it read it at its first step."""
        for s, was, now in zip(self._stages, self._syncs[train], self._bind_data_parallel()):
            if was != now:
                raise ValueError(
                    f"stage {s.stage_index}: its module {'became' if now else 'is no longer'} "
                    f"data-parallel ({type(s.submod).__name__}) after this schedule's first step; "
                    "zbpipe reads a stage's data parallelism when a schedule first runs it: wrap "
                    "the module (and assign stage.submod) before that, or build a new schedule")

    def _sync_groups(self, train: bool) -> dict:
        """Stage index -> the data-parallel groups its gradient sync runs on (training only:
        an eval step syncs nothing). A failure crosses to the other replicas through them."""
        if not train:
            return {}
        return {s.stage_index: s._dp.groups() for s in self._stages if s._dp is not None}

    # ---- call counts: the "step N" of failure messages -------------------------------------

    def count(self, call: str) -> int:
        """Counts one more user call ("step" or "eval"); returns its number."""
        self._calls[call] += 1
        return self._calls[call]

    def set_call_counts(self, step: int | None = None, eval: int | None = None) -> None:
        if step is not None:
            self._calls["step"] = int(step)
        if eval is not None:
            self._calls["eval"] = int(eval)

    # ---- executors -------------------------------------------------------------------------

    def executor(self, train: bool, program_for: Callable[[bool], _C.Program]) -> _C.Executor:
        """The executor of the training (train) or eval program, built from program_for(train)
        at its first step, when it reads each stage's data parallelism. A failure to build it
        is told to the peers (and the data-parallel replicas), who would wait for this rank:
        ValueError and TypeError (the caller's arguments, ScheduleError too) raise as they
        are, any other (the device's, the backend's) as PipelineError, as the peers get it."""
        ex = self._executors.get(train)
        if ex is not None:
            return ex
        try:
            program = program_for(train)
            syncs = self._bind_data_parallel()
            sync_groups = self._sync_groups(train)
            warn_if_not_below(self._options["timeout_s"], [self._group, *_flat(sync_groups)],
                              self._stages[0].device)
            warn_if_default_nccl_group(self._group, self._stages[0].device)
            warn_if_polled(self._group)
            ex = _C.Executor(
                program, self._group, {s.stage_index: s for s in self._stages},
                self._stages[0].device, **self._options, global_rank=self._world[0],
                group_ranks=self._world[1], sync_groups=sync_groups, control_group=gloo_control_group)
        except Exception as e:  # tell the peers, whatever the device: they would wait for this rank
            what = f"{type(e).__name__}: {e}"
            _C.Executor.report_setup_failure(self._group, _flat(self._sync_groups(train)), self._world[0], what)
            if isinstance(e, (ValueError, TypeError)):  # the caller's arguments (ScheduleError too)
                raise
            rank = self._world[0] if self._world[0] >= 0 else self._group.rank()
            raise _C.PipelineError(f"rank {rank} failed while building its executor: {what}") from e
        self._executors[train] = ex
        self._syncs[train] = syncs
        self._install_custom(ex)
        return ex

    # ---- custom functions ------------------------------------------------------------------

    @property
    def custom_kinds(self) -> set:
        """The kinds a custom function is registered for."""
        return set(self._custom)

    def set_custom(self, kind: _C.Kind, fn: Callable) -> None:
        """fn(action, ctx) runs the actions of `kind` from now on, on every executor."""
        self._custom[kind] = fn
        for ex in self._executors.values():
            self._install_custom(ex)

    def _install_custom(self, ex: _C.Executor) -> None:
        fns = dict(self._custom)
        if not fns:
            ex.set_custom_actions(None, [])
            return

        owner = weakref.ref(self)  # the executor keeps dispatch: no cycle through C++

        def dispatch(action):
            fns[action.kind](action, owner()._ctx)

        ex.set_custom_actions(dispatch, list(fns))

    # ---- a step ----------------------------------------------------------------------------

    def run(self, executor: _C.Executor, step: StepData, first_inputs, loss_scale: float,
            schedule, losses) -> tuple[list, list]:
        """Runs `step` on `executor` (the last executor from now on), probing memory on a
        training step while measure_memory is on; returns the last stage's outputs and losses
        per microbatch. `schedule` and `losses` reach the custom functions' PipelineContext."""
        if self._custom:
            self._ctx = PipelineContext(schedule, executor, step, losses)
        self.last = executor
        probing = step.train and self.measure_memory
        if probing:
            step.memory_probe = MemoryProbe()
        executor.set_memory_probe(probing)
        try:
            outputs, mb_losses = executor.run(step, first_inputs, loss_scale)
        finally:
            self._ctx = None
        if probing:
            self.memory_profile = step.memory_probe.profile()
        return outputs, mb_losses

    def trace(self) -> list[dict]:
        return self.last.trace() if self.last is not None else []

    def export_chrome_trace(self, path: str) -> None:
        """The last step's trace as Chrome JSON, with the memory profile's counter events."""
        if self.last is None:
            raise RuntimeError("no step has run yet")
        self.last.export_chrome_trace(path)
        if self.memory_profile is not None:
            with open(path) as f:
                doc = json.load(f)
            doc["traceEvents"].extend(chrome_memory_events(self.memory_profile, self._group.rank()))
            with open(path, "w") as f:
                json.dump(doc, f)


def _flat(groups_by_stage: dict) -> list:
    return [g for gs in groups_by_stage.values() for g in gs]
