"""Each checkpointed region is recomputed once per stage microbatch, whatever the schedule
(issue #21).

torch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
``checkpoint_wrapper``, selective AC through ``create_selective_checkpoint_contexts``) recomputes
a region once per backward *call*: its unpack hook keys the recomputation by the graph task.
A split stage backpropagates a microbatch in two calls, I and W (csrc/runtime/stage_backward.h),
so every region I reaches would be recomputed in I and again in W, and selective AC's cache,
consumed by the first recomputation, would fail the second.

While a stage runs a training forward, zbpipe gives the regions it creates another unpack
rule (torch's pack hook and recomputation are kept as they are):
- the region is recomputed at the first unpack of one of its saved tensors, in whichever call
  that is (I on every stage whose input needs a gradient; W where I does not reach the region,
  as on the first stage; B), and never again;
- a recomputed tensor is dropped at its unpack, as torch drops it, except while a boundary node
  runs its input side in I: W re-runs that node for its weight side, so the tensors it unpacks
  (for a Linear: its input) are kept until then (csrc/runtime/checkpoint_once.h);
- once recomputed, the region drops its inputs and its recomputation closure (RNG state, the
  selective-AC cache): between I and W a rank holds only what W needs, and nothing after W.
A backward run inside the checkpointed forward itself keeps torch's rule. Regions created
anywhere else (outside a zbpipe stage, or on another thread) are torch's, untouched.

The overlap worker (DualPipeV's OVERLAP_F_B) runs a microbatch's backward while the executor's
thread runs another's forward. A recomputation sets the global RNG to the state its forward
saw and restores it after (torch's fork_rng), and both threads draw from that one generator:
a forward drawing in between gets the recomputation's numbers and is then rewound, a
recomputation drawing after the forward's draws gets other masks. So the regions a training
forward creates are collected (``recompute_once(regions)``), and ``recompute_ahead`` recomputes
them on the executor's thread right before their backward starts on the worker: the worker
then draws nothing, and each region's recomputation draws what its forward drew.

The mechanism is torch's own checkpoint with its unpack hook replaced: zbpipe wraps
``torch.utils.checkpoint._checkpoint_hook`` (a module global the checkpoint looks up at each
call) at the first training forward. A torch whose checkpoint internals differ from those
relied on here fails the first training forward that creates a region, naming what is missing.
A reentrant checkpoint (``use_reentrant=True``) runs a full backward of its own inside its node:
it recomputes once under B and on the weight side, and the split refuses it on a stage's input
path (stage_backward.cpp names the fix).
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
import torch.utils.checkpoint as _ckpt

from . import _C

_KEY = "zbpipe.recompute_once"  # the frame's recomputation key (torch's: the backward call)

# What the replaced hook uses of torch.utils.checkpoint and of a region's frame.
_MODULE_NAMES = ("_recomputation_hook", "_StopRecomputationError", "_run_fn_with_dynamo_disabled",
                 "CheckpointError")
_FRAME_NAMES = ("recompute_fn", "get_inputs", "saved_args", "weak_holders", "recomputed",
                "is_recomputed", "check_recomputed_tensors_match", "forward_completed",
                "unpack_error_cb")


class _Scope(threading.local):
    training_forward = False  # a stage's training forward runs on this thread
    regions: list | None = None  # where that forward's regions are collected (weakrefs)


_scope = _Scope()
_install_lock = threading.Lock()
_torch_hook = None  # torch's _checkpoint_hook, once replaced
_missing: list[str] = []  # torch internals absent from this torch (checked at install)


class recompute_once:
    """Context of a stage's training forward: checkpointed regions created inside follow the
    recompute-once rule above, and are collected into `regions` (weak references, for
    recompute_ahead) when a list is given. Cheap to enter (a thread-local flag)."""

    __slots__ = ("_prev", "_regions")

    def __init__(self, regions: list | None = None):
        self._regions = regions

    def __enter__(self):
        if _torch_hook is None:
            _install()
        self._prev = _scope.training_forward, _scope.regions
        _scope.training_forward, _scope.regions = True, self._regions
        return self

    def __exit__(self, *exc):
        _scope.training_forward, _scope.regions = self._prev
        return False


def recompute_ahead(regions) -> None:
    """Recomputes now, on this thread, each region of `regions` (weak references collected by
    recompute_once) not recomputed yet: its backward, on another thread, then finds it done."""
    for ref in regions:
        frame = ref()
        if frame is not None and frame.forward_completed and not frame.is_recomputed[_KEY] \
                and frame.recompute_fn is not None:
            _recompute(frame)


def _install() -> None:
    global _torch_hook
    with _install_lock:
        if _torch_hook is not None:
            return
        hook = getattr(_ckpt, "_checkpoint_hook", None)
        if hook is None:
            warnings.warn(
                f"zbpipe: torch {torch.__version__} has no torch.utils.checkpoint._checkpoint_hook; "
                "checkpointed regions of split stages are recomputed in I and again in W",
                RuntimeWarning, stacklevel=3)
            _torch_hook = False
            return
        _missing[:] = [f"torch.utils.checkpoint.{n}" for n in _MODULE_NAMES if not hasattr(_ckpt, n)]
        _torch_hook = hook
        _ckpt._checkpoint_hook = _checkpoint_hook


def _checkpoint_hook(frame):
    """Stands for torch.utils.checkpoint._checkpoint_hook: torch's own hook outside a stage's
    training forward, the recompute-once hook inside one."""
    if not _scope.training_forward:
        return _torch_hook(frame)
    if _scope.regions is not None:
        _scope.regions.append(weakref.ref(frame))
    missing = _missing + [f"the checkpoint frame's {n}" for n in _FRAME_NAMES if not hasattr(frame, n)]
    if missing:
        raise RuntimeError(
            f"zbpipe: torch {torch.__version__}'s non-reentrant checkpoint lacks "
            f"{', '.join(missing)}, which zbpipe needs to recompute a checkpointed region once per "
            "stage microbatch (its split backward would otherwise recompute it in I and again in "
            "W). Use a schedule without I/W (gpipe, 1f1b, interleaved_1f1b), or the stage's "
            "deferred_linear=True, whose backward is one call.")
    return _RecomputeOnceHook(frame)


class _RecomputeOnceHook(torch.autograd.graph.saved_tensors_hooks):
    """torch's pack hook for the region (it records the frame's holders); the unpack rule of
    the module docstring."""

    def __init__(self, frame):
        torch_hook = _torch_hook(frame)
        torch_unpack = torch_hook.unpack_hook  # with the debug callback when debug=True

        def unpack_hook(holder):
            if not frame.forward_completed:  # a backward inside the checkpointed forward
                return torch_unpack(holder)
            try:
                return _unpack(frame, holder)
            except _ckpt.CheckpointError as e:
                if frame.unpack_error_cb is not None:
                    frame.unpack_error_cb(e)
                raise

        super().__init__(torch_hook.pack_hook, unpack_hook)


def _unpack(frame, holder):
    if not frame.is_recomputed[_KEY]:
        _recompute(frame)
    handle = holder.handles.get(_KEY)
    if handle is None:
        raise _ckpt.CheckpointError(
            "torch.utils.checkpoint under zbpipe: a saved tensor of a checkpointed region was "
            "unpacked again after the backward that used it; zbpipe recomputes each region "
            "once per stage microbatch, for the one backward the schedule runs.")
    value = frame.recomputed[_KEY][handle]
    if not _C._checkpoint_keeps_unpacked():
        holder.handles[_KEY] = None  # dropped at its unpack (the dict entry dies with the handle)
    return value


def _recompute(frame) -> None:
    args = frame.get_inputs()
    prev, _scope.training_forward = _scope.training_forward, False  # inner regions: throwaway
    try:
        with _ckpt._recomputation_hook(weakref.ref(frame), _KEY), torch.autograd.enable_grad():
            _ckpt._run_fn_with_dynamo_disabled(frame.recompute_fn, *args)
    except _ckpt._StopRecomputationError:
        pass
    finally:
        _scope.training_forward = prev
    frame.is_recomputed[_KEY] = True
    frame.check_recomputed_tensors_match(_KEY)
    # Never recomputed again: free the region's inputs and the recomputation closure now.
    frame.saved_args = []
    frame.recompute_fn = None
