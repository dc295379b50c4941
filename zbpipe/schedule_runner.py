"""ExecutorRunner: a schedule's C++ executors, what lives from one step to the next, and the
step itself (ExecutorRunner.step, whole: its executor, number, checks, stage scopes and failure
report).

One executor per program a schedule runs (its training program, and the forwards of its eval
steps), built at the first step that runs it; each stage's data parallelism as that executor
read it; the functions registered for custom actions (and the PipelineContext they get); the
call counts that failure messages name; the memory probe; and the executor of the last step,
whose trace (with the memory profile) the schedule reports. PipelineSchedule (schedules.py)
keeps the torch API and hands each step the way to build its StepData (step_data.py).
"""

from __future__ import annotations

import contextlib
import json
import weakref
from typing import Callable

import torch.distributed as dist

from . import _C
from .control_plane import gloo_control_group, warn_if_default_nccl_group, warn_if_polled
from .device_checks import check_stages
from .group_timeout import warn_if_not_below
from .tuning.memory_probe import MemoryProbe, chrome_memory_events
from .step_data import StepData, input_signature


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
        options: the ExecutorOptions every executor of the schedule gets whole.
        measure_memory: measure every training step's memory deltas (memory_profile).
        vocab: the schedule's VocabParallelOutput (output=), handed to executors of programs
            with vocabulary actions.
        embedding: the schedule's VocabParallelEmbedding (input_embedding=), handed to
            executors of programs with embedding actions.

    bind_program gives it the schedule's program (dropping the executors of the one before);
    each step() runs the training program, or for a forward-only step its forwards.
    """

    def __init__(self, stages: list, options: _C.ExecutorOptions, measure_memory: bool = False, vocab=None,
                 embedding=None):
        self._stages = stages
        self._vocab = vocab  # the VocabParallelOutput, for programs with vocabulary actions
        self._embedding = embedding  # the VocabParallelEmbedding, for programs with embedding actions
        self._group = stages[0].group
        self._world = _world_ranks(self._group)
        self.options = options
        self._program: _C.Program | None = None
        self._eval_program: _C.Program | None = None  # its forwards, derived at the first eval
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

    # ---- the program and the stages' data parallelism ---------------------------------------

    @property
    def program(self) -> _C.Program | None:
        """The schedule's program (bind_program), None before one is bound."""
        return self._program

    def bind_program(self, prog: _C.Program) -> None:
        """Takes `prog` after checking that each data-parallel stage can run it (ValueError, the
        adapter's check, naming the stage); drops the executors of the program before it."""
        # Which stages' backward the program splits into I and W (data parallelism checks it).
        self._split = {s.stage_index: any(a.kind == _C.Kind.I and a.stage == s.stage_index
                                          for a in prog.action_values(s.group_rank)) for s in self._stages}
        for s in self._stages:
            s.bind_data_parallel(self._split[s.stage_index])
        self._program, self._eval_program = prog, None
        self._executors.clear()

    def _program_for(self, train: bool) -> _C.Program:
        """The training program, or for a forward-only step its forwards in the same order and
        topology (the program itself where it has no backward)."""
        if train or not _trains(self._program):
            return self._program
        if self._eval_program is None:
            self._eval_program = _C.lower(_C.strip_backward(self._program.compute_only()))
            if self._vocab is not None:  # and the head's forward half, for the losses
                self._eval_program = _C.insert_vocab(self._eval_program)
            if self._embedding is not None:  # and the embedding's lookups, stage 0's input
                self._eval_program = _C.insert_embedding(self._eval_program)
        return self._eval_program

    def _syncs_now(self) -> list[bool]:
        """Every stage's data parallelism as its module is now (torchtitan applies fully_shard
        and assigns stage.submod after building the stages): whether each syncs gradients."""
        return [s.bind_data_parallel(self._split[s.stage_index]) for s in self._stages]

    def check_data_parallel(self, train: bool) -> None:
        """ValueError where a stage's module gained or lost data parallelism (fully_shard in
        place, a new stage.submod) after the executor that runs it read it at its first step."""
        for s, was, now in zip(self._stages, self._syncs[train], self._syncs_now()):
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
        return {s.stage_index: groups for s in self._stages if (groups := s.data_parallel_groups())}

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

    def executor(self, train: bool) -> _C.Executor:
        """The executor of the training (train) or forward-only program, built at its first
        step, when it reads each stage's data parallelism. A failure to build it is told to the
        peers (and the data-parallel replicas), who would wait for this rank: ValueError and
        TypeError (the caller's arguments, ScheduleError too) raise as they are, any other (the
        device's, the backend's) as PipelineError, as the peers get it."""
        ex = self._executors.get(train)
        if ex is not None:
            return ex
        try:
            program = self._program_for(train)
            syncs = self._syncs_now()
            sync_groups = self._sync_groups(train)
            check_stages(self._stages, self._group)
            warn_if_not_below(self.options.timeout_s, [self._group, *_flat(sync_groups)], self._stages[0].device)
            warn_if_default_nccl_group(self._group, self._stages[0].device)
            warn_if_polled(self._group)
            ex = _C.Executor(
                program, self._group, {s.stage_index: s for s in self._stages}, self._stages[0].device,
                options=self.options, global_rank=self._world[0], group_ranks=self._world[1],
                sync_groups=sync_groups,
                vocab=self._vocab if any(a.kind == _C.Kind.S for a in program.action_values(0)) else None,
                embedding=self._embedding if any(a.kind == _C.Kind.E for a in program.action_values(0)) else None,
                control_group=gloo_control_group)
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

    def step(self, call: str, train: bool, build: Callable[[], StepData], loss_scale: float,
             losses: list | None, owner) -> tuple[StepData, list, list]:
        """One user call (`call`: "step" or "eval"), whole: counts it (its failure messages
        name it), takes the executor of the training (train) or forward-only program, then,
        telling every peer of a failure: checks the stages' data parallelism, builds the step's
        data (build(): a batch that does not split fails every rank), names its input
        signature, enters each stage's step scope; runs it (the last executor from now on),
        probing memory on a training step while measure_memory is on. Returns the step's data
        and the last stage's outputs and losses per microbatch. `owner` and `losses` (a list or
        None: TypeError otherwise) reach the custom functions' PipelineContext."""
        number = self.count(call)
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")
        executor = self.executor(train)
        executor.set_step_number(number)  # the failure messages' "step N"
        with contextlib.ExitStack() as stage_scopes:
            try:  # this rank's own checks: a failure here is told to every peer
                self.check_data_parallel(train)
                step = build()
                first_inputs = None
                if step.args is not None and not self.options.static_shapes:
                    first_inputs = input_signature(step, self._stages[0].device.type)
                for s in self._stages:
                    stage_scopes.enter_context(s.step_scope(train))
            except Exception as e:
                executor.report_failure(f"{type(e).__name__}: {e}")
                raise
            outputs, mb_losses = self._run(executor, step, first_inputs, loss_scale, owner, losses)
        return step, outputs, mb_losses

    def _run(self, executor: _C.Executor, step: StepData, first_inputs, loss_scale: float, owner,
             losses) -> tuple[list, list]:
        if self._custom:
            self._ctx = PipelineContext(owner, executor, step, losses)
        self.last = executor
        probing = step.train and self.measure_memory
        if probing:
            step.memory_probe = MemoryProbe()
        executor.set_memory_probe(probing)
        try:
            with _compiled_backward_once() if step.train and any(self._split.values()) else contextlib.nullcontext():
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


def _compiled_backward_once():
    """The step of a split schedule: torch.compile'd regions may donate their saved buffers.

    A compiled region's backward (AOTAutograd's CompiledFunction) refuses to run under
    retain_graph=True once it was compiled to donate buffers -- compiled lazily at its first
    backward, which donates where that backward kept no graph: a B, a W, the user's own
    loss.backward(). The split's I runs with the graph kept (W re-runs nodes of it), but a
    compiled region is never re-run: it runs whole, once, in I (csrc/runtime/stage_backward.h),
    so its donated buffers are read by no one after it. torch reads the refusal's switch,
    torch._functorch.config.donated_buffer, when the backward runs: it is off for the step's
    length (it also keeps a region compiled during the step from donating)."""
    try:
        import torch._functorch.config as config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def _trains(program: _C.Program) -> bool:
    return any(a.kind != _C.Kind.F for r in range(program.pp) for a in program.action_values(r)
               if a.is_compute)


def _flat(groups_by_stage: dict) -> list:
    return [g for gs in groups_by_stage.values() for g in gs]
