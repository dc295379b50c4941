"""StepData: one step's data, built from what step() / eval() were given and handed by the
executor's run to every stage call of the step (data through the call, not through the stages).

StepData.build splits whole batches into microbatches (zbpipe/microbatch.py) or takes them as
the caller split them, keeping on each rank only the parts its stages use; input_signature
names the first stage's inputs, under which the ranks negotiate the step's message shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from . import _tree, microbatch
from ._tree import tensor_layout  # noqa: F401 - the layout of a step's arguments, named here too


@dataclasses.dataclass(eq=False, slots=True)
class StepData:
    """One step's data: built by the schedule, handed by the executor to every stage call of
    the step (csrc/runtime/stage_handle.h, StepData), dropped when the step ends."""

    train: bool                          # the step runs the backward
    args: list | None = None             # first stage's rank: positional args per microbatch
    kwargs: list | None = None           # keyword args per microbatch (every stage), or None
    targets: list | None = None          # last stage's rank: target per microbatch
    loss_fn: Callable | None = None      # last stage: loss_fn(output, target, **loss_kwargs)
    loss_kwargs: dict = dataclasses.field(default_factory=dict)
    keep_outputs: bool = True            # last stage: return each microbatch's output
    # (stage, microbatch) -> the weight-gradient work its backward leaves for its W
    # (deferred_linear's queue, dw_builder's runner): the stages' scratch, lives with the step.
    weight_work: dict = dataclasses.field(default_factory=dict)
    # A probing step's zbpipe.memory_probe.MemoryProbe (None: no measurement, no hook).
    memory_probe: Any = None
    # (stage, microbatch) -> weak references to the checkpointed regions its training forward
    # created, recomputed on the executor's thread before a backward on the overlap worker.
    regions: dict = dataclasses.field(default_factory=dict)
    # The vocabulary-parallel output (zbpipe.VocabParallelOutput) in place of loss_fn: targets
    # then live on every rank (each shard needs them).
    vocab: Any = None

    def microbatch_kwargs(self, mb: int) -> dict:
        return self.kwargs[mb] if self.kwargs else {}

    @classmethod
    def build(cls, n: int, *, train: bool, has_first: bool, has_last: bool, loss_fn: Callable | None = None,
              args: tuple = (), kwargs: dict | None = None, target: Any = None, arg_mbs: list | None = None,
              kwarg_mbs: list | None = None, target_mbs: list | None = None, keep_outputs: bool = True,
              loss_kwargs: dict | None = None, chunk_specs: microbatch.ChunkSpecs | None = None,
              vocab: Any = None) -> StepData:
        """The step's StepData for a rank holding the first stage (has_first) and/or the last
        (has_last): positional arguments where the first stage lives, targets (and the loss)
        where the last does, keyword arguments everywhere; split here into n microbatches from
        whole batches (args, kwargs, target), or taken as the caller split them (arg_mbs,
        kwarg_mbs, target_mbs: giving any, even an empty list, selects this form), whole
        batches as chunk_specs says (torch's args_chunk_spec and kwargs_chunk_spec; targets
        along dim 0, as torch's). Raises ValueError for a batch that does not split (no rows,
        or not divisible), a spec that does not fit, a missing target, or mixed forms;
        TypeError or ValueError as microbatch.presplit for a pre-split list of the wrong type
        or count.
        With `vocab` (a VocabParallelOutput) every rank takes the targets, checked by
        vocab.check_targets (ValueError for a token outside the vocabulary)."""
        kwargs = kwargs or {}
        specs = chunk_specs or microbatch.ChunkSpecs()
        step = cls(train=train, keep_outputs=keep_outputs, loss_kwargs=loss_kwargs or {})
        presplit = arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None
        if presplit:
            if args or kwargs or target is not None:
                raise ValueError(
                    "zbpipe: pre-split arg_mbs / kwarg_mbs / target_mbs cannot be mixed with "
                    f"whole-batch inputs (got {len(args)} positional argument(s), keyword "
                    f"argument(s) {sorted(kwargs)}, target {'given' if target is not None else 'None'})")
            targets = step._take_presplit(n, has_first, arg_mbs, kwarg_mbs, target_mbs)
        else:
            if has_first:
                step.args = specs.split_args(tuple(args), n)
            if kwargs:
                step.kwargs = specs.split_kwargs(dict(kwargs), n)
            targets = target  # the whole batch's; split below where the loss runs
        if vocab is not None:
            if targets is None:
                raise ValueError("zbpipe: a schedule with output= (VocabParallelOutput) needs target= (or "
                                 "target_mbs=) on every rank: each rank's shard of the head needs the targets")
            step.targets = vocab.check_targets(targets if presplit else microbatch.split(targets, n, "target"))
            step.vocab = vocab
        elif has_last and loss_fn is not None and (targets is not None or train):
            if targets is None:
                raise ValueError("zbpipe: the last stage needs target= (or target_mbs=) when a loss_fn is set")
            step.targets = targets if presplit else microbatch.split(targets, n, "target")
            step.loss_fn = loss_fn
        return step

    def _take_presplit(self, n: int, has_first: bool, arg_mbs, kwarg_mbs, target_mbs) -> list | None:
        """Takes the caller's microbatches, each list checked as torch checks it; returns the
        targets (None without target_mbs)."""
        arg_mbs = microbatch.presplit(arg_mbs, n, "arg_mbs", (tuple, list))
        kwarg_mbs = microbatch.presplit(kwarg_mbs, n, "kwarg_mbs", dict)
        targets = microbatch.presplit(target_mbs, n, "target_mbs")
        if has_first:
            self.args = [tuple(a) for a in arg_mbs] if arg_mbs is not None else [()] * n
        if kwarg_mbs is not None and any(kwarg_mbs):
            self.kwargs = kwarg_mbs
        return targets


def input_signature(step: StepData, device_type: str = "cpu") -> tuple[list, str]:
    """The first stage's input signature of a step, under which the pipeline's shapes are
    negotiated: every tensor in microbatch 0's positional and keyword arguments (all
    microbatches split alike), their layout, and the autocast state the step runs under on
    the stages' device type (autocast changes the dtypes the stages produce: a step entering
    or leaving it, or changing its dtype, negotiates anew, as a change of shape does)."""
    tensors: list[torch.Tensor] = []
    layout = _tree.tensor_layout((step.args[0], step.microbatch_kwargs(0)), tensors)
    return _tree.specs_of(tensors), layout + autocast_state(device_type)


def autocast_state(device_type: str) -> str:
    """The autocast state that tensors on `device_type` (and on the CPU, where a stage may
    compute too) meet now: "" where autocast is off, else e.g. " autocast(cpu=bfloat16)"."""
    on = [f"{t}={str(torch.get_autocast_dtype(t)).removeprefix('torch.')}"
          for t in dict.fromkeys(("cpu", device_type)) if torch.is_autocast_enabled(t)]
    return f" autocast({','.join(on)})" if on else ""
