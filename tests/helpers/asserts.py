"""The one tolerance of the suite and the comparisons built on it.

A pipelined step computes the same math as one process, summed in another order (per
microbatch, then accumulated): results agree to float reassociation, RTOL/ATOL below (fp32:
relative 1e-5, issue 44's bound), and every comparison of losses, outputs and gradients uses
them through torch.testing.assert_close. The
one exception is a GPU result against a CPU reference (tests/runtime/test_device_cuda.py):
other kernels, not only another order, so DEVICE_RTOL/DEVICE_ATOL. Under autocast (bf16, fp16)
the same math rounds to 8 or 11 bits, summed in another order: LOWP_RTOL/LOWP_ATOL (issue 44's
2e-2), chosen with low_precision=True.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

RTOL, ATOL = 1e-5, 1e-6
DEVICE_RTOL, DEVICE_ATOL = 1e-3, 1e-5
LOWP_RTOL, LOWP_ATOL = 2e-2, 2e-2


def assert_close(actual, expected, msg=None, low_precision: bool = False) -> None:
    """torch.testing.assert_close at the suite's tolerance (tensors, numbers, or nests of them);
    a tensor on another device than `expected` is moved there first, at DEVICE_RTOL/ATOL;
    low_precision: at LOWP_RTOL/ATOL (autocast, bf16/fp16)."""
    rtol, atol = (LOWP_RTOL, LOWP_ATOL) if low_precision else (RTOL, ATOL)
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and actual.device != expected.device:
        actual, rtol, atol = actual.to(expected.device), DEVICE_RTOL, DEVICE_ATOL
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)


def _named(params) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, Mapping):
        return list(params.items())
    return [(f"{i}.{n}", p) for i, m in enumerate(params) for n, p in _named(m)]


def assert_grads_close(actual, expected, msg: str = "", low_precision: bool = False) -> None:
    """Every parameter of `actual` has the gradient of its counterpart in `expected`: two
    modules, two sequences of modules (stage by stage), or two {name: parameter} maps, matched
    in order. A gradient both sides lack matches; one side lacking it fails. A sharded (DTensor)
    gradient is gathered first (a collective: every rank must compare the same stages)."""
    mine, theirs = _named(actual), _named(expected)
    assert len(mine) == len(theirs), f"{msg}: {len(mine)} parameters vs {len(theirs)}"
    for (name, p), (_, q) in zip(mine, theirs):
        where = f"{msg} grad of {name}".strip()
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, f"{where}: {p.grad is None=} {q.grad is None=}"
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert_close(grad, q.grad, msg=lambda m, where=where: f"{where}: {m}", low_precision=low_precision)
