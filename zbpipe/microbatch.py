"""Splitting a step's batch into microbatches and merging the last stage's outputs back (torch's
pipelining/microbatch.py, with zbpipe's one rule: tensors split and concatenate along dim 0)."""

from __future__ import annotations

from typing import Any

import torch


def split(value: Any, n: int, what: str) -> list:
    """Chunks along dim 0 into n equal microbatches (tensors, also nested in tuples, lists and
    dicts); other values are replicated. Raises ValueError naming `what` when a batch size does
    not divide by n."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.size(0) % n != 0:
            size = value.size(0) if value.dim() else "a 0-d tensor"
            raise ValueError(
                f"zbpipe: {what} has batch size {size}, which is not divisible by "
                f"n_microbatches={n}"
            )
        return list(value.split(value.size(0) // n))
    if isinstance(value, (tuple, list)):
        cols = [split(v, n, f"{what}[{i}]") for i, v in enumerate(value)]
        return [type(value)(c[i] for c in cols) for i in range(n)]
    if isinstance(value, dict):
        cols = {k: split(v, n, f"{what}[{k!r}]") for k, v in value.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(n)]
    return [value] * n


def merge(chunks: list) -> Any:
    """Inverse of split for outputs: tensors concatenate along dim 0 (0-d ones stack), tuples,
    lists and dicts merge per element; other values come back as the list of chunks."""
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(chunks) if first.dim() > 0 else torch.stack(chunks)
    if isinstance(first, (tuple, list)):
        return type(first)(merge([c[i] for c in chunks]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: merge([c[k] for c in chunks]) for k in first}
    return chunks


def presplit(value: Any, n: int, name: str, entry: type | tuple[type, ...] | None = None) -> list | None:
    """Microbatches the caller split itself (step's arg_mbs / kwarg_mbs / target_mbs), checked
    as torch checks them: None stays None; otherwise a list (TypeError) of n entries
    (ValueError), each of type `entry` where given (TypeError naming the microbatch)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list but got a {type(value)}")
    if len(value) != n:
        raise ValueError(f"Expecting {n} {name} but got {len(value)}")
    if entry is not None:
        for i, v in enumerate(value):
            if not isinstance(v, entry):
                kinds = " or ".join(t.__name__ for t in (entry if isinstance(entry, tuple) else (entry,)))
                raise TypeError(f"{name}[{i}] must be a {kinds} but got a {type(v)}")
    return value
