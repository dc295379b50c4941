"""ScheduleAuto: measure, plan, switch. A tuning runs 1 + timing_steps real steps (four by
default) of the placement's safe default (a split schedule at 1F1B's memory: zb_h1, zbv or
interleaved_zb): the first measures mem_f/mem_w per local stage (its memory probe), the others
the F/I/W times (their traces: device events on accelerators, host times on the CPU), every
second of them running the placement's fused-B schedule instead where it has one at no more
memory (1f1b for one stage per rank) to time B; then the one-way time of a boundary-sized
message (zbpipe/tuning/measurements.py). The ranks gather and merge the measurements over the pipeline
group, so every rank plans every candidate of the placement from identical inputs
(zbpipe/tuning/auto_plan.py) and picks the same one: the least simulated makespan among those whose
simulated peak memory fits the budget (with trial_steps, the fastest in real steps of those
predicted near the least). It runs from the step after. `sched.tuning` says what happened.

This file holds the steps: the placement and options (frozen), a tuning's phases (_Timing,
_Trial) as values replaced at each step, and the schedules each step runs, one per program.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

from .. import _C, _tree
from .auto_plan import COST_DRIVEN, Candidate, Tuning, plan  # noqa: F401  (Candidate, Tuning: importable here)
from .measurements import (RankMeasurements, StageTiming, boundary_bytes, gather, merge, one_way_latency_s,
                           probe_memory)
from ..programs import compile as _compile
from ..schedules import PipelineSchedule, OneRunning, rank_stages

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
    return _tree.tensor_specs((list(args), {k: v for k, v in kwargs.items() if k != "losses"}))  # losses: an output


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


# ---- what a ScheduleAuto is: its placement and its options, fixed at construction -----------

@dataclasses.dataclass(frozen=True)
class Placement:
    """This rank's stages (in stage order) on the pipeline group, and their family ('one',
    'v' or 'looped': placement_of), whose safe default and candidates (FAMILIES) it plans."""
    stages: tuple
    group: Any
    pp: int
    rank: int
    num_stages: int
    family: str

    @classmethod
    def of(cls, stages: list) -> Placement:
        first = stages[0]
        family = placement_of([s.stage_index for s in stages], first.group_rank, first.group_size, first.num_stages)
        return cls(tuple(stages), first.group, first.group_size, first.group_rank, first.num_stages, family)

    @property
    def safe(self) -> str:
        return FAMILIES[self.family][0]

    @property
    def candidates(self) -> tuple[str, ...]:
        return FAMILIES[self.family][1]

    @property
    def mine(self) -> list[int]:
        return [s.stage_index for s in self.stages]

    def compile(self, name: str, microbatches: int) -> _C.Program:
        """`name`'s program over this placement (a fixed schedule: no costs)."""
        return _compile(name, self.pp, microbatches, self.num_stages // self.pp)


@dataclasses.dataclass(frozen=True)
class Options:
    """What the user asked of the tuning (ScheduleAuto's arguments), and the schedule classes'
    keywords every schedule it runs gets."""
    n_microbatches: int
    loss_fn: Callable
    activation_budget: float | None
    retune_every: int | None
    timing_steps: int
    trial_steps: int
    trial_margin: float
    clock: str                 # where the actions are timed: "device" (events) or "host"
    schedule_kwargs: dict      # read only


# ---- the phases of a tuning: ScheduleAuto._phase is one of these values, each step a new one --

@dataclasses.dataclass(frozen=True)
class _Settled:
    """No tuning under way: a step runs the current program, or starts a tuning when one is due
    (the first step, and with retune_every steps kN + 1). `after`: the wall times of the steps
    since the last switch, the first _MEASURED_STEPS of them (Tuning.measured_step_s)."""
    after: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Refused:
    """A shape change ended a tuning early: the next step starts a fresh one."""


@dataclasses.dataclass(frozen=True)
class _Timing:
    """Between a tuning's memory step and its last timing step: the measuring recipe's state
    (zbpipe.measurements.StageTiming) and what a shape check needs."""
    stages: StageTiming                 # its split schedule measured memory; the times so far
    shapes: list                        # the memory step's shapes (_shapes): every step must bring them
    first: int                          # the memory step's number


@dataclasses.dataclass(frozen=True)
class _Trial:
    """The near candidates in real steps (trial_steps), before the choice."""
    order: tuple[tuple[str, bool], ...]  # per step: (candidate, counted); uncounted ones warm up
    schedules: dict                     # candidate -> its schedule (read only)
    shapes: list                        # the tuning's memory step's shapes
    first: int                          # the tuning's memory step's number
    walls: tuple[float, ...] = ()       # this rank's wall time per trial step


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

    Its state: the placement and the options (frozen at construction), one schedule per
    program it has run (keyed by the program itself: an equal program reuses its schedule and
    executor), the running and last-run schedule, the step and eval counts, the tuning's phase
    (a value, replaced at each step) and the tunings so far (history; `tuning` the last).
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
        self._placement = Placement.of(rank_stages(stages))
        device = self._placement.stages[0].device
        # Device events time the actions on accelerators (host times on the CPU).
        kwargs.setdefault("device_timing", device.type != "cpu")
        clock = "device" if kwargs["device_timing"] and device.type != "cpu" else "host"
        self._options = Options(n_microbatches, loss_fn, activation_budget, retune_every, timing_steps,
                                trial_steps, trial_margin, clock, dict(kwargs))
        self._schedules: dict[_C.Program, PipelineSchedule] = {}
        self._current: PipelineSchedule | None = None
        self._current = self._schedule_for(self._placement.compile(self._placement.safe, n_microbatches))
        self._ran = self._current  # the schedule that ran the last step (trace())
        self._steps = 0
        self._evals = 0  # eval() calls: the inner schedules' failure messages number them
        self._one_running = OneRunning("ScheduleAuto")
        self._phase: _Settled | _Refused | _Timing | _Trial = _Settled()
        self.history: list[Tuning] = []  # every tuning, each as it stands now

    @property
    def placement(self) -> str:
        """'one', 'v' or 'looped' (placement_of)."""
        return self._placement.family

    @property
    def tuning(self) -> Tuning | None:
        """The last tuning (None before one), with its trial's verdict and measured step time
        once known."""
        return self.history[-1] if self.history else None

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
        return {s: dict(self.tuning.deltas[s]) for s in self._placement.mine}

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
        retune = self._options.retune_every
        if (self.tuning is None or isinstance(phase, _Refused) or
                (retune is not None and (self._steps - 1) % retune == 0)):
            return self._memory_step(args, kwargs)
        out, wall = self._run(self._current, args, kwargs)
        if len(phase.after) < _MEASURED_STEPS:
            self._phase = _Settled(phase.after + (wall,))
            self.history[-1] = dataclasses.replace(self.tuning, measured_step_s=statistics.median(self._phase.after))
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
        safe = self._placement.compile(self._placement.safe, self._options.n_microbatches)
        measuring = self._current if self._splits(self._current.program) else self._schedule_for(safe)
        shapes = _shapes(args, kwargs)
        out, deltas = probe_memory(measuring, lambda sched: self._run(sched, args, kwargs)[0])
        self._phase = _Timing(StageTiming(measuring, self._fused_for(measuring), deltas), shapes, first=self._steps)
        self._current = measuring  # the next step's (program and choice report it)
        return out

    def _timing_step(self, timing: _Timing, args, kwargs):
        self._check_shapes(timing.shapes, timing.first, args, kwargs)
        runs = self._current
        out, wall = self._run(runs, args, kwargs)
        timing = dataclasses.replace(timing, stages=timing.stages.after_step(wall, runs.trace(), runs.program))
        self._phase = timing
        if len(timing.stages.walls) < self._options.timing_steps:
            self._current = timing.stages.next_schedule()
        else:  # the last: the schedule that ran it stays current (a choice of its program keeps it)
            self._phase = _Settled()
            self._tune(timing)
        return out

    def _trial_step(self, trial: _Trial, args, kwargs):
        self._check_shapes(trial.shapes, trial.first, args, kwargs)
        out, wall = self._run(self._current, args, kwargs)
        trial = dataclasses.replace(trial, walls=trial.walls + (wall,))
        self._phase = trial
        if len(trial.walls) < len(trial.order):
            self._current = trial.schedules[trial.order[len(trial.walls)][0]]
        else:
            self._end_trial(trial)
        return out

    def _check_shapes(self, shapes: list, first: int, args, kwargs) -> None:
        """ScheduleError on every rank, before the step runs, when its shapes differ from those
        of the tuning's memory step (step `first`) on some rank."""
        # Every rank checks before the step runs, so no rank enters a step the others refuse.
        changed = gather(_shapes(args, kwargs) != shapes, self._placement.group)
        if any(changed):
            self._phase = _Refused()
            raise _C.ScheduleError(
                f"ScheduleAuto: the step's shapes changed during a tuning (on rank(s) "
                f"{[r for r, c in enumerate(changed) if c]}, between the step that measured memory "
                f"(step {first}) and one that measures times (step {self._steps})): "
                "measurements of two shapes plan for neither. Tune on steps of one shape "
                "(retune_every=None, or a period that starts after the shapes settle)")

    # ---- the schedules ----------------------------------------------------------------------

    def _schedule_for(self, program: _C.Program) -> PipelineSchedule:
        """The schedule running `program`: the running one or one made before where the program
        is equal (its executor kept), else a new one. A cost-driven program is built anew at
        every tuning: kept only while it runs, not cached."""
        sched = self._schedules.get(program)
        if sched is None and self._current is not None and program == self._current.program:
            return self._current
        if sched is None:
            o = self._options
            sched = PipelineSchedule.from_program(list(self._placement.stages), program, o.loss_fn, **o.schedule_kwargs)
            if program.schedule not in COST_DRIVEN:
                self._schedules[program] = sched
        return sched

    def _splits(self, program: _C.Program) -> bool:
        kinds = {a.kind for a in program.action_values(self._placement.rank) if a.is_compute}
        return _C.Kind.B not in kinds and _C.Kind.I in kinds

    def _fused_for(self, measuring: PipelineSchedule) -> PipelineSchedule | None:
        """The schedule every second timing step runs to measure B (FUSED), or None: none in this
        placement, or a re-tune measuring on a program other than the safe default (under a budget
        below the safe default's peak) whose last tuning found the fused one over the budget."""
        name = FUSED.get(self.placement)
        if name is None or self._options.timing_steps < 2:
            return None
        n = self._options.n_microbatches
        fused = self._schedule_for(self._placement.compile(name, n))
        safe = self._placement.compile(self._placement.safe, n)
        if measuring.program == safe or self.tuning is None or self.tuning.predict(fused.program).fits:
            return fused
        return None

    # ---- measure, gather, plan, switch ------------------------------------------------------

    def _measurements(self, timing: StageTiming) -> RankMeasurements:
        """This rank's record of the tuning, its P2P hop measured now (every rank takes part)."""
        p = self._placement
        nbytes = max(gather(boundary_bytes(timing.split, p.stages), p.group))
        comm_s = one_way_latency_s(nbytes, p.stages[0].device, p.group)
        return RankMeasurements(rank=p.rank, num_stages=p.num_stages, microbatches=self._options.n_microbatches,
                                costs=timing.costs(self._options.clock), deltas=timing.deltas, comm_s=comm_s,
                                walls=list(timing.walls))

    def _tune(self, timing: _Timing) -> None:
        p, o = self._placement, self._options
        measured = merge(gather(self._measurements(timing.stages), p.group), p.num_stages, o.n_microbatches, p.rank)
        t = plan(measured, p.candidates, o.activation_budget, safe=p.compile(p.safe, o.n_microbatches),
                 ran=list(timing.stages.ran), step=self._steps, clock=o.clock, trial_steps=o.trial_steps,
                 trial_margin=o.trial_margin)
        self.history.append(t)
        if not t.trial:
            self._current = self._schedule_for(t.programs[t.choice])
            return
        # The trial: round-robin over the near candidates (the predicted best first), one step
        # each per round, after one uncounted step of each schedule that has not run yet (a
        # schedule's first step sets up its executor and runs slower).
        schedules = {name: self._schedule_for(t.programs[name]) for name in t.trial}
        rounds = sorted(t.trial, key=lambda n: n != t.choice)
        warm = [(n, False) for n in rounds if not schedules[n].has_run]
        order = tuple(warm + [(n, True) for n in rounds] * o.trial_steps)
        self._phase = _Trial(order, schedules, timing.shapes, first=timing.first)
        self._current = schedules[order[0][0]]

    def _end_trial(self, trial: _Trial) -> None:
        """Every rank takes the same choice: the trial candidate with the least median step,
        each step's time being the slowest rank's (Tuning.after_trial)."""
        self._phase = _Settled()
        slowest = [max(w) for w in zip(*gather(list(trial.walls), self._placement.group))]
        self.history[-1] = self.tuning.after_trial(trial.order, slowest)
        self._current = trial.schedules[self.tuning.choice]
