"""PipelineStage: wraps the nn.Module of one pipeline stage for the C++ executor.

The executor calls the ``_zb_*`` methods (through a trampoline in csrc/python/module.cpp) in
program order; a schedule's ``step`` fills the per-step state first (microbatch arguments,
targets, loss function) and reads the losses and outputs afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import _tree
from .split_backward import DeferredLinearHook, WeightWork, backward_input, backward_weight


class PipelineStage:
    """One stage of the pipeline, living on this rank.

    Args:
        submodule: the stage's module.
        stage_index, num_stages: global position of the stage.
        device: where the stage computes (and where its messages live).
        group: the pipeline's process group (default: the world group).
        input_args: example microbatch input (tensor / tuple / dict); by default the shapes are
            inferred at the first step (the previous stage's outputs). When given, a mismatch
            with what the previous stage produces fails every rank at the first step.
        output_args: example microbatch output; by default inferred (a meta-device run where
            the module allows, else one real no-grad forward).
        deferred_linear: run the nn.Linear layers' weight gradients as queued work in the W
            action instead of splitting the autograd graph (the layers' ``forward`` is
            replaced on the instances, so build the stage from the module you train).

    Shapes are fixed at the first step: every microbatch of every later step must match, and
    a stage producing another shape fails on its rank with both shapes named.
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        input_args: Any = None,
        output_args: Any = None,
        *,
        deferred_linear: bool = False,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        self.group_rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self._input_args = input_args
        self._output_args = output_args
        self._linear = DeferredLinearHook(submodule) if deferred_linear else None
        self._in_structure: str | None = None
        self._in_parsed: Any = None
        self._in_differentiable: list[bool] = []
        self._out_structure: str | None = None
        self._begin(None, None, None, None, False, 1.0)

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, rank={self.group_rank})"

    # ---- per-step state, set by the schedule ---------------------------------------------

    def _begin(self, args, kwargs, targets, loss_fn, has_backward: bool, scale: float) -> None:
        self._mb_args = args        # first stage: per-microbatch positional args
        self._mb_kwargs = kwargs    # every stage: per-microbatch keyword args
        self._targets = targets     # last stage: per-microbatch targets
        self._loss_fn = loss_fn
        self._has_backward = has_backward
        self._scale = scale         # gradient of each microbatch loss (1/n for a mean)
        self._saved: dict[int, tuple] = {}    # mb -> (input leaves, roots) between F and B/I
        self._weight: dict[int, Any] = {}     # mb -> WeightWork between I and W
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}

    def _end(self) -> None:
        self._begin(None, None, None, None, False, 1.0)

    # ---- executor callbacks ----------------------------------------------------------------

    def _call(self, mb: int, inputs: list[torch.Tensor]):
        kwargs = self._mb_kwargs[mb] if self._mb_kwargs else {}
        if self.is_first:
            return self.submod(*self._mb_args[mb], **kwargs)
        args, named = _tree.as_call_args(_tree.unflatten(inputs, self._in_parsed))
        return self.submod(*args, **named, **kwargs)

    def _zb_forward(self, mb: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._has_backward:
            for t, d in zip(inputs, self._in_differentiable):
                if d:
                    t.requires_grad_(True)
            if self._linear is not None:
                self._linear.queue = []
            try:
                out = self._call(mb, inputs)
            finally:
                queue = self._linear.queue if self._linear is not None else None
                if self._linear is not None:
                    self._linear.queue = None
        else:
            with torch.no_grad():
                out = self._call(mb, inputs)
            queue = None
        if self.is_last:
            self.outputs[mb] = _detach(out)
            roots: list[torch.Tensor] = []
            if self._loss_fn is not None:
                loss = self._loss_fn(out, self._targets[mb])
                self.losses[mb] = loss.detach()
                roots = [loss]
            if self._has_backward:
                self._saved[mb] = (inputs, roots, queue)
            return []
        flat, _ = _tree.flatten(out)
        if self._has_backward:
            self._saved[mb] = (inputs, [t for t in flat if _tree.differentiable(t)], queue)
        # Detached: a same-rank next stage must start its own graph.
        return [t.detach() for t in flat]

    def _roots(self, mb: int, grads: list[torch.Tensor]):
        inputs, outs, queue = self._saved.pop(mb)
        if self.is_last:
            root_grads = [torch.full_like(r, self._scale) for r in outs]
            return inputs, outs, root_grads, queue
        roots, root_grads = [], []
        for o, g in zip(outs, grads):
            if o.requires_grad:
                roots.append(o)
                root_grads.append(g)
        return inputs, roots, root_grads, queue

    def _input_grads(self, inputs, grads) -> list[torch.Tensor]:
        out = []
        for t, d, g in zip(inputs, self._in_differentiable, grads):
            if d:
                out.append(g if g is not None else torch.zeros_like(t))
        return out

    def _zb_backward_full(self, mb: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        inputs, roots, root_grads, queue = self._roots(mb, grads)
        if roots:
            torch.autograd.backward(roots, grad_tensors=root_grads)
        if queue:
            backward_weight_queue(queue)
        return self._input_grads(inputs, [t.grad if t.requires_grad else None for t in inputs])

    def _zb_backward_input(self, mb: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        inputs, roots, root_grads, queue = self._roots(mb, grads)
        if queue is not None:
            # Deferred Linear: a plain backward; the Linear weight gradients wait in the queue.
            if roots:
                torch.autograd.backward(roots, grad_tensors=root_grads, inputs=None)
            self._weight[mb] = WeightWork(linear=queue)
            return self._input_grads(inputs, [t.grad if t.requires_grad else None for t in inputs])
        in_grads, work = backward_input(roots, root_grads, inputs)
        self._weight[mb] = work
        return self._input_grads(inputs, in_grads)

    def _zb_backward_weight(self, mb: int) -> None:
        backward_weight(self._weight.pop(mb))

    def _zb_infer_outputs(self, specs, structure: str):
        """Handshake: output signature for the given input signature (see StageHandle)."""
        kwargs = self._mb_kwargs[0] if self._mb_kwargs else {}
        if self.is_first:
            args = self._mb_args[0]
            got = _tree.specs_of([a for a in args if isinstance(a, torch.Tensor)])
            where = "its microbatch arguments"
        else:
            got = [(tuple(s), d) for s, d in specs]
            self._in_structure = structure
            self._in_parsed = _tree.parse(structure)
            self._in_differentiable = [_tree.differentiable(d) for _, d in got]
            where = f"stage {self.stage_index - 1}'s outputs"
        if self._input_args is not None:
            declared = _tree.specs_of(_tree.flatten(self._input_args, "input_args")[0])
            if declared != got:
                raise ValueError(
                    f"stage {self.stage_index} was declared with input_args "
                    f"{_tree.format_specs(declared)}, but {where} are {_tree.format_specs(got)}"
                )
        if self._output_args is not None:
            out = self._output_args
        else:
            out = self._shape_run(got, kwargs)
        flat, st = _tree.flatten(out)
        self._out_structure = st
        return _tree.specs_of(flat), st

    def _shape_run(self, specs, kwargs):
        """Output of one microbatch without touching real data: meta tensors where the module
        allows it, else one real no-grad forward on zeros."""
        with torch.no_grad():
            try:
                state = {
                    k: torch.empty_like(v, device="meta")
                    for k, v in list(self.submod.named_parameters()) + list(self.submod.named_buffers())
                }
                meta_kw = {k: _to_meta(v) for k, v in kwargs.items()}
                if self.is_first:
                    args, named = tuple(_to_meta(a) for a in self._mb_args[0]), {}
                else:
                    tensors = [torch.empty(s, dtype=d, device="meta") for s, d in specs]
                    args, named = _tree.as_call_args(_tree.unflatten(tensors, self._in_structure))
                return torch.func.functional_call(self.submod, state, args, {**named, **meta_kw})
            except Exception:
                if self.is_first:
                    return self.submod(*self._mb_args[0], **kwargs)
                tensors = [torch.zeros(s, dtype=d, device=self.device) for s, d in specs]
                args, named = _tree.as_call_args(_tree.unflatten(tensors, self._in_structure))
                return self.submod(*args, **named, **kwargs)


def backward_weight_queue(queue: list) -> None:
    for entry in queue:
        entry.run()
    queue.clear()


def _to_meta(v):
    return torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v


def _detach(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    try:
        flat, st = _tree.flatten(out)
    except TypeError:
        return out  # a last-stage output of another kind is returned as is
    return _tree.unflatten([t.detach() for t in flat], st)
