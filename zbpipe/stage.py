"""PipelineStage: wraps the nn.Module of one pipeline stage for the C++ executor.

The executor calls the ``_zb_*`` methods (through the trampoline in csrc/python/py_stage.h; the
list: zbpipe/stage_interface.py's StageInterface) in program order, each with the StepData of the running step (zbpipe/step_data.py): the schedule
builds one per step and hands it to the executor's run, which passes it to every stage call and
returns the last stage's outputs and losses. A stage keeps only what is its own (module,
placement, shape cache, data-parallel adapter), nothing of a step. Only forwards run here: the
executor keeps what a forward returns and runs the backward (B, or I then W) itself on the
autograd engine (csrc/runtime/stage_backward.h).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _tree
from .checkpointing import recompute_ahead, recompute_once
from .data_parallel import adapter_for
from .deferred_linear import DeferredLinearHook
from .devices import placement
from .step_data import StepData, input_signature  # noqa: F401 - input_signature: also imported from here

# What a module raises where fake tensors cannot run it (no fake kernel, a data-dependent value,
# a conversion that needs data): shape inference then runs it for real. Any other exception is
# the user's and propagates from the fake run as it is.
_FAKE_UNSUPPORTED = (NotImplementedError, RuntimeError, TypeError)


class PipelineStage:
    """One stage of the pipeline, living on this rank.

    The arguments are torch 2.13's, in its order (positional or keyword); zbpipe's own
    (deferred_linear) are keyword-only.

    Args:
        submodule: the stage's module.
        stage_index, num_stages: global position of the stage.
        device: where the stage computes (and where its messages live), in any form torch
            takes: kept as ``stage.device`` the way torch places tensors there
            (zbpipe/devices.py: ``cpu:N`` is ``cpu``, ``cuda`` the current CUDA device).
        input_args: example microbatch input (tensor / tuple / dict); by default the shapes are
            inferred at the first step (the previous stage's outputs). When given, a mismatch
            with what the previous stage produces fails every rank at the first step.
        output_args: example microbatch output; by default inferred (see _shape_run).
        output_grads, input_grads: torch's static gradient metadata, which torch needs only
            for DTensor stage inputs and outputs. zbpipe's stages exchange plain tensors whose
            gradients have the activations' shapes: accepted and kept as attributes, unused.
        group: the pipeline's process group (default: the world group).
        dw_builder: torch's hook for modules that compute their own weight gradients: the
            backward (B, or I) runs the full autograd backward, then ``dw_builder()`` is called
            and the runner it returns is called at the microbatch's W (right away after a B).
        get_mesh: torch's callback that rebuilds DTensor stage inputs from the plain tensors
            received (torchtitan passes one). zbpipe's stages send and receive plain tensors
            and never call it: it is accepted and kept as ``stage.get_mesh``, with no effect.
        deferred_linear: run the nn.Linear layers' weight gradients as queued work in the W
            action instead of splitting the autograd graph (the layers' ``forward`` is
            replaced on the instances, so build the stage from the module you train).

    Shapes follow the first stage's inputs: a step whose microbatch arguments have a signature
    (shapes, dtypes, structure) no earlier step had renegotiates every stage's shapes (the
    handshake again; each signature is negotiated once and remembered). All microbatches of one
    step share their shapes: a stage producing another shape for one of them fails on its rank
    with both shapes named. Keyword arguments of stages after the first must keep their shapes
    while the first stage's inputs do.

    The module may be wrapped in ``DistributedDataParallel`` or be the root of ``fully_shard``
    (FSDP2) over a data-parallel group: gradients are then reduced once per step, at the stage's
    last backward action (see zbpipe/data_parallel.py). As in torch, ``stage.submod`` is the
    module the stage runs and may be replaced, and the module wrapped or sharded in place,
    after the stage is built (torchtitan: ``fully_shard``, then ``stage.submod = m``): a
    schedule reads the data parallelism of each stage's module when it first runs it (its
    first step, and its first eval), and a step after that whose stage module gained or lost
    data parallelism raises ValueError. ``deferred_linear`` patches the Linear layers of the
    module given here: a replacement must hold those layers (a wrapper of the module does).
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str | int,
        input_args: Any = None,
        output_args: Any = None,
        output_grads: Any = None,
        input_grads: Any = None,
        group: dist.ProcessGroup | None = None,
        dw_builder: Callable[[], Callable[[], None]] | None = None,
        get_mesh: Callable | None = None,
        *,
        deferred_linear: bool = False,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
        if dw_builder is not None and deferred_linear:
            raise ValueError("dw_builder and deferred_linear both define the W action; give one")
        _check_group(group, input_args)
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = placement(device)
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        # The group's own rank and size: also for groups torch.distributed has not registered.
        self.group_rank = self.group.rank()
        self.group_size = self.group.size()
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self._input_args = input_args
        self._output_args = output_args
        # torch's static metadata of the gradients (it needs them only for DTensor stage I/O):
        # zbpipe derives gradient shapes from the agreed activations and keeps these unused.
        self.output_grads, self.input_grads = output_grads, input_grads
        self._linear = DeferredLinearHook(submodule) if deferred_linear else None
        if self._linear is not None and self._linear.not_deferred:
            warnings.warn(f"zbpipe: stage {stage_index}: deferred_linear keeps the forward of "
                          f"{self._linear.describe_not_deferred()}; their weight gradients are "
                          "computed in I with the rest of the stage's backward", RuntimeWarning, stacklevel=2)
        self._split_fallback: str | None = None  # why the split backward ran fused (once seen)
        self.dw_builder = dw_builder
        self.get_mesh = get_mesh
        self._dp = None
        self._dp_of: tuple | None = None  # (module, its class) the adapter was made for
        self.bind_data_parallel(None)
        # Shape cache: input structure string -> parsed (per negotiated signature), the one in
        # use, and whether shape inference may run the module on fake tensors.
        self._parsed: dict[str, Any] = {}
        self._in_parsed: Any = None
        self._fake_shapes = True  # fake tensors (meta storage), not a real run

    def bind_data_parallel(self, split_backward: bool | None) -> bool:
        """The data-parallel adapter of ``submod`` as it is now: made anew where the module or
        its class changed (fully_shard changes the class in place), then checked against a
        program that splits this stage's backward (split_backward; None: no program yet).
        Returns whether the stage syncs gradients; raises ValueError as the adapter's check.
        A schedule calls it when it takes a program and when it builds or runs an executor."""
        module = self.submod
        if self._dp_of is None or self._dp_of[0] is not module or self._dp_of[1] is not type(module):
            self._dp = adapter_for(module, self._linear is not None)
            self._dp_of = (module, type(module))
        if self._dp is not None and split_backward is not None:
            self._dp.check(self.stage_index, split_backward)
        return self._dp is not None

    def data_parallel_groups(self) -> list:
        """The process groups the stage's gradient sync runs a collective on (DDP's group,
        FSDP2's shard and replicate groups; [] without data parallelism), as last bound."""
        return self._dp.groups() if self._dp is not None else []

    def scale_grads(self, grad_scale_factor: int) -> None:
        """torch's: divides the gradients of the stage's parameters by grad_scale_factor. zbpipe's
        schedules do not call it (scale_grads=True scales each microbatch loss instead)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, rank={self.group_rank})"

    @contextlib.contextmanager
    def step_scope(self, training: bool):
        """The stage's own modes for the length of one schedule step (the schedule enters it
        around each step): data parallelism's sync flags (step_begin / step_end(failed)) and
        deferred_linear's in-step routing."""
        failed = True
        try:
            if self._dp is not None:
                self._dp.step_begin(training)
            if self._linear is not None:
                self._linear.in_step = training  # a checkpoint recomputing defers the same way
            yield
            failed = False
        finally:
            if self._linear is not None:
                self._linear.in_step = False
            if self._dp is not None:
                self._dp.step_end(failed)

    # ---- executor callbacks (each with the running step's StepData) -------------------------

    def _invoke(self, fn, args: tuple, kwargs: dict):
        """The one place the module runs: fn is the module (or a functional call of it).
        Front ends that route values between stages (zbpipe.pipeline) override it."""
        return fn(*args, **kwargs)

    def _call(self, step: StepData, mb: int, inputs: list[torch.Tensor]):
        kwargs = step.microbatch_kwargs(mb)
        if self.is_first:
            return self._invoke(self.submod, tuple(step.args[mb]), kwargs)
        args, named = _tree.as_call_args(_tree.unflatten(inputs, self._in_parsed))
        return self._invoke(self.submod, tuple(args), {**named, **kwargs})

    def _zb_forward(self, step: StepData, mb: int, inputs: list[torch.Tensor]):
        """(tensors, loss, output) for the executor (ForwardResult): the flat outputs, None,
        None on every stage but the last; there [loss] when the step trains (else []), the
        detached loss (None without a loss_fn) and the detached output when kept (else None)."""
        if step.train:  # checkpointed regions made here recompute once (issue #21)
            regions = step.regions.setdefault((self.stage_index, mb), [])
            with recompute_once(regions), self._probing(step, mb):
                return self._zb_forward_inner(step, mb, inputs)
        return self._zb_forward_inner(step, mb, inputs)

    def _probing(self, step: StepData, mb: int):
        """The memory probe's recording of this forward (and loss), on a probing step."""
        if step.memory_probe is None:
            return contextlib.nullcontext()
        data: list[torch.Tensor] = []
        _tree.tensor_layout((step.args[mb] if self.is_first else None, step.microbatch_kwargs(mb),
                             step.targets[mb] if self.is_last and step.targets is not None else None), data)
        return step.memory_probe.recording(self.stage_index, mb, self.submod, data)

    def _zb_before_backward_on_worker(self, step: StepData, mb: int) -> None:
        """Right before microbatch mb's backward starts on the overlap worker (which runs it
        while this thread runs a forward): its checkpointed regions recompute here, so the
        worker draws nothing from the RNG this thread's forward draws from."""
        recompute_ahead(step.regions.pop((self.stage_index, mb), ()))

    def _zb_split_fell_back(self, reason: str) -> None:
        """The executor's split backward could not take this stage's graph (told once)."""
        self._split_fallback = reason
        warnings.warn(f"zbpipe: stage {self.stage_index} runs its whole backward in I, fused (W does "
                      f"nothing for it; the gradients are exact): {reason}", RuntimeWarning)

    @property
    def split_fallback(self) -> str | None:
        """Why this stage's backward ran fused under a split schedule (its I does the whole
        backward, its W nothing), or None while it splits (or has not run a split step)."""
        return self._split_fallback

    @property
    def deferred_linear_report(self) -> dict | None:
        """With deferred_linear=True: {"deferred": [qualified names of the nn.Linear modules
        whose weight gradients W computes], "not_deferred": {name: why it keeps its own forward
        (its weight gradients are then computed in I, with the rest of the stage's backward)}};
        None without deferred_linear."""
        return None if self._linear is None else self._linear.report()

    def _zb_backward_input_done(self, step: StepData, mb: int) -> None:
        """Right after microbatch mb's I, on a probing step: what waits for W is measured."""
        if step.memory_probe is not None:
            step.memory_probe.backward_input_done(self.stage_index, mb)

    def _zb_forward_inner(self, step: StepData, mb: int, inputs: list[torch.Tensor]):
        if not step.train:
            with torch.no_grad():
                out = self._call(step, mb, inputs)
        elif self._linear is not None:
            self._linear.queue = step.weight_work[(self.stage_index, mb)] = []
            try:
                out = self._call(step, mb, inputs)
            finally:
                self._linear.queue = None
        else:
            out = self._call(step, mb, inputs)
        if not self.is_last:
            return _tree.flatten(out)[0], None, None
        kept = _detach(out) if step.keep_outputs else None
        if step.vocab is not None:  # the output is the vocabulary-parallel head's input
            return _tree.flatten(out)[0], None, kept
        if step.loss_fn is None:
            return [], None, kept
        with contextlib.nullcontext() if step.train else torch.no_grad():
            loss = step.loss_fn(out, step.targets[mb], **step.loss_kwargs)
        if step.train:
            _check_scalar_loss(loss, self.stage_index, mb)
            self._check_loss_has_grad(loss, mb)
        return ([loss] if step.train else []), loss.detach(), kept

    def _check_loss_has_grad(self, loss: torch.Tensor, mb: int) -> None:
        """A loss that cannot start a backward (detached, a constant) where one could: raised
        in the forward, so every rank fails naming the microbatch, as one process's
        loss.backward() fails. One could where the stage trains a parameter or takes its
        inputs from an earlier stage (the executor makes the floating ones require grad). A
        frozen model (no parameter trains, one stage) runs on, computing no gradient. Checked
        only in grad mode (a registered forward under backward_requires_autograd=False owns
        the graph)."""
        if loss.requires_grad or not torch.is_grad_enabled():
            return
        if self.is_first and not any(p.requires_grad for p in self.submod.parameters()):
            return
        raise RuntimeError(
            f"zbpipe: the loss of microbatch {mb} (stage {self.stage_index}) does not require grad, so "
            "no gradient can flow from it (one process's loss.backward() says: element 0 of tensors "
            "does not require grad and does not have a grad_fn): loss_fn detached it or returned a constant")

    @property
    def _zb_queues_weight_work(self) -> bool:
        """Read once by the executor: W runs _zb_weight_work instead of its graph split."""
        return self._linear is not None or self.dw_builder is not None

    def _zb_weight_work_queued(self, step: StepData, mb: int) -> None:
        """Right after microbatch mb's backward (B or I): a dw_builder builds its runner."""
        if self.dw_builder is not None:
            step.weight_work[(self.stage_index, mb)] = self.dw_builder()

    def _zb_weight_work(self, step: StepData, mb: int) -> None:
        """W of a deferred_linear stage (the Linear weight gradients its backward queued) or
        of a dw_builder stage (the runner built after the backward)."""
        work = step.weight_work.pop((self.stage_index, mb))
        if self.dw_builder is not None:
            work()
            return
        for entry in work:
            entry.run()

    @property
    def _zb_syncs_gradients(self) -> bool:
        """Read once by the executor: call _zb_grad_sync_begin/_end around the last backward."""
        return self._dp is not None

    def _zb_grad_sync_begin(self, roots: list[torch.Tensor]) -> None:
        self._dp.sync_begin(roots)

    def _zb_grad_sync_end(self) -> None:
        self._dp.sync_end()

    def _zb_use_inputs(self, structure: str) -> None:
        """The executor switched to a signature negotiated earlier (or a new one): its input
        structure, parsed once per signature."""
        if structure not in self._parsed:
            self._parsed[structure] = _tree.parse(structure)
        self._in_parsed = self._parsed[structure]

    def _zb_infer_outputs(self, step: StepData, specs, structure: str):
        """Handshake: output signature for the given input signature (see StageHandle)."""
        if self.is_first:
            got = _tree.specs_of([a for a in step.args[0] if isinstance(a, torch.Tensor)])
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
        out = self._output_args if self._output_args is not None else self._shape_run(step, got)
        flat, st = _tree.flatten(out)
        return _tree.specs_of(flat), st

    def _shape_run(self, step: StepData, specs):
        """Output of microbatch 0 for the handshake, with no effect on what the step computes
        ([Note: shape inference has no side effects]): fake tensors on the stage's device
        where the module allows (they see autocast, inside the module or around the step, as
        the real forward does), else one real no-grad forward (on zeros; stage 0 on its real
        arguments). A DDP stage runs its inner module (no buffer broadcast); an FSDP stage its
        real, unsharded one (FSDP swaps parameters), so it runs for real; a stage with lazy
        parameters not yet materialized runs a copy for real. A module fake tensors cannot run
        (_FAKE_UNSUPPORTED) runs for real from then on; a user error raises once, from the run
        that met it."""
        module = self.submod if self._dp is None else self._dp.shape_module
        with torch.no_grad(), _forked_rng(self.device):
            if module is not None and self._fake_shapes and not _is_lazy(module):
                try:
                    return self._fake_run(module, step, specs)
                except _FAKE_UNSUPPORTED:
                    self._fake_shapes = False
            module = module if module is not None else self.submod
            if _is_lazy(module):  # the real module materializes at its first real forward
                return self._real_run(copy.deepcopy(module), step, specs)
            with _buffers_kept(module):
                return self._real_run(module, step, specs)

    def _fake_run(self, module, step: StepData, specs):
        from torch._subclasses.fake_tensor import FakeTensorMode

        # Tensors the module holds outside its parameters and buffers become fakes too.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = functools.partial(_to_fake, mode)
        state = {k: mode.from_tensor(v)
                 for k, v in list(module.named_parameters()) + list(module.named_buffers())}
        kwargs = {k: fake(v) for k, v in step.microbatch_kwargs(0).items()}
        with mode:
            if self.is_first:
                args, named = tuple(fake(a) for a in step.args[0]), {}
            else:
                tensors = [torch.empty(s, dtype=d, device=self.device) for s, d in specs]
                args, named = _tree.as_call_args(_tree.unflatten(tensors, self._in_parsed))

            def fake_call(*a, **k):
                # tie_weights=False: with a submodule registered twice (weights shared by
                # module), torch's tie handling swaps it twice and restores it to the fakes.
                return torch.func.functional_call(module, state, a, k, tie_weights=False)

            return self._invoke(fake_call, tuple(args), {**named, **kwargs})

    def _real_run(self, module, step: StepData, specs):
        kwargs = step.microbatch_kwargs(0)
        if self.is_first:
            return self._invoke(module, tuple(step.args[0]), kwargs)
        tensors = [torch.zeros(s, dtype=d, device=self.device) for s, d in specs]
        args, named = _tree.as_call_args(_tree.unflatten(tensors, self._in_parsed))
        return self._invoke(module, tuple(args), {**named, **kwargs})


# [Note: shape inference has no side effects]
# The handshake runs each stage once on microbatch 0 to learn its outputs, before the step's
# real forwards. One process runs no such forward, so it must leave nothing the step could see:
# - the RNG: the default generators (CPU, and the stage's device) are forked around it and
#   restored, as torch.random.fork_rng does, so Dropout masks and torch.rand draws of the step
#   are the ones the rank would draw without it (docs/runtime.md#recipes says which reference
#   that equals);
# - buffers: a real run (fake tensors mutate only their own copies) restores every buffer of
#   the module afterwards, so BatchNorm's running statistics and num_batches_tracked count
#   exactly the microbatches the step ran; the module stays in its mode (eval mode would
#   change what a train-mode forward computes);
# - lazy parameters: a stage still holding UninitializedParameters runs a deep copy, so the
#   module materializes at the first real forward, drawing its initial values from the
#   generator at the point one process's first forward would.
# Dtypes: fake tensors carry the stage's device, so autocast (entered around step() or inside
# the module) casts them as it casts the real forward's tensors.


def _forked_rng(device: torch.device):
    """torch.random.fork_rng over the CPU generator and `device`'s (when an accelerator)."""
    if device.type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module):
    """Every buffer of `module` (and its submodules) as it was when entered, restored on exit:
    the same tensor object in place, with its values copied back."""
    saved = [(m, name, b, b.detach().clone()) for m in module.modules()
             for name, b in m._buffers.items() if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, value in saved:
                m._buffers[name] = b
                b.copy_(value)


def _is_lazy(module: torch.nn.Module) -> bool:
    """Whether `module` holds parameters or buffers a lazy module has not materialized yet."""
    return any(isinstance(t, torch.nn.parameter.UninitializedTensorMixin)
               for t in itertools.chain(module.parameters(), module.buffers()))


def _check_group(group, input_args) -> None:
    """TypeError where `group` is no process group, or where one sits in input_args: torch's
    order puts input_args, output_args, output_grads and input_grads before group."""
    if isinstance(input_args, dist.ProcessGroup):
        raise TypeError(
            "zbpipe: PipelineStage got a ProcessGroup as input_args (its 5th positional argument): "
            "torch's order is (submodule, stage_index, num_stages, device, input_args, output_args, "
            "output_grads, input_grads, group, dw_builder, get_mesh); pass it as group=")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"zbpipe: PipelineStage's group must be a torch.distributed.ProcessGroup, "
                        f"got {type(group).__name__}")


def _check_scalar_loss(loss, stage: int, mb: int) -> None:
    """The backward starts from a scalar loss, as loss.backward() in one process does: a loss of
    another shape raises here, in the forward, before its backward would seed every element with
    the gradient (the gradients of loss.sum()). The executor turns it into every rank's
    PipelineError."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"zbpipe: loss_fn returned {type(loss).__name__} for microbatch {mb} of stage "
                        f"{stage}; a training step needs a scalar tensor to start the backward from")
    if loss.numel() != 1:
        raise RuntimeError(
            f"zbpipe: loss_fn returned a loss of shape {tuple(loss.shape)} for microbatch {mb} of stage "
            f"{stage}; the backward starts from a scalar loss (grad can be implicitly created only for "
            "scalar outputs, as loss.backward() says): reduce it in loss_fn (e.g. .mean())")


def _to_fake(mode, v):
    return mode.from_tensor(v) if isinstance(v, torch.Tensor) else v


def _detach(out):
    """The last stage's output as kept for step's return."""
    return _tree.detached(out)
