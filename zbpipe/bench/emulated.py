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
path in W (docs/split_backward.md); a fused B runs both. The block saves ``saved_elems`` float
elements per microbatch for its backward (a fixed activation, whatever the batch).
"""

from __future__ import annotations

import time

import torch
from torch import nn

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


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, saved, f_ms, i_ms):
        spend(f_ms, x.device)
        ctx.save_for_backward(saved)
        ctx.i_ms = i_ms
        return x.clone()

    @staticmethod
    def backward(ctx, gy):
        (saved,) = ctx.saved_tensors
        spend(ctx.i_ms, gy.device)
        return gy, None, None, None


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
        y = _InputPath.apply(x, saved, self.f_ms, self.i_ms)
        return y + _WeightPath.apply(self.bias, self.w_ms)

    def extra_repr(self) -> str:
        return f"width={self.bias.numel()}, f_ms={self.f_ms}, i_ms={self.i_ms}, w_ms={self.w_ms}, saved_elems={self.saved_elems}"
