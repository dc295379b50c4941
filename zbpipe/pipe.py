"""Tracer front end: torch's pipeline() splits a module at pipe_split() / SplitPoint marks
(torch.export, exactly as torch.distributed.pipelining does); zbpipe wraps each split
submodule in a zbpipe PipelineStage.

    pipe = zbpipe.pipeline(model, mb_args=(x_mb,), mb_kwargs={"y": y_mb})
    stage = pipe.build_stage(rank, device)          # a zbpipe.PipelineStage
    sched = zbpipe.Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)

torch's split graph may pass a value from stage i to any later stage, and feeds root inputs to
whichever stage uses them. zbpipe's executor moves tensors between adjacent stages only, so a
routing plan read from that graph forwards every value a later stage needs through the stages in
between (root inputs enter at stage 0, where step() receives them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.pipelining import SplitPoint, pipe_split  # noqa: F401  (re-exported)
from torch.distributed.pipelining import pipeline as _torch_pipeline

from .stage import PipelineStage


@dataclass
class _StagePlan:
    """How one stage's module is called, in value names of the split graph."""

    receives: list[str] = field(default_factory=list)  # values arriving from stage i-1, in order
    call_args: list[str] = field(default_factory=list)  # the submodule's positional arguments
    produces: list[tuple[str, int | None]] = field(default_factory=list)  # (value, index in output)
    sends: list[str] = field(default_factory=list)      # values passed on to stage i+1, in order


@dataclass
class PipeInfo:
    """The routing plan of a traced pipeline (what build_stage needs besides the module)."""

    num_stages: int
    root_inputs: list[str]        # placeholder names of the traced model, in call order
    stages: list[_StagePlan]
    output: Any                   # value name, or tuple of them: the model's output
    has_loss_and_backward: bool = False


def _plan(split_gm: torch.fx.GraphModule) -> PipeInfo:
    graph = split_gm.graph
    roots: list[str] = []
    producer: dict[str, int] = {}       # value -> stage that computes it (-1: root input)
    users: dict[str, set[int]] = {}     # value -> stages that read it
    stages: list[_StagePlan] = []
    stage_of_node: dict[str, int] = {}
    output: Any = None

    def name_of(arg) -> str:
        if not isinstance(arg, torch.fx.Node):
            raise NotImplementedError(
                f"zbpipe.pipeline: a stage takes the constant {arg!r} from the split graph; only "
                "values computed by stages or model inputs can cross stages")
        return arg.name

    for node in graph.nodes:
        if node.op == "placeholder":
            roots.append(node.name)
            producer[node.name] = -1
        elif node.op == "call_module":
            idx = len(stages)
            stage_of_node[node.name] = idx
            plan = _StagePlan(call_args=[name_of(a) for a in node.args])
            if node.kwargs:
                raise NotImplementedError("zbpipe.pipeline: keyword arguments between stages")
            for a in plan.call_args:
                users.setdefault(a, set()).add(idx)
            stages.append(plan)
            producer[node.name] = idx
            plan.produces.append((node.name, None))
        elif node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if src.op != "call_module":
                raise NotImplementedError(f"zbpipe.pipeline: unexpected split-graph node {node.format_node()}")
            idx = stage_of_node[src.name]
            plan = stages[idx]
            plan.produces = [p for p in plan.produces if p[0] != src.name]  # a tuple: use its items
            plan.produces.append((node.name, node.args[1]))
            producer[node.name] = idx
        elif node.op == "output":
            out = node.args[0]
            output = tuple(name_of(a) for a in out) if isinstance(out, (tuple, list)) else name_of(out)
        else:
            raise NotImplementedError(f"zbpipe.pipeline: unexpected split-graph node {node.format_node()}")

    n = len(stages)
    if n == 0:
        raise ValueError("zbpipe.pipeline: the split graph has no stages")
    for v in (output if isinstance(output, tuple) else (output,)):
        users.setdefault(v, set()).add(n - 1)  # the last stage returns the model's output
    order = list(producer)  # graph order: a stable order for every boundary
    for b in range(n - 1):  # values live across the boundary b -> b+1
        stages[b].sends = [v for v in order
                           if producer[v] <= b and any(u > b for u in users.get(v, ()))]
        stages[b + 1].receives = list(stages[b].sends)
    return PipeInfo(num_stages=n, root_inputs=roots, stages=stages, output=output)


class Pipe:
    """A traced, split model: torch's Pipe plus zbpipe's routing plan."""

    def __init__(self, torch_pipe):
        self._torch_pipe = torch_pipe
        self.split_gm = torch_pipe.split_gm
        self._info = _plan(self.split_gm)
        self.num_stages = self._info.num_stages
        self.has_loss_and_backward = False

    def info(self) -> PipeInfo:
        return self._info

    def get_stage_module(self, stage_index: int) -> torch.nn.Module:
        """The split submodule of a stage (parameters keep the original model's names)."""
        return self._torch_pipe.get_stage_module(stage_index)

    def build_stage(self, stage_index: int, device, group=None, **stage_kwargs) -> PipelineStage:
        """The zbpipe PipelineStage of `stage_index` (stage_kwargs: e.g. deferred_linear=True)."""
        return build_stage(self.get_stage_module(stage_index), stage_index, self._info, device,
                           group, **stage_kwargs)

    def __call__(self, *args, **kwargs):
        """The whole model in this process, through the same routing as the stages (returns the
        split graph's output tuple, as torch's Pipe does)."""
        values: Any = None
        for i in range(self.num_stages):
            fn = self.get_stage_module(i)
            values = _route(self._info, i, fn, args if i == 0 else tuple(values), kwargs, final=False)
        out = self._info.output
        return values if isinstance(out, tuple) else (values,)


def _route(info: PipeInfo, index: int, fn, args: tuple, kwargs: dict, final: bool = True):
    """Runs stage `index`'s module fn on what zbpipe hands the stage: the model's arguments on
    stage 0, else the previous stage's routed values (kwargs were routed from stage 0 already)."""
    plan = info.stages[index]
    if index == 0:
        env = _bind_roots(info.root_inputs, args, kwargs)
    else:
        if len(args) != len(plan.receives):
            raise ValueError(f"traced stage {index} expects {len(plan.receives)} values from stage "
                             f"{index - 1}, got {len(args)}")
        env = dict(zip(plan.receives, args))
    out = fn(*(env[a] for a in plan.call_args))
    for name, item in plan.produces:
        env[name] = out if item is None else out[item]
    if index < info.num_stages - 1:
        return tuple(env[v] for v in plan.sends)
    res = info.output
    if isinstance(res, tuple):
        return env[res[0]] if final and len(res) == 1 else tuple(env[v] for v in res)
    return env[res]


def _bind_roots(names: list[str], args: tuple, kwargs: dict) -> dict:
    if len(args) > len(names):
        raise TypeError(f"the traced model takes {len(names)} inputs ({', '.join(names)}), got "
                        f"{len(args)} positional arguments")
    env = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"the traced model has no input '{k}' (inputs: {', '.join(names)})")
        env[k] = v
    missing = [n for n in names if n not in env]
    if missing:
        raise TypeError(f"the traced model needs inputs {missing} (it was traced with them)")
    return env


class _TracedStage(PipelineStage):
    """A PipelineStage over a split submodule: calls it through the pipe's routing plan."""

    def __init__(self, submodule, stage_index, info: PipeInfo, device, group=None, **kwargs):
        super().__init__(submodule, stage_index, info.num_stages, device, group=group, **kwargs)
        self._pipe_info = info

    def _invoke(self, fn, args: tuple, kwargs: dict):
        return _route(self._pipe_info, self.stage_index, fn, args, kwargs if self.is_first else {})


def pipeline(module: torch.nn.Module, mb_args: tuple, mb_kwargs: dict | None = None,
             split_spec: dict | None = None, split_policy=None) -> Pipe:
    """Splits `module` as torch.distributed.pipelining.pipeline does (torch.export on one
    microbatch of example inputs, cut at pipe_split() calls or at split_spec's SplitPoints)."""
    return Pipe(_torch_pipeline(module, mb_args=mb_args, mb_kwargs=mb_kwargs,
                                split_spec=split_spec, split_policy=split_policy))


def build_stage(stage_module: torch.nn.Module, stage_index: int, pipe_info: PipeInfo, device,
                group=None, **stage_kwargs) -> PipelineStage:
    """torch's build_stage for zbpipe: the stage of a traced pipeline (pipe.info())."""
    if not 0 <= stage_index < pipe_info.num_stages:
        raise ValueError(f"stage_index must be in [0, {pipe_info.num_stages}), got {stage_index}")
    return _TracedStage(stage_module, stage_index, pipe_info, device, group, **stage_kwargs)
