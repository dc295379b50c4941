"""PipelineStage: wraps the nn.Module of one pipeline stage for the C++ executor.

The executor calls the ``_zb_*`` methods (through a trampoline in csrc/python/module.cpp) in
program order; a schedule's ``step`` fills the per-step state first (microbatch arguments,
targets, loss function) and reads the losses and outputs afterwards. Only forwards run here:
the executor keeps what a forward returns and runs the backward (B, or I then W) itself on the
autograd engine (csrc/runtime/stage_backward.h).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _tree
from .checkpointing import recompute_once
from .data_parallel import adapter_for
from .deferred_linear import DeferredLinearHook


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
        dw_builder: torch's hook for modules that compute their own weight gradients: the
            backward (B, or I) runs the full autograd backward, then ``dw_builder()`` is called
            and the runner it returns is called at the microbatch's W (right away after a B).

    Shapes follow the first stage's inputs: a step whose microbatch arguments have a signature
    (shapes, dtypes, structure) no earlier step had renegotiates every stage's shapes (the
    handshake again; each signature is negotiated once and remembered). All microbatches of one
    step share their shapes: a stage producing another shape for one of them fails on its rank
    with both shapes named. Keyword arguments of stages after the first must keep their shapes
    while the first stage's inputs do.

    The module may be wrapped in ``DistributedDataParallel`` or be the root of ``fully_shard``
    (FSDP2) over a data-parallel group: gradients are then reduced once per step, at the stage's
    last backward action (see zbpipe/data_parallel.py).
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
        dw_builder: Callable[[], Callable[[], None]] | None = None,
        deferred_linear: bool = False,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
        if dw_builder is not None and deferred_linear:
            raise ValueError("dw_builder and deferred_linear both define the W action; give one")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        # The group's own rank and size: also for groups torch.distributed has not registered.
        self.group_rank = self.group.rank()
        self.group_size = self.group.size()
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self._input_args = input_args
        self._output_args = output_args
        self._linear = DeferredLinearHook(submodule) if deferred_linear else None
        self.dw_builder = dw_builder
        self._dw_runners: dict[int, Callable[[], None]] = {}  # mb -> runner, from I to W
        self._dp = adapter_for(submodule, deferred_linear)
        self._parsed: dict[str, Any] = {}  # input structure string -> parsed, per signature
        self._in_structure: str | None = None
        self._in_parsed: Any = None
        self._out_structure: str | None = None
        self._begin(None, None, None, None, False)

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, rank={self.group_rank})"

    # ---- per-step state, set by the schedule ---------------------------------------------

    def _begin(self, args, kwargs, targets, loss_fn, has_backward: bool, keep_outputs: bool = True,
               loss_kwargs: dict | None = None) -> None:
        self._mb_args = args        # first stage: per-microbatch positional args
        self._mb_kwargs = kwargs    # every stage: per-microbatch keyword args
        self._targets = targets     # last stage: per-microbatch targets
        self._loss_fn = loss_fn
        self._loss_kwargs = loss_kwargs or {}  # the loss function's, the same every microbatch
        self._has_backward = has_backward
        self._keep_outputs = keep_outputs      # last stage: keep outputs for step's return
        self._dw_runners = {}
        self._queues: dict[int, list] = {}    # mb -> deferred Linear weight work, F to W
        if self._linear is not None:
            self._linear.in_step = has_backward  # a checkpoint recomputing defers the same way
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}

    def _step_begin(self, training: bool) -> None:
        """A schedule step starts on this stage (after _begin): data parallelism's step state."""
        if self._dp is not None:
            self._dp.step_begin(training)

    def _end(self, failed: bool = False) -> None:
        if self._dp is not None:
            self._dp.step_end(failed)
        self._begin(None, None, None, None, False)

    # ---- executor callbacks ----------------------------------------------------------------

    def _invoke(self, fn, args: tuple, kwargs: dict):
        """The one place the module runs: fn is the module (or a functional call of it).
        Front ends that route values between stages (zbpipe.pipeline) override it."""
        return fn(*args, **kwargs)

    def _call(self, mb: int, inputs: list[torch.Tensor]):
        kwargs = self._mb_kwargs[mb] if self._mb_kwargs else {}
        if self.is_first:
            return self._invoke(self.submod, tuple(self._mb_args[mb]), kwargs)
        args, named = _tree.as_call_args(_tree.unflatten(inputs, self._in_parsed))
        return self._invoke(self.submod, tuple(args), {**named, **kwargs})

    def _zb_forward(self, mb: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Flat outputs (the executor detaches what it sends), or [loss] on the last stage."""
        if self._has_backward:  # checkpointed regions made here recompute once (issue #21)
            with recompute_once():
                return self._zb_forward_inner(mb, inputs)
        return self._zb_forward_inner(mb, inputs)

    def _zb_forward_inner(self, mb: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self._has_backward:
            with torch.no_grad():
                out = self._call(mb, inputs)
        elif self._linear is not None:
            self._linear.queue = self._queues[mb] = []
            try:
                out = self._call(mb, inputs)
            finally:
                self._linear.queue = None
        else:
            out = self._call(mb, inputs)
        if not self.is_last:
            return _tree.flatten(out)[0]
        if self._keep_outputs:
            self.outputs[mb] = _detach(out)
        if self._loss_fn is None:
            return []
        with contextlib.nullcontext() if self._has_backward else torch.no_grad():
            loss = self._loss_fn(out, self._targets[mb], **self._loss_kwargs)
        self.losses[mb] = loss.detach()
        return [loss] if self._has_backward else []

    @property
    def _zb_queues_weight_work(self) -> bool:
        """Read once by the executor: W runs _zb_weight_work instead of its graph split."""
        return self._linear is not None or self.dw_builder is not None

    def _zb_weight_work_queued(self, mb: int) -> None:
        """Right after microbatch mb's backward (B or I): a dw_builder builds its runner."""
        if self.dw_builder is not None:
            self._dw_runners[mb] = self.dw_builder()

    def _zb_weight_work(self, mb: int) -> None:
        """W of a deferred_linear stage (the Linear weight gradients its backward queued) or
        of a dw_builder stage (the runner built after the backward)."""
        if self.dw_builder is not None:
            self._dw_runners.pop(mb)()
            return
        for entry in self._queues.pop(mb):
            entry.run()

    @property
    def _zb_syncs_gradients(self) -> bool:
        """Read once by the executor: call _zb_grad_sync_begin/_end around the last backward."""
        return self._dp is not None

    def _zb_grad_sync_begin(self, roots: list[torch.Tensor]) -> None:
        self._dp.sync_begin(roots)

    def _zb_grad_sync_end(self) -> None:
        self._dp.sync_end()

    def _zb_step_inputs(self):
        """First stage, every step: the signature of microbatch 0's arguments, every tensor in
        its positional and keyword arguments (the schedule splits all microbatches alike)."""
        kwargs = self._mb_kwargs[0] if self._mb_kwargs else {}
        tensors: list[torch.Tensor] = []
        layout = _layout((self._mb_args[0], kwargs), tensors)
        return _tree.specs_of(tensors), layout

    def _zb_use_inputs(self, structure: str) -> None:
        """The executor switched back to a signature negotiated earlier: its input structure."""
        self._in_structure = structure
        if structure not in self._parsed:
            self._parsed[structure] = _tree.parse(structure)
        self._in_parsed = self._parsed[structure]

    def _zb_infer_outputs(self, specs, structure: str):
        """Handshake: output signature for the given input signature (see StageHandle)."""
        kwargs = self._mb_kwargs[0] if self._mb_kwargs else {}
        if self.is_first:
            args = self._mb_args[0]
            got = _tree.specs_of([a for a in args if isinstance(a, torch.Tensor)])
            where = "its microbatch arguments"
        else:
            got = [(tuple(s), d) for s, d in specs]
            self._zb_use_inputs(structure)
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
        allows it, else one real no-grad forward on zeros. A DDP stage runs its inner module
        (no buffer broadcast); an FSDP stage its real, unsharded one (FSDP swaps parameters)."""
        module = self.submod if self._dp is None else self._dp.shape_module
        with torch.no_grad():
            try:
                if module is None:
                    raise NotImplementedError("no meta run")
                state = {
                    k: torch.empty_like(v, device="meta")
                    for k, v in list(module.named_parameters()) + list(module.named_buffers())
                }
                meta_kw = {k: _to_meta(v) for k, v in kwargs.items()}
                if self.is_first:
                    args, named = tuple(_to_meta(a) for a in self._mb_args[0]), {}
                else:
                    tensors = [torch.empty(s, dtype=d, device="meta") for s, d in specs]
                    args, named = _tree.as_call_args(_tree.unflatten(tensors, self._in_structure))

                def meta_call(*a, **k):
                    # tie_weights=False: with a submodule registered twice (weights shared by
                    # module), torch's tie handling swaps it twice and restores it to meta.
                    return torch.func.functional_call(module, state, a, k, tie_weights=False)

                return self._invoke(meta_call, tuple(args), {**named, **meta_kw})
            except Exception:
                module = module if module is not None else self.submod
                if self.is_first:
                    return self._invoke(module, tuple(self._mb_args[0]), kwargs)
                tensors = [torch.zeros(s, dtype=d, device=self.device) for s, d in specs]
                args, named = _tree.as_call_args(_tree.unflatten(tensors, self._in_structure))
                return self._invoke(module, tuple(args), {**named, **kwargs})


def _layout(obj, out: list) -> str:
    """Collects the tensors nested in tuples, lists and dicts into `out`; returns the layout
    (containers, keys and where the tensors sit; other values are only marked)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return "T"
    if isinstance(obj, (tuple, list)):
        return "(" + ",".join(_layout(v, out) for v in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{_layout(v, out)}" for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))) + "}"
    return "."


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
