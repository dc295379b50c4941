"""Schedule classes with torch.distributed.pipelining's names and step() semantics, each a
thin mapping to a zbpipe.compile() name; the C++ executor runs the compiled program.

    sched = zbpipe.Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    out = sched.step(x, target=y, losses=losses)   # x on the first stage, y on the last

A step's data travels through the call: step() builds a StepData from the batch
(zbpipe/step_data.py) and hands it to the executor's run (zbpipe/schedule_runner.py, which
owns the executors), which passes it to every stage call and returns the last stage's outputs
and losses.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from typing import Callable

import torch

from . import _C, executor_options, microbatch
from .programs import compile as _compile
from .schedule_runner import ExecutorRunner, PipelineContext  # noqa: F401 - PipelineContext: zbpipe's
from .stage import PipelineStage
from .step_data import StepData


@functools.lru_cache(maxsize=256)
def _cached_program(name: str, pp: int, microbatches: int, stages_per_rank: int, forward_only: bool,
                    options: tuple = (), vocab_parallel: bool = False, vocab_embedding: bool = False):
    """Compiled (lowered, validated) program, cached per schedule, microbatch count and compile
    options (costs and memory cap for cost-driven schedules such as zb_auto); vocab_parallel:
    with the vocabulary head's passes (output=); vocab_embedding: with the input embedding's
    (input_embedding=)."""
    if not forward_only:
        kw = dict(options)  # compile_options may say vocab_parallel too (PartitionPlan.compile_options)
        kw["vocab_parallel"] = vocab_parallel or bool(kw.get("vocab_parallel"))
        kw["vocab_embedding"] = vocab_embedding or bool(kw.get("vocab_embedding"))
        return _compile(name, pp, microbatches, stages_per_rank or None, **kw)
    # Forward only: the schedule's forwards, in its order and topology, lowered and validated.
    prog = _C.lower(_C.strip_backward(_C.build(name, pp, microbatches, stages_per_rank)))
    prog = _C.insert_vocab(prog) if vocab_parallel else prog
    return _C.insert_embedding(prog) if vocab_embedding else prog



class OneRunning:
    """At most one call running a schedule's executors: a second step()/eval() while one runs
    (from another thread, or from inside a stage of the running one) raises RuntimeError at
    once, naming the running call and its thread. Checked before the second call touches
    anything, so the running step goes on unaffected."""

    def __init__(self, owner: str):
        self._owner = owner
        self._lock = threading.Lock()
        self._running: tuple[str, str] | None = None  # (call, thread name) of the running one

    @contextlib.contextmanager
    def __call__(self, call: str):
        if not self._lock.acquire(blocking=False):
            running = self._running  # None only in the instant the running call starts or ends
            what = (f"{running[0]}() is already running on this {self._owner} (called from thread "
                    f"{running[1]!r})") if running else f"another call is running on this {self._owner}"
            raise RuntimeError(
                f"zbpipe: {call}() called from thread {threading.current_thread().name!r} while "
                f"{what}: a schedule runs one step at a time; wait for it to return (or build one "
                "schedule per pipeline, each on its own process group)")
        self._running = (call, threading.current_thread().name)
        try:
            yield
        finally:
            self._running = None
            self._lock.release()


# torch's computation-type names -> zbpipe kinds (register_custom_function accepts either).
_TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W",
                "OVERLAP_F_B": "OVERLAP_F_B"}
_CUSTOM_KINDS = ("F", "B", "I", "W", "OVERLAP_F_B")
_BACKWARD_KINDS = (_C.Kind.B, _C.Kind.I, _C.Kind.W, _C.Kind.OVERLAP_F_B)  # what runs autograd's backward


def _custom_kind(kind) -> _C.Kind:
    name = kind.name if hasattr(kind, "name") else str(kind)
    name = _TORCH_KINDS.get(name, name)
    if name not in _CUSTOM_KINDS:
        raise ValueError(
            f"register_custom_function: {kind} is not a compute kind of zbpipe's programs "
            f"(valid: {', '.join(_CUSTOM_KINDS)} or torch's {', '.join(_TORCH_KINDS)}); zbpipe "
            "programs have no UNSHARD / RESHARD / REDUCE_GRAD actions")
    return getattr(_C.Kind, name)


def rank_stages(stages) -> list[PipelineStage]:
    """This rank's stages in stage order; ValueError for none or for stages on different
    process groups."""
    ranked = [stages] if isinstance(stages, PipelineStage) else sorted(stages, key=lambda s: s.stage_index)
    if not ranked:
        raise ValueError("a schedule needs at least one stage")
    first = ranked[0]
    for s in ranked:
        if s.group is not first.group:
            raise ValueError(
                f"all stages of a schedule must share one process group: stage {first.stage_index} "
                f"has {first.group!r} (size {first.group_size}), stage {s.stage_index} {s.group!r} "
                f"(size {s.group_size})")
    return ranked


class PipelineSchedule:
    """Base of every schedule class: `schedule` is the zbpipe.compile() name.

    Args:
        stages: this rank's PipelineStage, or the list of them (multi-stage schedules).
        n_microbatches: microbatches per step (the batch must split evenly).
        loss_fn: loss_fn(output, target, **loss_kwargs) on the last stage; None runs forward only.
        args_chunk_spec, kwargs_chunk_spec: torch's chunk specs (zbpipe/microbatch.py): per
            positional argument and per keyword argument (pytrees mirroring them), a
            ``TensorChunkSpec(dim)`` splits a tensor along ``dim``, ``_Replicate`` hands it
            whole to every microbatch; None: tensors along dim 0, other values replicated.
            Microbatches must split evenly (one shape per step).
        output_merge_spec: torch's merge spec of the last stage's outputs (a pytree mirroring
            them): ``TensorChunkSpec(dim)`` concatenates along ``dim``, a ``_CustomReducer``
            (torch's ``sum_reducer``) reduces, anything else keeps a value every microbatch
            gave equal; None: tensors along dim 0 (0-d ones stacked).
        output: a zbpipe.VocabParallelOutput in place of loss_fn: the LM head and its loss split by
            vocabulary rows over every rank, its passes and collectives placed in the program
            (compile(..., vocab_parallel=True)); the last stage returns the head's input, and
            every rank gives target= (docs/vocab_parallel.md). ValueError with loss_fn too.
        input_embedding: a zbpipe.VocabParallelEmbedding: the input embedding split by
            vocabulary rows over every rank, its passes and collectives placed in the program
            (compile(..., vocab_embedding=True)); stage 0's module takes the embedding's output
            in place of the token ids, and every rank gives the token ids as step()'s first
            positional argument (docs/vocab_parallel.md). With or without output=.
        scale_grads: gradients of the mean microbatch loss (as one full-batch mean loss; False:
            of their sum, for a loss_fn that already divides, as torchtitan's). The scaling is
            applied to each microbatch loss before its backward, so gradients accumulated from
            earlier steps are not rescaled. Kept as the attribute ``scale_grads``, read at
            every step, as torch's.
        backward_requires_autograd: torch's flag for backwards that are not autograd's (its
            Graph PP): False lets step() run under torch.no_grad() where every backward action
            of this rank (B, I, W, OVERLAP_F_B) runs a function registered with
            register_custom_function, which then owns the graph (e.g. runs the forward under
            torch.enable_grad()). zbpipe's own backward runs the autograd graph of the
            forward, so a step under no_grad that would run it raises RuntimeError naming
            the kinds, with either value.
        use_full_backward: torch's deprecated flag: accepted with a warning, ignored.
        defer_pp_recv: torch's option to post receives late: each receive is posted at its
            RECV action in the program (prepost_receives=False), not at step start.
        compile_options: extra zbpipe.compile() arguments, e.g. for zb_auto
            dict(f=..., b=..., w=..., comm=..., memory_cap=...) (measured stage costs).
        measure_memory: measure every training step's memory deltas per local stage
            (memory_profile(); zbpipe/tuning/memory_probe.py). Off by default: a probing step runs a
            saved-tensor pack hook in each forward and a call into Python after each I.
        **options: the executor's options (zbpipe._C.ExecutorOptions; below, and with their
            defaults in the signature), gathered into one ExecutorOptions that every executor
            of the schedule gets whole.

    A step failing on any rank (a stage error, a wrong shape, a loss error, a timeout, a bad
    batch) fails every rank of the pipeline, and of every data-parallel replica of its stages,
    with zbpipe.PipelineError whose first line names that rank, stage, action and message,
    within about a tenth of a second of the failure (through the groups' stores; a rank busy
    computing learns it at its next wait). Ctrl-C during a step raises KeyboardInterrupt on
    that rank and tells the others (docs/runtime.md#failures). Before the first
    step the ranks compare their programs (schedule, pp, microbatches, stage placement, action
    lists): a mismatch fails every rank at once, naming both sides. A schedule runs one call at
    a time: step() or eval() while another runs raises RuntimeError at once, naming it.
    """

    schedule: str = ""
    forward_only: bool = False  # the schedule has no backward (inference)
    _loads_program: bool = False  # the program comes later, from _load_csv (torch's runtime class)

    def __init_subclass__(cls, schedule: str | None = None, forward_only: bool | None = None, **kwargs):
        """A schedule class names its compile() name in its bases:
        ``class ScheduleGPipe(PipelineScheduleSingle, schedule="gpipe")``."""
        super().__init_subclass__(**kwargs)
        if schedule is not None:
            cls.schedule = schedule
        if forward_only is not None:
            cls.forward_only = forward_only

    @executor_options.declared
    def __init__(
        self,
        stages: PipelineStage | list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec=None,
        kwargs_chunk_spec=None,
        output_merge_spec=None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        use_full_backward: bool | None = None,
        defer_pp_recv: bool = False,
        compile_options: dict | None = None,
        measure_memory: bool = False,
        output=None,
        input_embedding=None,
        _program: _C.Program | None = None,
        **options,
    ):
        if use_full_backward is not None:  # torch's deprecated flag, ignored as torch ignores it
            warnings.warn("use_full_backward is no longer supported (as in torch): stop passing it",
                          FutureWarning, stacklevel=2)
        if defer_pp_recv:  # torch's: receives posted where the program needs them, not at step start
            if options.get("prepost_receives"):
                raise ValueError("defer_pp_recv=True posts each receive at its RECV action; "
                                 "prepost_receives=True posts them all at step start: give one")
            options["prepost_receives"] = False
        self._chunk_specs = microbatch.ChunkSpecs(args_chunk_spec, kwargs_chunk_spec, output_merge_spec)
        if not self.schedule and _program is None and not self._loads_program:
            raise TypeError(f"{type(self).__name__} is a base class: use a schedule class "
                            "(zbpipe.get_schedule_class) or from_program")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self._stages = rank_stages(stages)
        self._n = n_microbatches
        self._loss_fn = loss_fn
        self._vocab = _check_output(output, loss_fn, self._stages)
        self._embedding = _check_input_embedding(input_embedding, self._stages)
        self._has_backward = (loss_fn is not None or output is not None) and not self.forward_only
        self.scale_grads = scale_grads
        self._backward_requires_autograd = backward_requires_autograd
        self._runner = ExecutorRunner(self._stages, executor_options.build(options, type(self).__name__),
                                      measure_memory, vocab=self._vocab, embedding=self._embedding)
        if _program is not None:
            self._set_program(_program)
        elif not self._loads_program:
            self._set_program(self._compiled(compile_options))
        self._one_running = OneRunning("schedule")

    def _compiled(self, compile_options: dict | None) -> _C.Program:
        """The program of this class's schedule for the stages' layout (even layouts only)."""
        pp, num_stages = self._stages[0].group_size, self._stages[0].num_stages
        if num_stages % pp != 0:
            raise ValueError(f"num_stages={num_stages} is not a multiple of the group size {pp} "
                             "(uneven layouts run through PipelineSchedule.from_program)")
        options = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                               for k, v in (compile_options or {}).items()))
        return _cached_program(self.schedule, pp, self._n, num_stages // pp, not self._has_backward, options,
                               self._vocab is not None, self._embedding is not None)

    def _set_program(self, prog: _C.Program) -> None:
        """Takes `prog` after checking that it fits the stages (any layout that validates,
        uneven ones included: the executor checks that this rank holds exactly the program's
        stages) and that each data-parallel stage can run it."""
        pp, num_stages = self._stages[0].group_size, self._stages[0].num_stages
        if prog.pp != pp or prog.num_stages != num_stages:
            raise ValueError(f"program '{prog.schedule}' has pp={prog.pp}, num_stages={prog.num_stages}; "
                             f"the stages say pp={pp}, num_stages={num_stages}")
        has_embedding = any(a.kind == _C.Kind.E for a in prog.action_values(self._stages[0].group_rank))
        if self._embedding is not None and not has_embedding:
            raise ValueError(f"input_embedding= needs a program with the embedding's actions: program "
                             f"'{prog.schedule}' has none (compile it with vocab_embedding=True)")
        self._runner.bind_program(prog)
        self.schedule = prog.schedule

    @property
    def program(self) -> _C.Program:
        if self._runner.program is None:
            raise RuntimeError(f"{type(self).__name__} has no program yet: call _load_csv(path) first")
        return self._runner.program

    @classmethod
    def from_program(cls, stages, program: _C.Program, loss_fn: Callable | None = None, **kwargs) -> "PipelineSchedule":
        """A schedule running a given lowered program (e.g. zbpipe.Program.from_csv of a
        PyTorch CSV, or Program.from_actions with any stage-to-rank layout, uneven ones
        included); its microbatch count is the program's."""
        return cls(stages, program.microbatches, loss_fn, _program=program, **kwargs)

    def _check_grad_mode(self) -> None:
        """step() under torch.no_grad(): torch's RuntimeError, unless backward_requires_autograd
        is False and registered functions run every backward action of this rank."""
        if not self._has_backward or torch.is_grad_enabled():
            return
        if self._backward_requires_autograd:
            raise RuntimeError(
                "zbpipe: step() runs the backward and cannot run with gradients disabled "
                "(torch.no_grad() / inference_mode); call eval() for a forward-only pass")
        rank = self._stages[0].group_rank
        kinds = {a.kind for a in self.program.action_values(rank) if a.is_compute} & set(_BACKWARD_KINDS)
        missing = sorted(k.name for k in kinds - self._runner.custom_kinds)
        if missing:
            raise RuntimeError(
                f"zbpipe: step() under torch.no_grad() with backward_requires_autograd=False: "
                f"this rank's {', '.join(missing)} actions have no function registered "
                "(register_custom_function), and zbpipe's own backward needs the autograd graph "
                "of the forward")

    def register_custom_function(self, computation_type, custom_function: Callable) -> None:
        """torch's hook: actions of `computation_type` (zbpipe.Kind F, B, I, W, OVERLAP_F_B, or
        torch's FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B) run
        custom_function(action, ctx) instead of the built-in computation, called from the C++
        executor (only for that kind). The function must run each compute part of the action
        exactly once with ctx.run(part): the action itself, or both sub-actions of an
        OVERLAP_F_B, in any order, with any work of its own around them. ctx carries torch's
        _PipelineContext fields (schedule_ref, arg_mbs, kwarg_mbs, target_mbs, losses).
        Registering a kind again replaces its function."""
        kind = _custom_kind(computation_type)
        if not callable(custom_function):
            raise TypeError(f"custom_function must be callable, got {custom_function!r}")
        self._runner.set_custom(kind, custom_function)

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, **kwargs):
        """One pipelined step over the whole batch: args on the first stage's rank, target on
        the last; kwargs (chunked when they are tensors) reach every stage; loss_kwargs reach
        only the loss function (loss_fn(output, target, **loss_kwargs), not chunked).
        Gradients accumulate into .grad. `losses` is cleared and refilled with the
        microbatch losses. Returns the merged output on the last stage (None with
        return_outputs=False, and elsewhere). Raises RuntimeError under torch.no_grad() when the
        schedule has a loss_fn, as torch does: use eval() there (or see
        backward_requires_autograd).

        Pre-split microbatches (torch's keyword-only form, as torchtitan calls it): arg_mbs
        (first stage's rank) a list of n_microbatches tuples of positional arguments,
        kwarg_mbs a list of n_microbatches dicts that reach every stage, target_mbs (last
        stage's rank) a list of n_microbatches targets; each runs as given, nothing is split
        again. Giving any of the three, even an empty list, selects this form, which cannot be
        mixed with positional arguments, model keyword arguments or target= (ValueError). A
        container or entry of the wrong type raises TypeError, a count other than
        n_microbatches ValueError, as torch's checks do. Microbatch 0 negotiates the step's
        message shapes: every microbatch must give each stage output that shape."""
        with self._one_running("step"):
            self._check_grad_mode()
            inputs = dict(args=args, kwargs=kwargs, target=target, arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs,
                          target_mbs=target_mbs)
            return self._run("step", inputs, losses, return_outputs, loss_kwargs, train=self._has_backward)

    def eval(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, **kwargs):
        """Forward only, in the schedule's forward order: no gradients, outputs merged on the
        last stage, losses computed when a loss_fn and target (or target_mbs) are given. Takes
        whole batches or pre-split microbatches as step does. Runs with or without
        torch.no_grad(); every rank of the pipeline calls it together, as step."""
        with self._one_running("eval"):
            inputs = dict(args=args, kwargs=kwargs, target=target, arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs,
                          target_mbs=target_mbs)
            return self._run("eval", inputs, losses, return_outputs, loss_kwargs, train=False)

    def _run(self, call: str, inputs: dict, losses, return_outputs, loss_kwargs, train: bool):
        _ = self.program  # RuntimeError where the program comes later (_load_csv) and has not
        has_last = any(s.is_last for s in self._stages)
        build = functools.partial(
            StepData.build, self._n, train=train, has_first=any(s.is_first for s in self._stages),
            has_last=has_last, loss_fn=self._loss_fn, keep_outputs=return_outputs, loss_kwargs=loss_kwargs,
            chunk_specs=self._chunk_specs, vocab=self._vocab, embedding=self._embedding, **inputs)
        loss_scale = 1.0 / self._n if self.scale_grads else 1.0
        step, outputs, mb_losses = self._runner.step(call, train, build, loss_scale, losses, self)
        if train and self._vocab is not None:
            self._vocab._sync_gradients()
        if train and self._embedding is not None:
            self._embedding._sync_gradients()
        if not has_last:
            return None
        if losses is not None:
            losses.clear()
            if step.targets is not None:
                losses.extend(mb_losses)
        return self._chunk_specs.merge(outputs) if return_outputs else None

    def set_call_counts(self, step: int | None = None, eval: int | None = None) -> None:
        """The step() / eval() calls counted so far: the next call's failure messages name it
        as call count + 1. For an owner running several schedules as one (ScheduleAuto), whose
        user counts its calls, not each inner schedule's."""
        self._runner.set_call_counts(step=step, eval=eval)

    @property
    def has_run(self) -> bool:
        """Whether a step() or eval() of this schedule ran (its executor is set up)."""
        return self._runner.last is not None

    def output_specs(self, stage_index: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor local stage `stage_index` sent on at the last step, as
        the ranks agreed them. RuntimeError before any step."""
        if self._runner.last is None:
            raise RuntimeError("no step has run yet")
        return [(tuple(shape), dtype) for shape, dtype in self._runner.last.signatures(stage_index)[1][0]]

    def trace(self) -> list[dict]:
        """Per-action timing of the last step (host ns; device us when timed)."""
        return self._runner.trace()

    def memory_profile(self) -> dict[int, dict[str, int]]:
        """{stage_index: {"mem_f": bytes, "mem_w": bytes}} of this rank's stages, measured by
        the last step run with measure_memory=True: the bytes one microbatch's F saved and the
        bytes of those still held from its I to its W (mem_w = mem_f on a stage without I).
        zbpipe.simulate(prog, mem_f=[...], mem_w=[...]) with them predicts the rank's peak of
        live saved bytes. RuntimeError before any such step."""
        if self._runner.memory_profile is None:
            raise RuntimeError("no step has measured memory: build the schedule with measure_memory=True "
                               "(or set sched.measure_memory = True) and run a training step")
        return {s: dict(v) for s, v in self._runner.memory_profile.items()}

    @property
    def measure_memory(self) -> bool:
        return self._runner.measure_memory

    @measure_memory.setter
    def measure_memory(self, on: bool) -> None:
        self._runner.measure_memory = bool(on)

    def export_chrome_trace(self, path: str) -> None:
        """The last step's trace as Chrome JSON; with a memory profile, one counter event per
        local stage ("stage S saved bytes": mem_f, mem_w)."""
        self._runner.export_chrome_trace(path)


PipelineSchedule.__doc__ += f"""
    Executor options (zbpipe._C.ExecutorOptions):
{executor_options.docs(" " * 8)}
    """


def _zbpipe_options(init):
    """Declares `init`'s signature as torch's parameters (its own, up to ``**options``)
    followed by PipelineSchedule's other parameters, keyword-only: the ``**options`` that
    `init` hands on to PipelineSchedule.__init__ (help() and inspect show them all)."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in own} | {"stages"}
    extra = [p.replace(kind=p.KEYWORD_ONLY) for p in inspect.signature(PipelineSchedule.__init__).parameters.values()
             if p.name not in names and not p.name.startswith("_")]
    init.__signature__ = inspect.Signature(own + extra)
    return init


def _check_output(output, loss_fn, stages):
    """The vocabulary-parallel output given as output= (None: none): TypeError for another
    object, ValueError beside a loss_fn or on another process group than the stages'."""
    if output is None:
        return None
    from .vocab_parallel import VocabParallelOutput

    if not isinstance(output, VocabParallelOutput):
        raise TypeError(f"output= takes a zbpipe.VocabParallelOutput, got {type(output).__name__}")
    if loss_fn is not None:
        raise ValueError("output= (a VocabParallelOutput, which computes the loss) and loss_fn= both define the "
                         "loss: give one")
    return _on_the_stages_group(output, stages)


def _check_input_embedding(embedding, stages):
    """The vocabulary-parallel embedding given as input_embedding= (None: none): TypeError for
    another object, ValueError on another process group than the stages'."""
    if embedding is None:
        return None
    from .vocab_embedding import VocabParallelEmbedding

    if not isinstance(embedding, VocabParallelEmbedding):
        raise TypeError(f"input_embedding= takes a zbpipe.VocabParallelEmbedding, got {type(embedding).__name__}")
    return _on_the_stages_group(embedding, stages)


def _on_the_stages_group(shard, stages):
    """`shard` (a VocabParallelOutput or VocabParallelEmbedding), checked to be sharded over the
    stages' group: ValueError for a group of another size or rank."""
    group = stages[0].group
    if shard.group is not group and (shard.group.size(), shard.group.rank()) != (group.size(), group.rank()):
        raise ValueError(f"the {type(shard).__name__} is sharded over a group of {shard.group.size()} ranks "
                         f"(this rank {shard.group.rank()}), the stages run on one of {group.size()} (this rank "
                         f"{group.rank()}): build it with group= the pipeline's group")
    return shard


class PipelineScheduleSingle(PipelineSchedule):
    """Base of the schedules with one stage per rank (torch's name and signature)."""

    @_zbpipe_options
    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 **options):
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **options)


class PipelineScheduleMulti(PipelineSchedule):
    """Base of the schedules that take a list of stages per rank (torch's name and signature)."""

    @_zbpipe_options
    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 use_full_backward: bool | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, **options):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, backward_requires_autograd, use_full_backward=use_full_backward, **options)


class _ScheduleMultiDeferRecv(PipelineScheduleMulti):
    """torch's signature of its interleaved, zero-bubble and V classes: Multi's without
    use_full_backward, with defer_pp_recv last."""

    @_zbpipe_options
    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False, **options):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **options)


# torch's private base-class name, which trainers import for type annotations (torchtitan).
_PipelineSchedule = PipelineSchedule


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """torch's schedule class for a schedule given as a CSV file (torchtitan's
    pipeline_parallel_schedule_csv): built with the stages, n_microbatches and any
    PipelineSchedule option, then given its program by _load_csv(path) before the first step."""

    _loads_program = True

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Loads PyTorch's CSV layout (one row per rank) with Program.from_csv: a compute-only
        file is lowered (SEND/RECV inserted), one with communication kept, either validated;
        `format` ("compute_only" or "compute_comms", torch's) is checked but both read alike.
        Raises ScheduleError for an invalid schedule, ValueError where it does not fit the
        stages or n_microbatches."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(f"{format=} is not implemented")
        prog = _C.Program.from_csv(filename)
        if prog.microbatches != self._n:
            raise ValueError(f"{filename}: the schedule runs {prog.microbatches} microbatches, the "
                             f"schedule class was built with n_microbatches={self._n}")
        self._set_program(prog)


class ScheduleGPipe(PipelineScheduleSingle, schedule="gpipe"):
    """All forwards, then all backwards."""


class Schedule1F1B(PipelineScheduleSingle, schedule="1f1b"):
    """One forward, one backward (PipeDream-flush)."""


class ScheduleLoopedBFS(PipelineScheduleMulti, schedule="looped_bfs"):
    """Looped breadth-first, several stages per rank (torch's signature: chunk specs keyword-only)."""

    @_zbpipe_options
    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, **options):
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **options)


class ScheduleInterleaved1F1B(_ScheduleMultiDeferRecv, schedule="interleaved_1f1b"):
    """Interleaved 1F1B (Megatron virtual stages; one stage per rank runs as torch's does)."""


class ScheduleInterleavedZeroBubble(_ScheduleMultiDeferRecv, schedule="interleaved_zb"):
    """Interleaved zero bubble (ZB1P; one stage per rank runs as torch's does)."""


class ScheduleZBVZeroBubble(_ScheduleMultiDeferRecv, schedule="zbv"):
    """Zero bubble V schedule (two stages per rank)."""


class ScheduleDualPipeV(_ScheduleMultiDeferRecv, schedule="dualpipev"):
    """DualPipeV on a V: each OVERLAP_F_B pair's halves run at once (overlap_f_b=False: in turn)."""


class ScheduleZBH1(PipelineScheduleSingle, schedule="zb_h1"):
    """Zero bubble H1 (1F1B memory)."""


class ScheduleZBH2(PipelineScheduleSingle, schedule="zb_h2"):
    """Zero bubble H2 (zero bubble, more memory)."""


class ScheduleZBAuto(PipelineScheduleSingle, schedule="zb_auto"):
    """Cost-driven zero bubble under an activation cap (compile_options: measured costs)."""


class ScheduleVHalf(_ScheduleMultiDeferRecv, schedule="v_half"):
    """Controllable-memory V schedule, about 1/2 of 1F1B's activations."""


class ScheduleVMin(_ScheduleMultiDeferRecv, schedule="v_min"):
    """Controllable-memory V schedule, about 1/3 of 1F1B's activations."""


class ScheduleInference(PipelineScheduleSingle, schedule="inference", forward_only=True):
    """Forward only (a loss_fn is still applied to report losses)."""


_CLASSES = [
    ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleZBH1,
    ScheduleZBH2, ScheduleZBAuto, ScheduleVHalf, ScheduleVMin, ScheduleInference,
]


def _norm(name: str) -> str:
    n = name.lower().replace("_", "").replace("-", "")
    return n[len("schedule"):] if n.startswith("schedule") else n


def _class_for(schedule: str) -> type:
    """The class of a compile() name that has none of its own: a subclass of PipelineSchedule."""

    class Generated(PipelineSchedule, schedule=schedule):
        pass

    Generated.__name__ = Generated.__qualname__ = "Schedule_" + schedule
    Generated.__doc__ = f"zbpipe '{schedule}' schedule."
    return Generated


def get_schedule_class(name: str) -> type:
    """PyTorch's schedule names (case-insensitive: "1F1B", "Interleaved1F1B", "ZBVZeroBubble",
    "ScheduleGPipe", ...) or zbpipe.compile() names ("zbv", "zb_h1", ...). A compile() name
    without a named class gets a generated subclass of PipelineSchedule."""
    key = _norm(name)
    for base in (PipelineScheduleSingle, PipelineScheduleMulti):  # torch's base-class names
        if key == _norm(base.__name__):
            return base
    for cls in _CLASSES:
        if key in (_norm(cls.__name__), _norm(cls.schedule)):
            return cls
    for sched in _C.schedule_names():
        if key == _norm(sched):
            cls = _class_for(sched)
            _CLASSES.append(cls)
            return cls
    valid = sorted({c.__name__ for c in _CLASSES} | set(_C.schedule_names())
                   | {"PipelineScheduleSingle", "PipelineScheduleMulti"})
    raise ValueError(f"unknown schedule '{name}' (valid: {', '.join(valid)})")
