"""ScheduleAuto's planning, pure: from the pipeline's merged measurements (zbpipe/tuning/measurements.py)
every candidate is built (the cost-driven ones under the budget in bytes) and simulated, and
the choice is the fitting one of least predicted step; the near candidates a trial runs and the
trial's verdict are taken here too. The same inputs give the same Tuning on every rank; a Tuning
is a value: what a trial, or the steps after the switch, learn is a new one.

    tuning = plan(measured, ["zb_h1", "1f1b", "zb_h2", "zb_auto"], None, safe=zbpipe.compile("zb_h1", 2, 4),
                  ran=[...the program of each timing step...])
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

from .. import _C
from .measurements import Measured
from ..programs import compile as _compile
from ..programs import simulate
from .stage_costs import compile_costs

# Candidates that plan with the measurements (and the budget): built afresh at every tuning.
COST_DRIVEN = ("zb_auto", "v_half", "v_min")


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
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
    # Every buildable candidate's program (a cost-driven one is built under these measurements).
    programs: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def predict(self, program: _C.Program) -> Candidate:
        """Any program of this pipeline judged as the candidates were: its predicted step (the
        simulated makespan under `model` plus overhead_s), simulated peak bytes per rank, and
        whether they fit the budget."""
        return _judge(program.schedule, program, self.model, self.overhead_s, self.budget)

    def after_trial(self, order: Sequence[tuple[str, bool]], slowest: Sequence[float]) -> Tuning:
        """This tuning with the trial's verdict from its steps (`order`: (candidate, counted) per
        step; `slowest`: each step's wall time at its slowest rank): each tried candidate's
        trial_s, and as the choice the one with the least median step (ties: the first in
        candidate order)."""
        candidates = [dataclasses.replace(c, trial_s=[w for (name, counted), w in zip(order, slowest)
                                                      if counted and name == c.name]) for c in self.candidates]
        tried = [c for c in candidates if c.trial_s]
        least = min(statistics.median(c.trial_s) for c in tried)
        best = next(c for c in tried if statistics.median(c.trial_s) <= least * (1 + 1e-9))
        return dataclasses.replace(self, candidates=candidates, choice=best.name, predicted_s=best.predicted_s)

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


def _model(measured: Measured, num_stages: int) -> tuple[dict, list[int]]:
    """simulate()'s keywords from the measurements, and the stages whose saved bytes were not seen."""
    costs = measured.costs
    model = compile_costs({s: {**costs[s], **measured.deltas[s]} for s in costs}, num_stages)
    # A stage whose saved tensors the probe cannot see (packed by hooks inside its module,
    # memory_probe.py) measures 0 bytes: it plans as 1 byte, and the table says so.
    unseen = [s for s, v in enumerate(model["mem_f"]) if v <= 0]
    model["mem_f"] = [max(v, 1.0) for v in model["mem_f"]]
    model["mem_w"] = [min(w, f) for w, f in zip(model["mem_w"], model["mem_f"])]
    sim = dict(f=model["f"], b=model["b"], w=model["w"], comm=measured.comm_s, mem_f=model["mem_f"],
               mem_w=model["mem_w"])
    if all(costs[s].get("b") is not None for s in costs):  # a fused step ran: B as measured, not I + W
        sim["b_full"] = [costs[s]["b"] for s in range(num_stages)]
    return sim, unseen


def _overhead(walls: Sequence[float], ran: Sequence[_C.Program], sim: dict) -> float:
    """What the simulator does not model (posting sends, the step's start and end): the median
    over the timing steps of the wall time (slowest rank) less the simulation of the program
    that ran, one number per step for every candidate.
    Not per action: dispatch is inside the measured action times, and the time outside them does
    not grow with their count; not per message: every candidate of a placement posts the same
    ones (docs/autotune.md, "What the prediction misses")."""
    return statistics.median(w - simulate(p, **sim).makespan for w, p in zip(walls, ran))


def _under_budget(name: str, safe: _C.Program, sim: dict, budget: list[float]) -> _C.Program:
    """A cost-driven candidate (zb_auto, v_half, v_min) planned under the budget. Their cap is
    one number for every rank while the budget may differ per rank (None: the safe default's
    peak of each rank, unequal when the stages' memory is), so each stage's memory is scaled by
    cap / its rank's budget: "scaled memory <= cap" is then "memory <= the rank's own budget",
    and memory steers only the cap, never the times."""
    cap = max(budget)
    rank_of = safe.stage_to_rank  # the placement's, as every candidate's
    scale = [cap / budget[rank_of[s]] if budget[rank_of[s]] > 0 else 1.0 for s in range(safe.num_stages)]
    scaled = {k: v for k, v in sim.items() if k != "b_full"}  # no schedule plans with a fused B
    scaled["mem_f"] = [m * scale[s] for s, m in enumerate(sim["mem_f"])]
    scaled["mem_w"] = [m * scale[s] for s, m in enumerate(sim["mem_w"])]
    return _compile(name, safe.pp, safe.microbatches, safe.num_stages // safe.pp, **scaled, memory_cap=cap)


def _near(fitting: list[Candidate], programs: dict, margin: float) -> list[str]:
    """The fitting candidates predicted within `margin` of the least, in candidate order; of
    those building the same program only the first."""
    least = min(c.predicted_s for c in fitting)
    near, seen = [], set()
    for c in fitting:
        if c.predicted_s <= least * (1 + margin) and programs[c.name] not in seen:
            near.append(c.name)
            seen.add(programs[c.name])
    return near


def plan(measured: Measured, candidates: Sequence[str], budget: float | None, *, safe: _C.Program,
         ran: Sequence[_C.Program], step: int = 0, clock: str = "host", trial_steps: int = 0,
         trial_margin: float = 0.05) -> Tuning:
    """The tuning of `candidates` (names, the safe default `safe` among them) from `measured`:
    each built (the cost-driven ones under the budget) and judged under the measured costs plus
    the unmodelled time of the timing steps (`ran`: the program each ran), the choice the first
    fitting one within rounding of the least prediction. `budget`: bytes per rank (None: the
    safe default's simulated peak per rank). With trial_steps and two or more distinct programs
    predicted within trial_margin of the least, Tuning.trial names them. ScheduleError when no
    candidate fits the budget, naming the smallest need."""
    sim, unseen = _model(measured, safe.num_stages)
    safe_peak = list(simulate(safe, **sim).peak_memory)
    overhead = _overhead(measured.walls, ran, sim)
    per_rank = safe_peak if budget is None else [float(budget)] * safe.pp
    judged, programs = [], {}
    for name in candidates:
        try:
            # the cost-driven candidates plan under the budget, in bytes
            if name in COST_DRIVEN:
                prog = _under_budget(name, safe, dict(sim), per_rank)
            else:
                prog = _compile(name, safe.pp, safe.microbatches, safe.num_stages // safe.pp)
        except (_C.ScheduleError, ValueError) as e:
            judged.append(Candidate(name, None, [], False, f" ({str(e).splitlines()[0][:60]})"))
            continue
        judged.append(_judge(name, prog, sim, overhead, per_rank))
        programs[name] = prog
    fitting = [c for c in judged if c.fits]
    if not fitting:
        needs = [(max(c.peak_bytes), c.name) for c in judged if c.peak_bytes]
        need, who = min(needs)
        raise _C.ScheduleError(
            f"ScheduleAuto: activation_budget {budget} bytes per rank is below what every "
            f"candidate needs; the smallest need is {need:.0f} bytes ({who})")
    # The first of those within rounding of the least (the safe default comes first): the
    # same on every rank, and no switch for a difference the simulator cannot resolve.
    least = min(c.predicted_s for c in fitting)
    best = next(c for c in fitting if c.predicted_s <= least * (1 + 1e-9))
    near = _near(fitting, programs, trial_margin)
    return Tuning(step, measured.costs, measured.deltas, measured.comm_s, per_rank, judged, best.name,
                  best.predicted_s, overhead_s=overhead, clock=clock, unseen_memory=unseen, model=sim,
                  timing_steps=len(ran), timed=[p.schedule for p in ran],
                  trial=near if trial_steps > 0 and len(near) >= 2 else [], planned=best.name, programs=programs)
