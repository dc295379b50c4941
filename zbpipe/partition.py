"""plan_partition: the split of a model into pipeline stages, planned jointly with the schedule
from per-unit costs and bytes the runtime measures, under a per-rank memory budget.

    plan = zbpipe.plan_partition(model, (x,), pp=4, microbatches=16, loss_fn=loss_fn, mb_target=y)
    print(plan.table())
    modules = zbpipe.split_by_fqn(model, plan.module_fqns_per_stage)   # one per stage
    program = plan.program()                                           # zbpipe.compile(plan.schedule, ...)

Measuring: the units run as the stages of a one-process pipeline (each unit alone in a stage,
the rest of the model removed as split_by_fqn removes it, parameters shared with `model`) on one
microbatch: a probing step of interleaved_zb gives every unit's saved bytes (the memory probe,
mem_f / mem_w), timing steps give F, I and W (the executor's trace), steps of looped_bfs the
fused B. So a unit costs what it costs inside a stage, and a forward that cannot run with units
removed fails here, naming the unit, before anything else runs. The search (the core's
csrc/core/partition.cpp) scores contiguous splits with the simulator on every candidate program.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import statistics
from collections.abc import Sequence
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from . import _C
from .tuning.measurements import measure_stages, merge_stage_costs
from .module_split import prune
from .programs import compile as _compile
from .schedules import PipelineSchedule
from .stage import PipelineStage
from .tuning.stage_costs import action_seconds

# The fixed training schedules by placement; the stage count is pp (one per rank) or 2pp.
ONE_PER_RANK = ("gpipe", "1f1b", "zb_h1", "zb_h2")
TWO_PER_RANK = ("zbv", "dualpipev", "looped_bfs", "interleaved_1f1b", "interleaved_zb")
DEFAULT_SCHEDULES = ONE_PER_RANK + TWO_PER_RANK
_COST_DRIVEN = ("zb_auto", "v_half", "v_min")
_STAGE_OF_FAILURE = re.compile(r"failed in stage (\d+)")


@dataclasses.dataclass
class UnitCost:
    """One unit as measured: seconds per microbatch (f, i, w, fused b) and bytes (mem_f saved by
    its forward, mem_w of those held from I to W, static: parameters + gradients + optimizer
    state + buffers)."""
    fqn: str  # the unit's name: its module's FQN, or FQNs joined by '+' for a group
    f: float
    i: float
    w: float
    b: float
    mem_f: float
    mem_w: float
    param_bytes: float
    static_bytes: float
    modules: tuple[str, ...] = ()  # the module FQNs it keeps (default: fqn alone)

    @property
    def fqns(self) -> list[str]:
        return list(self.modules) if self.modules else [self.fqn]


@dataclasses.dataclass
class PartitionPlan:
    """What plan_partition chose. module_fqns_per_stage feeds zbpipe.split_by_fqn and
    torchtitan's module_fqns_per_model_part unchanged; program() is the schedule it was planned
    with. peak_bytes: per rank, the simulated activation peak plus the static bytes of its
    stages. even_*: the even split (units / stages each) on the same schedule."""
    module_fqns_per_stage: list[list[str]]
    schedule: str
    predicted_step_s: float
    peak_bytes: list[float]
    units: list[UnitCost]
    pp: int
    microbatches: int
    bounds: list[int]
    even_bounds: list[int]
    even_step_s: float
    even_peak_bytes: list[float]
    candidates: list[tuple[str, float | None, float | None]]  # (schedule, best predicted s, its max peak)
    exact: bool
    simulated: int
    memory_budget: float | None
    comm_s: float
    bounding_unit: str | None  # a unit whose own work exceeds a rank's balanced share
    # vocab_parallel=True: the head's name, what every rank does and holds for its shard (per
    # rank: s, t seconds, mem_s and static_bytes bytes; collective seconds), and the plan with
    # the head on one rank (the best split without vocabulary parallelism), for comparison.
    head: str | None = None
    vocab: dict | None = None
    head_on_one_rank: "PartitionPlan | None" = None

    @property
    def vocab_parallel(self) -> bool:
        return self.vocab is not None

    @property
    def num_stages(self) -> int:
        return len(self.module_fqns_per_stage)

    @property
    def even_module_fqns_per_stage(self) -> list[list[str]]:
        return _stages_of(self.units, self.even_bounds)

    def program(self) -> _C.Program:
        """The planned program; with vocab_parallel its S and T passes placed under the plan's
        stage and head costs (the same program on every rank: the costs are gathered)."""
        return _compile(self.schedule, self.pp, self.microbatches, self.num_stages // self.pp,
                        **self.compile_options())

    def compile_options(self) -> dict:
        """zbpipe.compile's options for program() (also a schedule class's compile_options): with
        vocab_parallel, the stage costs and the head's, which place its passes."""
        if self.vocab is None:
            return {}
        c = self.stage_costs()
        return dict(vocab_parallel=True, f=c["f"], b=c["b"], w=c["w"], b_full=c["b_full"], comm=self.comm_s,
                    s=self.vocab["s"],
                    t=self.vocab["t"], collective=self.vocab["collective"])

    def torchtitan_config(self) -> dict:
        """torchtitan's [parallelism] fields for this plan: its degree, its schedule by class
        name (torchtitan's pipeline_parallel_schedule, e.g. "ZBVZeroBubble"), and the split as
        module_fqns_per_model_part."""
        from .schedules import get_schedule_class

        return {"pipeline_parallel_degree": self.pp,
                "pipeline_parallel_schedule": get_schedule_class(self.schedule).__name__.removeprefix("Schedule"),
                "module_fqns_per_model_part": [list(names) for names in self.module_fqns_per_stage]}

    def stage_costs(self, bounds: Sequence[int] | None = None) -> dict:
        """Per-stage f, b (I), w, b_full, mem_f, mem_w of a split (the plan's by default), as
        zbpipe.simulate takes them (and zb_auto / v_half / v_min's compile)."""
        bounds = self.bounds if bounds is None else list(bounds)
        out: dict[str, list[float]] = {k: [] for k in ("f", "b", "w", "b_full", "mem_f", "mem_w")}
        for lo, hi in zip(bounds, bounds[1:]):
            us = self.units[lo:hi]
            out["f"].append(sum(u.f for u in us))
            out["b"].append(sum(u.i for u in us))
            out["w"].append(sum(u.w for u in us))
            out["b_full"].append(sum(u.b for u in us))
            mem_f = max(sum(u.mem_f for u in us), 1.0)
            out["mem_f"].append(mem_f)
            out["mem_w"].append(min(sum(u.mem_w for u in us), mem_f))
        # The first stage's input needs no gradient: its I is empty and W does the whole
        # backward, holding everything until it ends (as the core scores it: partition.cpp).
        out["w"][0] += out["b"][0]
        out["b"][0] = 0.0
        out["mem_w"][0] = out["mem_f"][0]
        return out

    def table(self) -> str:
        mib = 1024.0 ** 2
        peaks = lambda v: "[" + ", ".join(f"{p / mib:.1f}" for p in v) + "]"  # noqa: E731
        budget = "none" if self.memory_budget is None else f"{self.memory_budget / mib:.1f} MiB/rank"
        search = "exact (every split enumerated)" if self.exact else "local search (too many splits to enumerate)"
        lines = [f"plan_partition: pp={self.pp}, {self.microbatches} microbatches, {len(self.units)} units, "
                 f"budget {budget}; {search}, {self.simulated} simulations",
                 f"schedule {self.schedule}: predicted step {self.predicted_step_s * 1e3:.3f} ms, even split "
                 f"{self.even_step_s * 1e3:.3f} ms ({self.predicted_step_s / self.even_step_s:.2f}x)",
                 f"peak MiB per rank: plan {peaks(self.peak_bytes)}, even {peaks(self.even_peak_bytes)}",
                 f"{'stage':>5} {'plan units':<34} {'F+I+W ms':>9} | {'even units':<34} {'F+I+W ms':>9}"]
        for s in range(self.num_stages):
            cols = []
            for bounds in (self.bounds, self.even_bounds):
                us = self.units[bounds[s]:bounds[s + 1]]
                names = us[0].fqn if len(us) == 1 else f"{us[0].fqn} .. {us[-1].fqn} ({len(us)})"
                cols.append(f"{names:<34} {sum(u.f + u.i + u.w for u in us) * 1e3:9.3f}")
            lines.append(f"{s:>5} {cols[0]} | {cols[1]}")
        lines.append(f"{'candidate':<17} {'predicted ms':>12} {'peak MiB':>9}")
        for name, step, peak in self.candidates:
            p = f"{step * 1e3:12.3f}" if step is not None else f"{'-':>12}"
            m = f"{peak / mib:9.1f}" if peak is not None else f"{'-':>9}"
            lines.append(f"{name:<17} {p} {m}{' <- chosen' if name == self.schedule else ''}")
        lines.append(f"{'unit':<24} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'B ms':>8} {'mem_f MiB':>9} "
                     f"{'mem_w MiB':>9} {'static MiB':>10}")
        for u in self.units:
            lines.append(f"{u.fqn:<24} {u.f * 1e3:8.3f} {u.i * 1e3:8.3f} {u.w * 1e3:8.3f} {u.b * 1e3:8.3f} "
                         f"{u.mem_f / mib:9.3f} {u.mem_w / mib:9.3f} {u.static_bytes / mib:10.3f}")
        if self.vocab is not None:
            one = self.head_on_one_rank
            v = self.vocab
            lines.append(f"head '{self.head}' split over the {self.pp} ranks (vocabulary parallelism): S "
                         f"{max(v['s']) * 1e3:.3f} ms, T {max(v['t']) * 1e3:.3f} ms per microbatch and rank; its "
                         f"shard {max(v['static_bytes']) / mib:.1f} MiB static, {max(v['mem_s']) / mib:.1f} MiB "
                         "per microbatch from S to T")
            lines.append(f"{'head':<14} {'schedule':<17} {'step ms':>9} {'peak MiB per rank'}")
            lines.append(f"{'split':<14} {self.schedule:<17} {self.predicted_step_s * 1e3:9.3f} {peaks(self.peak_bytes)}")
            if one is not None:
                lines.append(f"{'on one rank':<14} {one.schedule:<17} {one.predicted_step_s * 1e3:9.3f} "
                             f"{peaks(one.peak_bytes)}  (split / one rank: step "
                             f"{self.predicted_step_s / one.predicted_step_s:.2f}x, largest peak "
                             f"{max(self.peak_bytes) / max(one.peak_bytes):.2f}x)")
        if self.bounding_unit is not None:
            u = next(u for u in self.units if u.fqn == self.bounding_unit)
            share = sum(v.f + v.i + v.w for v in self.units) / self.pp
            lines.append(f"unit '{u.fqn}' bounds the step on its own: its F+I+W ({(u.f + u.i + u.w) * 1e3:.3f} ms "
                         f"per microbatch) exceeds a rank's balanced share ({share * 1e3:.3f} ms), so no split "
                         "balances the ranks; splitting that unit across ranks (vocabulary parallelism for an "
                         "LM head: plan_partition(..., vocab_parallel=True)) is the next step")
        return "\n".join(lines)


def _stages_of(units: list[UnitCost], bounds: Sequence[int]) -> list[list[str]]:
    return [[n for u in units[lo:hi] for n in u.fqns] for lo, hi in zip(bounds, bounds[1:])]


# ---- units ----------------------------------------------------------------------------------

def _default_units(model: nn.Module, mb_args: tuple, mb_kwargs: dict) -> list[str]:
    """The model's direct children, ModuleList / ModuleDict / Sequential ones expanded one
    level, in the order one forward calls them first (those it never calls last, in
    definition order)."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            found += [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            found.append((name, child))
    called: list[str] = []
    hooks = [mod.register_forward_pre_hook(lambda *_, n=name: called.append(n) if n not in called else None)
             for name, mod in found]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*mb_args, **mb_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return called + [n for n, _ in found if n not in called]


def _unit_groups(units) -> list[tuple[str, ...]]:
    """Each unit as the tuple of module FQNs it keeps together (a str is one)."""
    out = []
    for u in units:
        group = (u,) if isinstance(u, str) else tuple(u)
        if not group or not all(isinstance(n, str) for n in group):
            raise ValueError(f"plan_partition: a unit is a module name or a non-empty list of them, got {u!r}")
        out.append(group)
    return out


def _check_units(model: nn.Module, groups: list[tuple[str, ...]]) -> None:
    """ValueError naming the unit or parameter: a name twice, a name that is not a submodule,
    a unit inside another, a parameter in no unit."""
    modules = dict(model.named_modules())
    names = [n for g in groups for n in g]
    seen: set[str] = set()
    for u in names:
        if u in seen:
            raise ValueError(f"plan_partition: units names '{u}' twice")
        seen.add(u)
        if u == "" or u not in modules:
            what = ("the root module" if u == "" else
                    "a parameter" if u in dict(model.named_parameters()) else
                    "a buffer" if u in dict(model.named_buffers()) else "no submodule of the model")
            raise ValueError(f"plan_partition: unit '{u}' is not a splittable module (it is {what})")
    for u in names:
        outer = next((v for v in names if u.startswith(v + ".")), None)
        if outer is not None:
            raise ValueError(f"plan_partition: unit '{u}' is inside unit '{outer}'")
    for pname, _ in model.named_parameters():
        if not any(pname.startswith(u + ".") for u in names):
            raise ValueError(f"plan_partition: parameter '{pname}' is in no unit (add the module holding it, "
                             "or move a parameter held directly by a split module into a submodule)")


# ---- measuring --------------------------------------------------------------------------------

def _unit_module(model: nn.Module, group: tuple[str, ...]) -> nn.Module:
    """`model` keeping only the unit's modules, as split_by_fqn keeps a stage's, sharing its
    parameters and buffers (no copy of the weights)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return prune(copy.deepcopy(model, memo), "", set(group))


def _one_process_group() -> dist.ProcessGroup:
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def _static_bytes(model: nn.Module, groups: list[tuple[str, ...]],
                  optimizer_states: float) -> list[tuple[float, float]]:
    """(parameter bytes, static bytes) per unit; a parameter shared by two units counts in the first."""
    modules = dict(model.named_modules())
    seen: set[int] = set()
    out = []
    for group in groups:
        params = buffers = 0
        for p in (p for u in group for p in modules[u].parameters()):
            if id(p) not in seen:
                seen.add(id(p))
                params += p.numel() * p.element_size()
        for b in (b for u in group for b in modules[u].buffers()):
            if id(b) not in seen:
                seen.add(id(b))
                buffers += b.numel() * b.element_size()
        out.append((float(params), float(params * (2 + optimizer_states) + buffers)))
    return out


def _measure(model, units, mb_args, mb_kwargs, mb_target, loss_fn, device, steps: int) -> list[list[float]]:
    """Per unit [f, i, w, b, mem_f, mem_w] on one microbatch: units as the stages of a
    one-process pipeline. ValueError naming the unit whose stage the forward cannot run."""
    n = len(units)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    pg = _one_process_group()
    stages = [PipelineStage(_unit_module(model, u), s, n, device, group=pg) for s, u in enumerate(units)]
    split_name, fused_name = ("interleaved_zb", "looped_bfs") if n > 1 else ("zb_h1", "1f1b")
    spr = n if n > 1 else None
    call = dict(arg_mbs=[tuple(mb_args)], kwarg_mbs=[dict(mb_kwargs)], target_mbs=[mb_target])
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            split = PipelineSchedule.from_program(stages, _compile(split_name, 1, 1, spr), loss_fn)
            fused = PipelineSchedule.from_program(stages, _compile(fused_name, 1, 1, spr), loss_fn)
            try:  # `steps` rounds of one split and one fused step (zbpipe.measurements.measure_stages)
                timing = measure_stages(split, fused, lambda sched: sched.step(**call), 2 * steps)
            except _C.PipelineError as e:
                m = _STAGE_OF_FAILURE.search(str(e))
                unit = "+".join(units[int(m.group(1))]) if m else "?"
                raise ValueError(
                    f"plan_partition: the model's forward does not tolerate removed units: with only unit "
                    f"'{unit}' kept (the rest removed as split_by_fqn removes them) it fails: "
                    f"{str(e).splitlines()[0]}. The forward must skip a None child, loop over what a list "
                    "holds, and take the previous stage's output where its first part is gone") from e
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    costs, memory = timing.costs(clock="host"), timing.deltas
    out = []
    for s in range(n):
        c = costs[s]
        out.append([c["f"], c["i"], c["w"], c["b"], float(memory[s]["mem_f"]), float(memory[s]["mem_w"])])
    return out


def _gathered(measured: list | str, group) -> list[list[float]]:
    """Every rank's measurements (or error) gathered; the per-field median over ranks (times)
    and maximum (bytes) (the gather rule), identical on every rank. ValueError on every rank if
    one failed."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        every = [measured]
    else:
        group = group if group is not None else dist.group.WORLD
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, measured, group=group)
    failed = [(r, m) for r, m in enumerate(every) if isinstance(m, str)]
    if failed:
        raise ValueError(failed[0][1] if len(every) == 1 else f"{failed[0][1]} (on rank {failed[0][0]})")
    # Every rank measured every unit: the gather rule (zbpipe.measurements.merge_stage_costs).
    keys = ("f", "i", "w", "b", "mem_f", "mem_w")
    merged = merge_stage_costs([{u: dict(zip(keys, row)) for u, row in enumerate(m)} for m in every])
    return [[merged[u][k] for k in keys] for u in range(len(every[0]))]


# ---- the plan ----------------------------------------------------------------------------------

def candidate_programs(schedules, pp: int, microbatches: int, units: int) -> tuple[list, list]:
    """(compiled candidates, [(name, reason)] of those that cannot run here)."""
    names = list(DEFAULT_SCHEDULES if schedules is None else schedules)
    if not names:
        raise ValueError("plan_partition: schedules is empty")
    known = set(_C.schedule_names())
    progs, skipped = [], []
    for name in names:
        if name in _COST_DRIVEN:
            raise ValueError(f"plan_partition: '{name}' plans its own program from the stages' costs; plan the "
                             "split with fixed schedules, then compile it with plan.stage_costs()")
        if name not in known or name == "inference":
            raise ValueError(f"plan_partition: '{name}' is not a training schedule (schedule_names(): "
                             f"{sorted(known - set(_COST_DRIVEN) - {'inference'})})")
        spr = 2 if name in TWO_PER_RANK else 1
        if spr * pp > units:
            skipped.append((name, f"{spr * pp} stages > {units} units"))
            continue
        try:
            progs.append(_compile(name, pp, microbatches, spr))
        except (_C.ScheduleError, ValueError) as e:
            skipped.append((name, str(e).splitlines()[0]))
    if not progs:
        raise ValueError(f"plan_partition: no candidate schedule builds for pp={pp}, microbatches={microbatches}, "
                         f"{units} units: {skipped}")
    return progs, skipped


def plan_partition(model: nn.Module, mb_args, *, pp: int, microbatches: int, loss_fn: Callable,
                   mb_target=None, mb_kwargs: dict | None = None, units: Sequence[str | Sequence[str]] | None = None,
                   schedules: Sequence[str] | None = None, memory_budget: float | None = None,
                   device: torch.device | str | None = None, group=None, comm_s: float = 0.0,
                   optimizer_states: float = 2.0, measure_steps: int = 3,
                   exhaustive_limit: int = 50_000, vocab_parallel: bool = False,
                   head: str | None = None) -> PartitionPlan:
    """The split of `model` into contiguous groups of `units` and the schedule (a compile name)
    with the least simulated step whose peak bytes per rank fit `memory_budget`.

    mb_args / mb_kwargs / mb_target: one microbatch (a tuple of positional arguments or one
    tensor, keyword arguments of every stage, the loss_fn's target). units: module FQNs in the
    order they run, a list of FQNs for modules that must stay in one stage (default: the
    model's direct children, ModuleList / ModuleDict / Sequential expanded one level, in the
    order one forward calls them). schedules: candidate fixed schedules (default
    DEFAULT_SCHEDULES; pp stages for one per rank, 2pp for V and looped).
    memory_budget: bytes per rank (activations by the memory model, plus parameters, gradients,
    `optimizer_states` parameter-sized optimizer states (2: Adam) and buffers of its stages).
    device: where the units are measured (default: where the model's parameters are; the model
    must be there). In a process group (`group`, default the world when one is initialised)
    every rank measures, the ranks gather and all plan from the same numbers (times: median over
    ranks), so every rank reaches the same plan; without one it plans in this process. comm_s:
    the cross-rank latency the simulation adds per message. Searches every split where a
    schedule has at most `exhaustive_limit` of them, else a local search from the min-max split.

    vocab_parallel: plan the layers with the LM head split over every rank (zbpipe.
    VocabParallelOutput; docs/vocab_parallel.md): `head` (default: the last unit, an nn.Linear)
    is measured as every unit is and, on its largest shard, as the S and T passes of the
    vocabulary-parallel runtime; the other units are split with every rank doing its shard's S
    and T (placed in each candidate's program as compile(..., vocab_parallel=True) places them)
    and holding its shard. The plan (module_fqns_per_stage without the head, program() with the
    passes) keeps the best split with the head on one rank as head_on_one_rank; table() shows both.

    Raises ValueError, on every rank, before anything runs: a unit list that leaves a parameter
    out, names a unit twice or names a non-module; pp larger than the number of units; a budget
    no split fits (with the smallest peak found); a forward that fails with a unit alone in its
    stage (naming the unit); with vocab_parallel, a head that is not one nn.Linear unit."""
    if not isinstance(pp, int) or pp < 1 or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"plan_partition: pp and microbatches must be integers >= 1, got {pp!r}, {microbatches!r}")
    if measure_steps < 1:
        raise ValueError(f"plan_partition: measure_steps must be >= 1, got {measure_steps}")
    mb_args = tuple(mb_args) if isinstance(mb_args, (tuple, list)) else (mb_args,)
    mb_kwargs = dict(mb_kwargs or {})
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    groups = _unit_groups(_default_units(model, mb_args, mb_kwargs) if units is None else units)
    _check_units(model, groups)
    units = groups
    if pp > len(units):
        raise ValueError(f"plan_partition: pp={pp} is larger than the number of units ({len(units)}: "
                         f"{['+'.join(g) for g in units]}); give finer units or a smaller pp")
    head_index = _head_unit(model, units, head) if vocab_parallel else None
    programs, skipped = candidate_programs(schedules, pp, microbatches, len(units))
    try:
        measured: list | str = _measure(model, units, mb_args, mb_kwargs, mb_target, loss_fn, device, measure_steps)
        if head_index is not None:
            measured.append(_measure_head(model, units, head_index, mb_args, mb_kwargs, mb_target, pp, device,
                                          measure_steps))
    except ValueError as e:
        measured = str(e)
    rows = _gathered(measured, group)
    static = _static_bytes(model, units, optimizer_states)
    costs = [UnitCost("+".join(g), *(float(v) for v in row[:4]), row[4], row[5], *static[k], modules=g)
             for k, (g, row) in enumerate(zip(units, rows))]
    plan = search_split(costs, programs, skipped, pp, microbatches, memory_budget, comm_s, exhaustive_limit)
    if head_index is None:
        return plan
    layers = costs[:head_index] + costs[head_index + 1:]
    vocab = _vocab_model(model.get_submodule(units[head_index][0]), rows[-1], pp, comm_s, optimizer_states)
    split = search_split(layers, programs, skipped, pp, microbatches, memory_budget, comm_s, exhaustive_limit, vocab)
    split.head, split.head_on_one_rank = costs[head_index].fqn, plan
    return split


def _head_unit(model: nn.Module, units: list[tuple[str, ...]], head: str | None) -> int:
    """The index of the head's unit: `head`, or the last unit; ValueError unless it is one
    nn.Linear module on its own."""
    index = len(units) - 1 if head is None else next((k for k, g in enumerate(units) if head in g), None)
    if index is None:
        raise ValueError(f"plan_partition: head '{head}' is not a unit ({['+'.join(g) for g in units]})")
    group = units[index]
    module = model.get_submodule(group[0])
    if len(group) != 1 or not isinstance(module, nn.Linear):
        raise ValueError(f"plan_partition(vocab_parallel=True): the head must be one nn.Linear unit, got unit "
                         f"'{'+'.join(group)}' ({type(module).__name__}); name it with head=")
    return index


def _measure_head(model, units, head_index, mb_args, mb_kwargs, mb_target, pp, device, steps) -> list[float]:
    """[S, T, 0, 0, mem_s, 0] of the head's largest shard (ceil(V / pp) rows) on one microbatch:
    the executor's S and T entries timed in a one-rank pipeline of the vocabulary-parallel head,
    on the hidden states the model without its head gives; mem_s is what an S keeps for its T
    (the shard's softmax in fp32, the head's input)."""
    from .schedules import Schedule1F1B
    from .vocab_parallel import VocabParallelOutput

    head = model.get_submodule(units[head_index][0])
    rows = -(-head.out_features // pp)
    body = prune(copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())}), "",
                  {n for k, g in enumerate(units) if k != head_index for n in g})
    with torch.no_grad(), torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        hidden = body(*mb_args, **mb_kwargs)
    if not isinstance(hidden, torch.Tensor) or hidden.shape[-1] != head.in_features:
        raise ValueError(f"plan_partition(vocab_parallel=True): the model without its head returns "
                         f"{type(hidden).__name__}{list(getattr(hidden, 'shape', []))}, not hidden states of width "
                         f"{head.in_features} (the head's input)")
    tokens = hidden.shape[:-1]
    if isinstance(mb_target, torch.Tensor) and not mb_target.is_floating_point() and mb_target.shape == tokens:
        target = mb_target.remainder(rows)
    else:
        target = torch.randint(rows, tuple(tokens), generator=torch.Generator().manual_seed(0))
    shard = nn.Linear(head.in_features, rows, bias=head.bias is not None, device=device, dtype=head.weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(head.weight[:rows])
        if head.bias is not None:
            shard.bias.copy_(head.bias[:rows])
    pg = _one_process_group()
    stage = PipelineStage(_Passthrough(hidden.dtype), 0, 1, device, group=pg)
    sched = Schedule1F1B(stage, 1, output=VocabParallelOutput(shard, group=pg))
    times: dict[str, list[float]] = {"S": [], "T": []}
    for k in range(steps + 1):
        sched.step(hidden.detach(), target=target.to(device))
        if k == 0:
            continue  # warm-up
        for rec in sched.trace():
            kind = rec["action"].strip("0123456789")  # "0S0" -> "S"
            if kind in times:
                times[kind].append(action_seconds(rec, "host"))
    n = hidden[..., 0].numel()
    mem_s = n * rows * 4 + hidden.numel() * hidden.element_size()
    return [statistics.median(times["S"]), statistics.median(times["T"]), 0.0, 0.0, float(mem_s), 0.0]


class _Passthrough(nn.Module):
    """A stage that hands its input on as its output, through one scalar parameter (so the
    output has a gradient graph, as a real last stage's does)."""

    def __init__(self, dtype):
        super().__init__()
        self.one = nn.Parameter(torch.ones((), dtype=dtype))

    def forward(self, x):
        return x * self.one


def _vocab_model(head: nn.Linear, measured: list[float], pp: int, comm_s: float, optimizer_states: float) -> dict:
    """The head's per-rank S, T (scaled from the largest shard by its rows), mem_s and static
    bytes (its rows' parameters, gradients and optimizer states), as the core's VocabPlan."""
    vocab, rows_max = head.out_features, -(-head.out_features // pp)
    rows = [(r + 1) * vocab // pp - r * vocab // pp for r in range(pp)]
    per_row = (head.in_features + (1 if head.bias is not None else 0)) * head.weight.element_size()
    return dict(s=[measured[0] * n / rows_max for n in rows], t=[measured[1] * n / rows_max for n in rows],
                mem_s=[measured[4] * n / rows_max for n in rows], collective=comm_s,
                static_bytes=[n * per_row * (2 + optimizer_states) for n in rows])


def unit_profile(units: Sequence[UnitCost]) -> _C.UnitProfile:
    return _C.UnitProfile([u.f for u in units], [u.i for u in units], [u.w for u in units], [u.b for u in units],
                          [u.mem_f for u in units], [u.mem_w for u in units], [u.static_bytes for u in units])


def search_split(costs: list[UnitCost], programs: list, skipped: list, pp: int, microbatches: int,
            memory_budget: float | None, comm_s: float, exhaustive_limit: int, vocab: dict | None = None) -> PartitionPlan:
    """The core's search over the candidates, and the plan around its answer (vocab: the head
    split over the ranks, the core's VocabPlan as a dict)."""
    profile = unit_profile(costs)
    budget = 0.0 if memory_budget is None else float(memory_budget)
    res = _C.plan_partition(programs, profile, comm=comm_s, memory_budget=budget, exhaustive_limit=exhaustive_limit,
                            vocab=vocab)
    if res.program < 0:
        least = res.least_peak
        raise ValueError(
            f"plan_partition: memory_budget {budget:.0f} bytes per rank fits no split; the smallest peak found is "
            f"{max(least.peak_bytes):.0f} bytes ({programs[res.least_peak_program].schedule}, units per stage "
            f"{[hi - lo for lo, hi in zip(least.bounds, least.bounds[1:])]})")
    chosen = programs[res.program]
    even = _C.even_bounds(len(costs), chosen.num_stages)
    even_score = _C.score_split(chosen, profile, even, comm_s, budget, vocab)
    candidates = [(p.schedule, r.makespan if r.bounds and r.fits else None, max(r.peak_bytes) if r.bounds else None)
                  for p, r in zip(programs, res.per_program)] + [(name, None, None) for name, _ in skipped]
    share = (sum(u.f + u.i + u.w for u in costs) + (sum(vocab["s"]) + sum(vocab["t"]) if vocab else 0.0)) / pp
    heavy = max(costs, key=lambda u: u.f + u.i + u.w)
    return PartitionPlan(
        module_fqns_per_stage=_stages_of(costs, res.best.bounds), schedule=chosen.schedule,
        predicted_step_s=res.best.makespan, peak_bytes=list(res.best.peak_bytes), units=costs, pp=pp,
        microbatches=microbatches, bounds=list(res.best.bounds), even_bounds=list(even),
        even_step_s=even_score.makespan, even_peak_bytes=list(even_score.peak_bytes), candidates=candidates,
        exact=res.exact, simulated=res.simulated, memory_budget=memory_budget, comm_s=comm_s,
        bounding_unit=heavy.fqn if heavy.f + heavy.i + heavy.w > share else None, vocab=vocab)


# The names the tests knew these by.
_programs, _search = candidate_programs, search_split
