"""ScheduleAuto: measure, plan, switch. A tuning runs 1 + timing_steps real steps (four by
default) of the placement's safe default (a split schedule at 1F1B's memory: zb_h1, zbv or
interleaved_zb): the first measures mem_f/mem_w per local stage (its memory probe), the others
the F/I/W times (their traces: device events on accelerators, host times on the CPU), every
second of them running the placement's fused-B schedule instead where it has one at no more
memory (1f1b for one stage per rank) to time B; then the P2P latency of a boundary-sized
message. The ranks gather the measurements over the pipeline group,
so every rank simulates every candidate of the placement from identical inputs and picks the
same one: the least simulated makespan among those whose simulated peak memory fits the budget
(with trial_steps, the fastest in real steps of those predicted near the least). It runs from
the step after. `sched.tuning` says what happened.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import _C
from .programs import compile as _compile
from .programs import simulate
from .schedules import PipelineSchedule, _OneRunning, _rank_stages
from .stage_costs import compile_costs, profile_from_trace

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
_COST_DRIVEN = ("zb_auto", "v_half", "v_min")
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


@dataclasses.dataclass
class Candidate:
    name: str
    predicted_s: float | None  # simulated makespan under the measured costs plus the unmodelled
                               # time (Tuning.overhead_s); None: not buildable
    peak_bytes: list[float]    # simulated peak_memory per rank
    fits: bool
    note: str = ""
    trial_s: list[float] = dataclasses.field(default_factory=list)  # its trial steps' wall times (slowest rank)


def _judge(name: str, program: _C.Program, model: dict, overhead_s: float, budget: list[float]) -> Candidate:
    res = simulate(program, **model)
    peak = list(res.peak_memory)
    fits = all(p <= b * (1 + 1e-9) for p, b in zip(peak, budget))
    return Candidate(name, res.makespan + overhead_s, peak, fits)


@dataclasses.dataclass
class Tuning:
    """What one tuning did: per stage the measured costs (seconds) and memory deltas (bytes),
    the P2P latency, the budget (bytes per rank), every candidate's prediction, the choice,
    and after the switch the measured step time next to the prediction."""
    step: int
    costs: dict          # {stage: {"f", "i", "w", "b"}} seconds
    deltas: dict         # {stage: {"mem_f", "mem_w"}} bytes
    comm_s: float
    budget: list[float]  # bytes per rank
    candidates: list[Candidate]
    choice: str
    predicted_s: float
    measured_step_s: float | None = None  # median wall time of the first steps after the switch, this rank
    overhead_s: float = 0.0  # median over the timing steps: wall time (slowest rank) less the simulated makespan
    clock: str = "host"  # where the costs were timed: "device" (events) or "host"
    unseen_memory: list = dataclasses.field(default_factory=list)  # stages whose saved bytes were not seen
    model: dict = dataclasses.field(default_factory=dict)  # simulate()'s keywords every candidate ran under
    timing_steps: int = 3  # steps whose action times (pooled) and wall times it planned from
    timed: list[str] = dataclasses.field(default_factory=list)  # the schedule each timing step ran
    trial: list[str] = dataclasses.field(default_factory=list)  # candidates tried in real steps (trial_steps)
    planned: str = ""  # the choice by prediction alone (the trial's first candidate)

    def predict(self, program: _C.Program) -> Candidate:
        """Any program of this pipeline judged as the candidates were: its predicted step (the
        simulated makespan under `model` plus overhead_s), simulated peak bytes per rank, and
        whether they fit the budget."""
        return _judge(program.schedule, program, self.model, self.overhead_s, self.budget)

    def table(self) -> str:
        ran = f" ({', '.join(self.timed)})" if self.timed else ""
        lines = [f"ScheduleAuto tuning at step {self.step} ({self.clock} times) over {self.timing_steps} timing "
                 f"step{'s' if self.timing_steps > 1 else ''}{ran}: comm {self.comm_s * 1e6:.1f} us, "
                 f"budget {max(self.budget):.0f} bytes/rank, unmodelled {self.overhead_s * 1e3:.3f} ms/step"]
        lines.append(f"{'stage':>5} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'B ms':>8} {'mem_f B':>10} {'mem_w B':>10}")
        for s in sorted(self.costs):
            c, d = self.costs[s], self.deltas.get(s, {})
            fmt = lambda v: f"{v * 1e3:8.3f}" if v is not None else f"{'-':>8}"  # noqa: E731
            lines.append(f"{s:>5} {fmt(c['f'])} {fmt(c['i'])} {fmt(c['w'])} {fmt(c.get('b'))} "
                         f"{d.get('mem_f', 0):>10.0f} {d.get('mem_w', 0):>10.0f}")
        lines.append(f"{'candidate':<17} {'predicted ms':>12} {'peak B':>10} fits")
        for c in self.candidates:
            pred = f"{c.predicted_s * 1e3:12.3f}" if c.predicted_s is not None else f"{'-':>12}"
            peak = f"{max(c.peak_bytes):10.0f}" if c.peak_bytes else f"{'-':>10}"
            mark = " <- chosen" if c.name == self.choice else ""
            lines.append(f"{c.name:<17} {pred} {peak} {'yes' if c.fits else 'no '}{mark}{c.note}")
        measured = "" if self.measured_step_s is None else (
            f", measured {self.measured_step_s * 1e3:.3f} ms (predicted/measured "
            f"{self.predicted_s / self.measured_step_s:.2f})")
        tried = [c for c in self.candidates if c.name in self.trial]
        if tried and tried[0].trial_s:
            steps = ", ".join(f"{c.name} {statistics.median(c.trial_s) * 1e3:.3f} ms" for c in tried)
            lines.append(f"trial, median of {len(tried[0].trial_s)} steps each (slowest rank): {steps}; "
                         f"by prediction alone: {self.planned}")
        elif tried:
            lines.append(f"trial in progress: {', '.join(c.name for c in tried)}")
        lines.append(f"choice: {self.choice}, predicted {self.predicted_s * 1e3:.3f} ms{measured}")
        if self.unseen_memory:
            lines.append(f"stages {self.unseen_memory}: saved tensors not seen (hooks inside the module), "
                         "planned as 1 byte each")
        return "\n".join(lines)


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
        self._trial: dict | None = None  # a trial of near candidates in progress (trial_steps)
        self._stages = _rank_stages(stages)
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
        self._one_running = _OneRunning("ScheduleAuto")
        self._pending: dict | None = None  # a tuning between its memory step and its last timing step
        self._refused = False  # a shape change ended a tuning early: the next step tunes afresh
        self._after: list[float] = []      # step times after the last switch (measured_step_s)
        self.tuning: Tuning | None = None
        self.history: list[Tuning] = []

    # ---- the step ---------------------------------------------------------------------------

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
        return self.tuning is not None and self._pending is None and self._trial is None and not self._refused

    def step(self, *args, **kwargs):
        """One training step (zbpipe.PipelineSchedule.step's semantics). A tuning spans 1 +
        timing_steps steps: the first measures the memory deltas (the probe's pack hooks slow
        it, and a first step also warms up), the others the times; the ranks then gather, plan
        and switch for the step after."""
        with self._one_running("step"):
            return self._step(args, kwargs)

    def _step(self, args, kwargs):
        self._steps += 1
        if self._trial is not None:  # a tuning's trial first (a re-tune falling inside it is skipped)
            return self._trial_step(args, kwargs)
        # A tuning starts at step 1, at the step after one a shape change refused (during the
        # timing steps or the trial) and, with retune_every, at steps kN + 1.
        due = (self.tuning is None or self._refused or
               (self._retune is not None and (self._steps - 1) % self._retune == 0))
        if due and self._pending is None:
            return self._memory_step(args, kwargs)
        if self._pending is not None:
            return self._timing_step(args, kwargs)
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
        self._refused = False
        measuring = self._current if self._splits(self._current.program) else self._schedules[self._safe]
        shapes = _shapes(args, kwargs)
        measuring.measure_memory = True
        try:
            out, _ = self._run(measuring, args, kwargs)
        finally:
            measuring.measure_memory = False
        self._pending = dict(measuring=measuring, fused=self._fused_for(measuring), deltas=measuring.memory_profile(),
                             shapes=shapes, records=[], walls=[], ran=[])
        self._current = measuring  # the next step's (program and choice report it)
        return out

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

    def _check_shapes(self, shapes: list, first: int, args, kwargs) -> None:
        """ScheduleError on every rank, before the step runs, when its shapes differ from those
        of the tuning's memory step (step `first`) on some rank."""
        # Every rank checks before the step runs, so no rank enters a step the others refuse.
        changed = [None] * self._pp
        dist.all_gather_object(changed, _shapes(args, kwargs) != shapes, group=self._group)
        if any(changed):
            self._pending = self._trial = None
            self._refused = True
            raise _C.ScheduleError(
                f"ScheduleAuto: the step's shapes changed during a tuning (on rank(s) "
                f"{[r for r, c in enumerate(changed) if c]}, between the step that measured memory "
                f"(step {first}) and one that measures times (step {self._steps})): "
                "measurements of two shapes plan for neither. Tune on steps of one shape "
                "(retune_every=None, or a period that starts after the shapes settle)")

    def _timing_step(self, args, kwargs):
        pending = self._pending
        self._check_shapes(pending["shapes"], self._steps - 1 - len(pending["walls"]), args, kwargs)
        runs = self._current
        out, wall = self._run(runs, args, kwargs)
        pending["walls"].append(wall)
        pending["records"] += runs.trace()
        pending["ran"].append(runs.program)
        if len(pending["walls"]) < self._timing_steps:
            # The split schedule first, then every second step the fused one (where there is one).
            odd = len(pending["walls"]) % 2 == 1
            self._current = pending["fused"] if odd and pending["fused"] is not None else pending["measuring"]
        else:  # the last: the schedule that ran it stays current (a choice of its program keeps it)
            self._pending = None
            self._tune(pending["measuring"], pending["deltas"], pending["records"], pending["walls"],
                       pending["ran"], pending["shapes"])
        return out

    def _trial_step(self, args, kwargs):
        trial = self._trial
        self._check_shapes(trial["shapes"], trial["first"], args, kwargs)
        out, wall = self._run(self._current, args, kwargs)
        trial["walls"].append(wall)
        if len(trial["walls"]) < len(trial["order"]):
            self._current = trial["schedules"][trial["order"][len(trial["walls"])][0]]
        else:
            self._end_trial()
        return out

    def _end_trial(self) -> None:
        """Every rank takes the same choice: the trial candidate with the least median step,
        each step's time being the slowest rank's (ties: the first in candidate order)."""
        trial, self._trial = self._trial, None
        every = [None] * self._pp
        dist.all_gather_object(every, trial["walls"], group=self._group)
        slowest = [max(w) for w in zip(*every)]
        t = self.tuning
        for c in t.candidates:
            c.trial_s = [w for (name, counted), w in zip(trial["order"], slowest) if counted and name == c.name]
        tried = [c for c in t.candidates if c.trial_s]
        least = min(statistics.median(c.trial_s) for c in tried)
        best = next(c for c in tried if statistics.median(c.trial_s) <= least * (1 + 1e-9))
        t.choice, t.predicted_s = best.name, best.predicted_s
        self._current = trial["schedules"][best.name]
        self._after = []

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

    # ---- measure, gather, plan --------------------------------------------------------------

    def _schedule_for(self, name: str, program: _C.Program) -> PipelineSchedule:
        key = name if name not in _COST_DRIVEN else None
        if key is not None and key in self._schedules:
            return self._schedules[key]
        sched = PipelineSchedule.from_program(self._stages, program, self._loss_fn, **self._kwargs)
        if key is not None:
            self._schedules[key] = sched
        return sched

    def _splits(self, program: _C.Program) -> bool:
        kinds = {a.kind for a in program.action_values(self._rank) if a.is_compute}
        return _C.Kind.B not in kinds and _C.Kind.I in kinds

    def _measurements(self, measuring: PipelineSchedule, deltas: dict, records: list, walls: list[float]) -> dict:
        costs = profile_from_trace(records, clock=self._clock)
        return dict(rank=self._rank, num_stages=self._num_stages, microbatches=self._n, costs=costs,
                    deltas=deltas, comm_s=self._p2p_latency(measuring), walls=list(walls))

    def _p2p_latency(self, measuring: PipelineSchedule) -> float:
        """One hop of a boundary-sized message: rank 0 passes a token around the ring (each rank
        receives, then sends on) and times the loop, so no rank's late start is counted; the
        median of 5 loops after one to warm up, over pp hops, broadcast from rank 0."""
        nbytes = 0
        for s in self._stages:
            if not s.is_last:
                specs = measuring.output_specs(s.stage_index)
                nbytes = max(nbytes, sum(
                    torch.empty(0, dtype=d).element_size() * int(torch.Size(shape).numel()) for shape, d in specs))
        sizes = [None] * self._pp
        dist.all_gather_object(sizes, nbytes, group=self._group)
        if self._pp < 2:
            return 0.0
        buf = torch.zeros(max(sizes) // 4 + 1, device=self._stages[0].device)
        nxt, prv = (self._rank + 1) % self._pp, (self._rank - 1) % self._pp
        loops = []
        for _ in range(6):
            start = time.perf_counter()
            if self._rank == 0:
                self._group.send([buf], nxt, 77).wait()
                self._group.recv([buf], prv, 77).wait()
            else:
                self._group.recv([buf], prv, 77).wait()
                self._group.send([buf], nxt, 77).wait()
            loops.append(time.perf_counter() - start)
        hop = [statistics.median(loops[1:]) / self._pp]
        dist.broadcast_object_list(hop, src=dist.get_global_rank(self._group, 0), group=self._group)
        return hop[0]

    def _gather(self, mine: dict) -> list[dict]:
        every = [None] * self._pp
        dist.all_gather_object(every, mine, group=self._group)
        return every

    def _merge(self, every: list[dict]) -> tuple[dict, dict, float, list[float]]:
        """The pipeline's costs and deltas per stage, the P2P latency, each timing step's wall time
        at its slowest rank; ScheduleError where ranks disagree."""
        costs, deltas = {}, {}
        for m in every:
            if m["num_stages"] != self._num_stages or m["microbatches"] != self._n:
                raise _C.ScheduleError(
                    f"ScheduleAuto: rank {m['rank']} measured num_stages={m['num_stages']}, "
                    f"microbatches={m['microbatches']}; rank {self._rank} has {self._num_stages}, {self._n}")
            for s in set(m["costs"]) | set(m["deltas"]):
                if s in costs:
                    raise _C.ScheduleError(f"ScheduleAuto: stage {s} was measured by two ranks")
                if s not in m["costs"] or s not in m["deltas"]:
                    raise _C.ScheduleError(f"ScheduleAuto: rank {m['rank']} measured stage {s} only in part")
                costs[s], deltas[s] = m["costs"][s], m["deltas"][s]
        if sorted(costs) != list(range(self._num_stages)):
            raise _C.ScheduleError(
                f"ScheduleAuto: the ranks measured stages {sorted(costs)}, want 0..{self._num_stages - 1}")
        return costs, deltas, max(m["comm_s"] for m in every), [max(w) for w in zip(*(m["walls"] for m in every))]

    def _under_budget(self, name: str, opts: dict, budget: list[float]) -> _C.Program:
        """A cost-driven candidate (zb_auto, v_half, v_min) planned under the budget. Their cap
        is one number for every rank while the budget may differ per rank (None: the safe
        default's peak of each rank, unequal when the stages' memory is), so each stage's
        memory is scaled by cap / its rank's budget: "scaled memory <= cap" is then "memory <=
        the rank's own budget", and memory steers only the cap, never the times."""
        cap = max(budget)
        rank_of = self._schedules[self._safe].program.stage_to_rank  # the placement's, as every candidate's
        scale = [cap / budget[rank_of[s]] if budget[rank_of[s]] > 0 else 1.0 for s in range(self._num_stages)]
        scaled = {k: v for k, v in opts.items() if k != "b_full"}  # no schedule plans with a fused B
        scaled["mem_f"] = [m * scale[s] for s, m in enumerate(opts["mem_f"])]
        scaled["mem_w"] = [m * scale[s] for s, m in enumerate(opts["mem_w"])]
        return _compile(name, self._pp, self._n, self._spr, **scaled, memory_cap=cap)

    def _tune(self, measuring: PipelineSchedule, deltas: dict, records: list, walls: list[float],
              ran: list[_C.Program], shapes: list) -> None:
        mine = self._measurements(measuring, deltas, records, walls)
        costs, deltas, comm, walls = self._merge(self._gather(mine))
        model = compile_costs({s: {**costs[s], **deltas[s]} for s in costs}, self._num_stages)
        # A stage whose saved tensors the probe cannot see (packed by hooks inside its module,
        # memory_probe.py) measures 0 bytes: it plans as 1 byte, and the table says so.
        unseen = [s for s, v in enumerate(model["mem_f"]) if v <= 0]
        model["mem_f"] = [max(v, 1.0) for v in model["mem_f"]]
        model["mem_w"] = [min(w, f) for w, f in zip(model["mem_w"], model["mem_f"])]
        sim = dict(f=model["f"], b=model["b"], w=model["w"], comm=comm, mem_f=model["mem_f"], mem_w=model["mem_w"])
        if all(costs[s].get("b") is not None for s in costs):  # a fused step ran: B as measured, not I + W
            sim["b_full"] = [costs[s]["b"] for s in range(self._num_stages)]
        safe_peak = list(simulate(self._schedules[self._safe].program, **sim).peak_memory)
        # What the simulator does not model (posting sends, the step's start and end): the
        # median over the timing steps of the wall time (slowest rank) less the simulation of
        # the program that ran, one number per step for every candidate.
        # Not per action: dispatch is inside the measured action times, and the time outside
        # them does not grow with their count; not per message: every candidate of a placement
        # posts the same ones (docs/autotune.md, "What the prediction misses").
        overhead = statistics.median(w - simulate(p, **sim).makespan for w, p in zip(walls, ran))
        budget = safe_peak if self._budget is None else [float(self._budget)] * self._pp
        candidates, programs = [], {}
        for name in self._names:
            try:
                # the cost-driven candidates plan under the budget, in bytes
                if name in _COST_DRIVEN:
                    prog = self._under_budget(name, dict(sim), budget)
                else:
                    prog = _compile(name, self._pp, self._n, self._spr)
            except (_C.ScheduleError, ValueError) as e:
                candidates.append(Candidate(name, None, [], False, f" ({str(e).splitlines()[0][:60]})"))
                continue
            candidates.append(_judge(name, prog, sim, overhead, budget))
            programs[name] = prog
        fitting = [c for c in candidates if c.fits]
        if not fitting:
            needs = [(max(c.peak_bytes), c.name) for c in candidates if c.peak_bytes]
            need, who = min(needs)
            raise _C.ScheduleError(
                f"ScheduleAuto: activation_budget {self._budget} bytes per rank is below what every "
                f"candidate needs; the smallest need is {need:.0f} bytes ({who})")
        # The first of those within rounding of the least (the safe default comes first): the
        # same on every rank, and no switch for a difference the simulator cannot resolve.
        least = min(c.predicted_s for c in fitting)
        best = next(c for c in fitting if c.predicted_s <= least * (1 + 1e-9))
        self.tuning = Tuning(self._steps, costs, deltas, comm, budget, candidates, best.name, best.predicted_s,
                             overhead_s=overhead, clock=self._clock, unseen_memory=unseen, model=sim,
                             timing_steps=self._timing_steps, timed=[p.schedule for p in ran], planned=best.name)
        self._after = []
        self.history.append(self.tuning)
        texts = {name: prog.to_csv_text() for name, prog in programs.items()}
        running = self._current.program.to_csv_text()

        def keep(name: str) -> PipelineSchedule:  # the running schedule (and executor) for its own program
            return self._current if texts[name] == running else self._schedule_for(name, programs[name])

        near, seen = [], set()  # candidates building the same program are tried once, as the first
        for c in fitting:
            if c.predicted_s <= least * (1 + self._trial_margin) and texts[c.name] not in seen:
                near.append(c.name)
                seen.add(texts[c.name])
        if self._trial_steps == 0 or len(near) < 2:
            self._current = keep(best.name)
            return
        # The trial: round-robin over the near candidates (the predicted best first), one step
        # each per round, after one uncounted step of each schedule that has not run yet (a
        # schedule's first step sets up its executor and runs slower).
        self.tuning.trial = near
        schedules = {name: keep(name) for name in near}
        rounds = sorted(near, key=lambda n: n != best.name)
        warm = [(n, False) for n in rounds if not schedules[n].has_run]
        order = warm + [(n, True) for n in rounds] * self._trial_steps
        self._trial = dict(order=order, walls=[], shapes=shapes, first=self._steps - self._timing_steps,
                           schedules=schedules)
        self._current = schedules[order[0][0]]
