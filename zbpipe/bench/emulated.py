"""Emulated devices: a block whose F, I and W take a fixed time without using the CPU.

A benchmark of a pipeline engine wants the model and the machine's noise out of the way. An
``EmulatedBlock`` spends ``f_ms`` in its forward, ``i_ms`` in the backward of its input path
and ``w_ms`` in the backward of its weight path, as:

- on CPU, ``time.sleep`` (which releases the GIL, so eight ranks on two cores behave like eight
  devices);
- on CUDA, ``torch.cuda._sleep`` kernels on the current stream, so the host runs ahead of the
  device as it does with real kernels (cycles from the device's clock rate).

The two paths are two autograd Functions: the input path (x -> y) and the weight path (a
parameter added to y). zbpipe's split backward runs the input path in I and the parameter-only
path in W (docs/split_backward.md); a fused B runs both. On a first stage, whose input needs no
gradient, the input path hangs off the parameter and runs in W (I has nothing to do there, as
for any model's first stage). The block saves ``saved_elems`` float
elements per microbatch for its backward (a fixed activation, whatever the batch).
``SavedBytes`` (``with SavedBytes() as saved: ...; saved.peak``) measures the largest total of
those saved buffers alive at once in this process: the rank's peak of saved activations.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

_CYCLES_PER_MS: dict[int, float] = {}


def _device_cycles_per_ms(device: torch.device) -> float:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_MS:
        khz = torch.cuda.get_device_properties(index).clock_rate  # kHz: cycles per ms
        _CYCLES_PER_MS[index] = float(khz)
    return _CYCLES_PER_MS[index]


def spend(ms: float, device: torch.device) -> None:
    """Occupies `device` for `ms` milliseconds without using the CPU: a GIL-free sleep on the
    host for CPU tensors, a sleep kernel on the current stream for CUDA ones."""
    if ms <= 0:
        return
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * _device_cycles_per_ms(device)))
    else:
        time.sleep(ms / 1000.0)


class SavedBytes:
    """While active (a context manager, one at a time per process), the saved buffers every
    EmulatedBlock forward makes are tracked: ``peak`` is the largest total of their bytes alive
    at once. Sampled right after each allocation, where a total can only have grown, so the
    maximum is exact."""

    active: "SavedBytes | None" = None

    def __init__(self):
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.peak = 0

    def __enter__(self) -> "SavedBytes":
        SavedBytes.active = self
        return self

    def __exit__(self, *exc) -> None:
        SavedBytes.active = None

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        self.live.append((StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live))


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, saved, anchor, f_ms, i_ms):
        spend(f_ms, x.device)
        ctx.save_for_backward(saved)
        ctx.i_ms = i_ms
        return x.clone()

    @staticmethod
    def backward(ctx, gy):
        (saved,) = ctx.saved_tensors
        spend(ctx.i_ms, gy.device)
        anchor_grad = gy.new_zeros(0) if ctx.needs_input_grad[2] else None
        return gy, None, anchor_grad, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, w_ms):
        ctx.w_ms = w_ms
        return weight.detach().clone()

    @staticmethod
    def backward(ctx, g):
        spend(ctx.w_ms, g.device)
        return g, None


class EmulatedBlock(nn.Module):
    """One unit of an emulated model: ``y = x + b`` where the forward takes ``f_ms``, the input
    gradient ``i_ms`` and the gradient of ``b`` (shape ``(width,)``) ``w_ms``. Saves
    ``saved_elems`` float32 elements per forward for its backward."""

    def __init__(self, width: int, f_ms: float, i_ms: float, w_ms: float, saved_elems: int = 0):
        super().__init__()
        for name, v in (("f_ms", f_ms), ("i_ms", i_ms), ("w_ms", w_ms)):
            if not v >= 0:
                raise ValueError(f"EmulatedBlock: {name} must be >= 0, got {v}")
        if width < 1 or saved_elems < 0:
            raise ValueError(f"EmulatedBlock: width >= 1 and saved_elems >= 0, got {width}, {saved_elems}")
        self.f_ms, self.i_ms, self.w_ms, self.saved_elems = float(f_ms), float(i_ms), float(w_ms), int(saved_elems)
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        saved = x.new_empty(self.saved_elems) if torch.is_grad_enabled() else x.new_empty(0)
        if SavedBytes.active is not None and saved.numel():
            SavedBytes.active.add(saved)
        # A first stage's input needs no gradient: an empty view of the bias keeps the input
        # path (its saved buffer, its backward time) in the graph, in the backward's W part.
        anchor = None if x.requires_grad else self.bias[:0]
        y = _InputPath.apply(x, saved, anchor, self.f_ms, self.i_ms)
        return y + _WeightPath.apply(self.bias, self.w_ms)

    def extra_repr(self) -> str:
        return f"width={self.bias.numel()}, f_ms={self.f_ms}, i_ms={self.i_ms}, w_ms={self.w_ms}, saved_elems={self.saved_elems}"
