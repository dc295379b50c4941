"""ScheduleAuto: measure, plan, switch. A tuning runs 1 + timing_steps real steps (four by
default) of the placement's safe default (a split schedule at 1F1B's memory: zb_h1, zbv or
interleaved_zb): the first measures mem_f/mem_w per local stage (its memory probe), the others
the F/I/W times (their traces: device events on accelerators, host times on the CPU), every
second of them running the placement's fused-B schedule instead where it has one at no more
memory (1f1b for one stage per rank) to time B; then the one-way time of a boundary-sized
message (zbpipe/measurements.py). The ranks gather and merge the measurements over the pipeline
group, so every rank plans every candidate of the placement from identical inputs
(zbpipe/auto_plan.py) and picks the same one: the least simulated makespan among those whose
simulated peak memory fits the budget (with trial_steps, the fastest in real steps of those
predicted near the least). It runs from the step after. `sched.tuning` says what happened.

This file holds the steps: a tuning's phases (_Timing, _Trial) as values, one per state, and
the schedules each step runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

from . import _C
from .auto_plan import COST_DRIVEN, Candidate, Tuning, plan  # noqa: F401  (Candidate, Tuning: importable here)
from .measurements import RankMeasurements, boundary_bytes, gather, merge, ring_hop_s
from .programs import compile as _compile
from .schedules import PipelineSchedule, OneRunning, rank_stages
from .stage_costs import profile_from_trace

# placement -> (safe default, candidates). Cost-driven candidates plan with the measurements.
FAMILIES = {
    "one": ("zb_h1", ("zb_h1", "1f1b", "zb_h2", "zb_auto")),
    "v": ("zbv", ("zbv", "v_half", "v_min", "dualpipev")),
    "looped": ("interleaved_zb", ("interleaved_zb", "interleaved_1f1b", "looped_bfs")),
}
# placement -> its fused-B schedule holding no more than the safe default on any rank (1F1B:
# the same in-flight microbatches, no W pending): every second timing step runs it, so a fused
# B is priced as measured, not assumed to cost the I + W a split step measures (one backward
# call against two, each with its own dispatch). interleaved_1f1b holds more than
# interleaved_zb, and dualpipev more than zbv: none there.
FUSED = {"one": "1f1b"}
_MEASURED_STEPS = 5  # steps after a switch whose median is Tuning.measured_step_s


def _shapes(args, kwargs) -> list:
    """The shapes and dtypes of a step's tensor arguments (lists of microbatches included)."""
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append((tuple(v.shape), v.dtype))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
    walk(list(args))
    walk({k: v for k, v in kwargs.items() if k != "losses"})  # an output, filled by the step
    return out


def placement_of(stage_indices: list[int], rank: int, pp: int, num_stages: int) -> str:
    """'one', 'v' or 'looped' for this rank's stages; ScheduleError for any other layout."""
    mine = sorted(stage_indices)
    if num_stages == pp and mine == [rank]:
        return "one"
    if num_stages == 2 * pp and mine == sorted({rank, 2 * pp - 1 - rank}):
        return "v"
    if num_stages % pp == 0 and num_stages > pp and mine == list(range(rank, num_stages, pp)):
        return "looped"
    raise _C.ScheduleError(
        f"ScheduleAuto: rank {rank} holds stages {mine} of {num_stages} over pp={pp}, which matches no "
        "placement family (one stage per rank: [rank]; V: [rank, 2pp-1-rank]; looped: rank, rank+pp, ...)")


# ---- the phases of a tuning: ScheduleAuto._phase is one of these ---------------------------

@dataclasses.dataclass
class _Settled:
    """No tuning under way: a step runs the current program, or starts a tuning when one is due
    (the first step, and with retune_every steps kN + 1)."""


@dataclasses.dataclass
class _Refused:
    """A shape change ended a tuning early: the next step starts a fresh one."""


@dataclasses.dataclass
class _Timing:
    """Between a tuning's memory step and its last timing step."""
    measuring: PipelineSchedule         # the split schedule that measured memory (and times)
    fused: PipelineSchedule | None      # what every second timing step runs instead (FUSED)
    deltas: dict                        # its memory profile of the memory step
    shapes: list                        # the memory step's shapes (_shapes): every step must bring them
    first: int                          # the memory step's number
    records: list = dataclasses.field(default_factory=list)  # the timing steps' traces, pooled
    walls: list[float] = dataclasses.field(default_factory=list)  # each timing step's wall time
    ran: list = dataclasses.field(default_factory=list)  # the program each timing step ran

    def next_schedule(self) -> PipelineSchedule:
        """The next timing step's: the split schedule first, then every second step the fused
        one (where there is one)."""
        odd = len(self.walls) % 2 == 1
        return self.fused if odd and self.fused is not None else self.measuring


@dataclasses.dataclass
class _Trial:
    """The near candidates in real steps (trial_steps), before the choice."""
    order: list[tuple[str, bool]]       # per step: (candidate, counted); uncounted ones warm up
    schedules: dict[str, PipelineSchedule]  # the candidate's schedule
    shapes: list                        # the tuning's memory step's shapes
    first: int                          # the tuning's memory step's number
    walls: list[float] = dataclasses.field(default_factory=list)  # this rank's wall time per trial step


class ScheduleAuto:
    """A schedule that tunes itself to the model: swap it in for any schedule class.

    Args:
        stages, n_microbatches, loss_fn: as for every schedule class.
        activation_budget: bytes of saved activations per rank a candidate's simulated peak
            may reach; None: what the safe default's simulated peak is on each rank.
        retune_every: tune again every N steps, N >= 1 + timing_steps (None: once, over the
            first 1 + timing_steps steps). A re-tune's steps run the current program when it
            splits I and W on every stage, else the safe default.
        timing_steps: steps that time the actions after the one that measures memory (>= 1,
            default 3). Their action times are pooled (the median per stage and kind over every
            microbatch of every one of them), so one step slowed by other load on the host plans
            less of the choice. Every second one (the 2nd, 4th, ...) runs the placement's fused-B
            schedule (FUSED: 1f1b for one stage per rank) where it has one, so a fused B is
            priced as measured rather than as the I + W measured apart.
        trial_steps: with K >= 1, the fitting candidates predicted within trial_margin of the
            least (the model's resolution: the same actions run a few percent faster under some
            schedules, which costs measured under one cannot show) are tried in real training
            steps, K rounds of one step each, before the choice: the one with the least median
            step (slowest rank) runs from then on; none or one near the least: no trial. 0
            (default): the least prediction decides.
        trial_margin: how near the least prediction a candidate must be to be tried (0.05).
        **kwargs: the schedule classes' keywords (timeout, overlap_f_b, ...).

    The pipeline group must be one torch.distributed knows (all_gather_object runs over it).
    Raises zbpipe.ScheduleError for stages matching no placement family, for a budget below
    every candidate's need (naming the smallest need in bytes), when the ranks' measurements
    disagree (stage counts, microbatches, or a stage measured twice or never), and, before the
    step runs, when a timing step brings other shapes than the tuning's first. One call at a
    time, as every schedule: step() or eval() while another runs raises RuntimeError at once.
    A failure names the user's step number, whichever program runs it.
    """

    def __init__(self, stages, n_microbatches: int, loss_fn: Callable | None = None, *,
                 activation_budget: float | None = None, retune_every: int | None = None,
                 timing_steps: int = 3, trial_steps: int = 0, trial_margin: float = 0.05, **kwargs):
        if loss_fn is None:
            raise ValueError("ScheduleAuto tunes a training step: give a loss_fn")
        if timing_steps < 1:
            raise ValueError(f"timing_steps must be >= 1, got {timing_steps}")
        if retune_every is not None and retune_every < 1 + timing_steps:
            raise ValueError(f"retune_every must be >= {1 + timing_steps} (a tuning spans 1 + timing_steps "
                             f"steps) or None, got {retune_every}")
        if trial_steps < 0 or trial_margin < 0:
            raise ValueError(f"trial_steps and trial_margin must be >= 0, got {trial_steps}, {trial_margin}")
        self._timing_steps, self._trial_steps, self._trial_margin = timing_steps, trial_steps, trial_margin
        self._stages = rank_stages(stages)
        first = self._stages[0]
        self._group, self._pp, self._rank = first.group, first.group_size, first.group_rank
        self._num_stages = first.num_stages
        # Device events time the actions on accelerators (host times on the CPU).
        kwargs.setdefault("device_timing", first.device.type != "cpu")
        self._n, self._loss_fn, self._kwargs = n_microbatches, loss_fn, kwargs
        self._budget, self._retune = activation_budget, retune_every
        self._clock = "device" if kwargs["device_timing"] and first.device.type != "cpu" else "host"
        self.placement = placement_of([s.stage_index for s in self._stages], self._rank, self._pp, self._num_stages)
        self._spr = self._num_stages // self._pp
        self._mine = [s.stage_index for s in self._stages]
        self._safe, self._names = FAMILIES[self.placement]
        self._schedules: dict[str, PipelineSchedule] = {}
        self._current = self._schedule_for(self._safe, _compile(self._safe, self._pp, n_microbatches, self._spr))
        self._ran = self._current  # the schedule that ran the last step (trace())
        self._steps = 0
        self._evals = 0  # eval() calls: the inner schedules' failure messages number them
        self._one_running = OneRunning("ScheduleAuto")
        self._phase: _Settled | _Refused | _Timing | _Trial = _Settled()
        self._after: list[float] = []      # step times after the last switch (measured_step_s)
        self.tuning: Tuning | None = None
        self.history: list[Tuning] = []

    @property
    def program(self) -> _C.Program:
        return self._current.program

    @property
    def choice(self) -> str:
        return self._current.program.schedule

    @property
    def tuned(self) -> bool:
        """Whether a tuning has ended, its trial included: its choice runs from the next step
        (until a re-tune)."""
        return self.tuning is not None and isinstance(self._phase, _Settled)

    def step(self, *args, **kwargs):
        """One training step (zbpipe.PipelineSchedule.step's semantics). A tuning spans 1 +
        timing_steps steps: the first measures the memory deltas (the probe's pack hooks slow
        it, and a first step also warms up), the others the times; the ranks then gather, plan
        and switch for the step after."""
        with self._one_running("step"):
            return self._step(args, kwargs)

    def eval(self, *args, **kwargs):
        with self._one_running("eval"):
            self._evals += 1
            self._current.set_call_counts(eval=self._evals - 1)
            return self._current.eval(*args, **kwargs)

    def trace(self) -> list[dict]:
        """The last step's trace, whichever schedule ran it (a timing or trial step's too)."""
        return self._ran.trace()

    def export_chrome_trace(self, path: str) -> None:
        self._ran.export_chrome_trace(path)

    def memory_profile(self) -> dict:
        """This rank's memory deltas measured at the last tuning step (memory_profile())."""
        if self.tuning is None:
            raise RuntimeError("ScheduleAuto has not measured yet: run a step")
        return {s: dict(self.tuning.deltas[s]) for s in self._mine}

    # ---- the steps, by phase ----------------------------------------------------------------

    def _step(self, args, kwargs):
        self._steps += 1
        phase = self._phase
        if isinstance(phase, _Trial):  # a tuning's trial first (a re-tune falling inside it is skipped)
            return self._trial_step(phase, args, kwargs)
        if isinstance(phase, _Timing):
            return self._timing_step(phase, args, kwargs)
        # A tuning starts at step 1, at the step after one a shape change refused (during the
        # timing steps or the trial) and, with retune_every, at steps kN + 1.
        if (self.tuning is None or isinstance(phase, _Refused) or
                (self._retune is not None and (self._steps - 1) % self._retune == 0)):
            return self._memory_step(args, kwargs)
        out, wall = self._run(self._current, args, kwargs)
        if self.tuning is not None and len(self._after) < _MEASURED_STEPS:
            self._after.append(wall)
            self.tuning.measured_step_s = statistics.median(self._after)
        return out

    def _run(self, sched: PipelineSchedule, args, kwargs) -> tuple:
        """One step of `sched`: its output and wall time; trace() reports it from now on."""
        start = time.perf_counter()
        sched.set_call_counts(step=self._steps - 1)  # its failures name the user's step, not its own count
        out = sched.step(*args, **kwargs)
        self._ran = sched
        return out, time.perf_counter() - start

    def _memory_step(self, args, kwargs):
        self._phase = _Settled()
        measuring = self._current if self._splits(self._current.program) else self._schedules[self._safe]
        shapes = _shapes(args, kwargs)
        measuring.measure_memory = True
        try:
            out, _ = self._run(measuring, args, kwargs)
        finally:
            measuring.measure_memory = False
        self._phase = _Timing(measuring, self._fused_for(measuring), measuring.memory_profile(), shapes,
                              first=self._steps)
        self._current = measuring  # the next step's (program and choice report it)
        return out

    def _timing_step(self, timing: _Timing, args, kwargs):
        self._check_shapes(timing.shapes, timing.first, args, kwargs)
        runs = self._current
        out, wall = self._run(runs, args, kwargs)
        timing.walls.append(wall)
        timing.records += runs.trace()
        timing.ran.append(runs.program)
        if len(timing.walls) < self._timing_steps:
            self._current = timing.next_schedule()
        else:  # the last: the schedule that ran it stays current (a choice of its program keeps it)
            self._phase = _Settled()
            self._tune(timing)
        return out

    def _trial_step(self, trial: _Trial, args, kwargs):
        self._check_shapes(trial.shapes, trial.first, args, kwargs)
        out, wall = self._run(self._current, args, kwargs)
        trial.walls.append(wall)
        if len(trial.walls) < len(trial.order):
            self._current = trial.schedules[trial.order[len(trial.walls)][0]]
        else:
            self._end_trial(trial)
        return out

    def _check_shapes(self, shapes: list, first: int, args, kwargs) -> None:
        """ScheduleError on every rank, before the step runs, when its shapes differ from those
        of the tuning's memory step (step `first`) on some rank."""
        # Every rank checks before the step runs, so no rank enters a step the others refuse.
        changed = gather(_shapes(args, kwargs) != shapes, self._group)
        if any(changed):
            self._phase = _Refused()
            raise _C.ScheduleError(
                f"ScheduleAuto: the step's shapes changed during a tuning (on rank(s) "
                f"{[r for r, c in enumerate(changed) if c]}, between the step that measured memory "
                f"(step {first}) and one that measures times (step {self._steps})): "
                "measurements of two shapes plan for neither. Tune on steps of one shape "
                "(retune_every=None, or a period that starts after the shapes settle)")

    # ---- the schedules ----------------------------------------------------------------------

    def _schedule_for(self, name: str, program: _C.Program) -> PipelineSchedule:
        key = name if name not in COST_DRIVEN else None
        if key is not None and key in self._schedules:
            return self._schedules[key]
        sched = PipelineSchedule.from_program(self._stages, program, self._loss_fn, **self._kwargs)
        if key is not None:
            self._schedules[key] = sched
        return sched

    def _splits(self, program: _C.Program) -> bool:
        kinds = {a.kind for a in program.action_values(self._rank) if a.is_compute}
        return _C.Kind.B not in kinds and _C.Kind.I in kinds

    def _fused_for(self, measuring: PipelineSchedule) -> PipelineSchedule | None:
        """The schedule every second timing step runs to measure B (FUSED), or None: none in this
        placement, or a re-tune measuring on a program other than the safe default (under a budget
        below the safe default's peak) whose last tuning found the fused one over the budget."""
        name = FUSED.get(self.placement)
        if name is None or self._timing_steps < 2:
            return None
        fused = self._schedules.get(name) or self._schedule_for(name, _compile(name, self._pp, self._n, self._spr))
        if measuring is self._schedules[self._safe] or self.tuning is None or self.tuning.predict(fused.program).fits:
            return fused
        return None

    # ---- measure, gather, plan, switch ------------------------------------------------------

    def _measurements(self, timing: _Timing) -> RankMeasurements:
        """This rank's record of the tuning, its P2P hop measured now (every rank takes part)."""
        nbytes = max(gather(boundary_bytes(timing.measuring, self._stages), self._group))
        comm_s = ring_hop_s(nbytes, self._stages[0].device, self._group)
        return RankMeasurements(rank=self._rank, num_stages=self._num_stages, microbatches=self._n,
                                costs=profile_from_trace(timing.records, clock=self._clock),
                                deltas=timing.deltas, comm_s=comm_s, walls=list(timing.walls))

    def _tune(self, timing: _Timing) -> None:
        measured = merge(gather(self._measurements(timing), self._group), self._num_stages, self._n, self._rank)
        t = plan(measured, self._names, self._budget, safe=self._schedules[self._safe].program, ran=timing.ran,
                 step=self._steps, clock=self._clock, trial_steps=self._trial_steps,
                 trial_margin=self._trial_margin)
        self.tuning = t
        self._after = []
        self.history.append(t)
        running = self._current.program.to_csv_text()

        def keep(name: str) -> PipelineSchedule:  # the running schedule (and executor) for its own program
            prog = t.programs[name]
            return self._current if prog.to_csv_text() == running else self._schedule_for(name, prog)

        if not t.trial:
            self._current = keep(t.choice)
            return
        # The trial: round-robin over the near candidates (the predicted best first), one step
        # each per round, after one uncounted step of each schedule that has not run yet (a
        # schedule's first step sets up its executor and runs slower).
        schedules = {name: keep(name) for name in t.trial}
        rounds = sorted(t.trial, key=lambda n: n != t.choice)
        warm = [(n, False) for n in rounds if not schedules[n].has_run]
        order = warm + [(n, True) for n in rounds] * self._trial_steps
        self._phase = _Trial(order, schedules, timing.shapes, first=timing.first)
        self._current = schedules[order[0][0]]

    def _end_trial(self, trial: _Trial) -> None:
        """Every rank takes the same choice: the trial candidate with the least median step,
        each step's time being the slowest rank's (Tuning.end_trial)."""
        self._phase = _Settled()
        slowest = [max(w) for w in zip(*gather(trial.walls, self._group))]
        self._current = trial.schedules[self.tuning.end_trial(trial.order, slowest)]
        self._after = []
