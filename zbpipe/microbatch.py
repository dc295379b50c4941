"""Splitting a step's batch into microbatches and merging the last stage's outputs back (torch's
pipelining/microbatch.py): by default tensors split and concatenate along dim 0 and other values
are replicated; torch's chunk specs choose otherwise per value (ChunkSpecs). Every microbatch
gets an equal share (zbpipe agrees on one shape per step, where torch's tensor_split allows a
remainder). The containers are those of every walk (zbpipe/_tree.py's node)."""

from __future__ import annotations

from typing import Any

import torch

from . import _tree


def _torch_specs():
    """torch's spec classes, imported where a spec is given (torch.distributed.pipelining is
    slow to import and `import zbpipe` does not need it)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

    return TensorChunkSpec, _Replicate, _CustomReducer


def _is_replicate(spec) -> bool:
    _, replicate, _ = _torch_specs()
    return spec is replicate or isinstance(spec, replicate)


def _is_leaf_spec(spec) -> bool:
    return spec is not None and not isinstance(spec, (tuple, list, dict))


class ChunkSpecs:
    """A schedule's args_chunk_spec, kwargs_chunk_spec and output_merge_spec, as torch takes
    them: a tuple with one spec per positional argument, a dict with one per keyword argument,
    a pytree mirroring the last stage's output (each None: the default). Raises TypeError for
    a container of the wrong kind."""

    def __init__(self, args=None, kwargs=None, output=None):
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"args_chunk_spec must be a tuple (one spec per positional argument), "
                            f"got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs_chunk_spec must be a dict (one spec per keyword argument), "
                            f"got {type(kwargs).__name__}")
        self.args, self.kwargs, self.output = args, kwargs, output

    def split_args(self, args: tuple, n: int) -> list:
        if self.args is not None and len(self.args) != len(args):
            raise ValueError(f"args_chunk_spec has {len(self.args)} spec(s) for {len(args)} positional "
                             "argument(s); give one per argument")
        return split(tuple(args), n, "argument", None if self.args is None else tuple(self.args))

    def split_kwargs(self, kwargs: dict, n: int) -> list:
        if self.kwargs is not None and set(self.kwargs) != set(kwargs):
            raise ValueError(f"kwargs_chunk_spec names {sorted(self.kwargs)} but the step's keyword "
                             f"arguments are {sorted(kwargs)}; give one spec per keyword argument")
        return split(dict(kwargs), n, "keyword argument", self.kwargs)

    def merge(self, chunks: list) -> Any:
        return merge(chunks, self.output)


def split(value: Any, n: int, what: str, spec: Any = None) -> list:
    """Chunks `value` into n equal microbatches: a tensor along its spec's split_dim (dim 0
    without a spec), tuples, lists and dicts per element (with the spec's element), other
    values and anything under ``_Replicate`` replicated. Raises ValueError naming `what` for a
    batch with no rows or one that does not divide by n, or a spec that does not fit it."""
    if spec is not None and _is_replicate(spec):
        return [value] * n
    if isinstance(value, torch.Tensor):
        return _split_tensor(value, n, what, 0 if spec is None else _split_dim(spec, what))
    found = _tree.node(value)
    if found is not None:
        kind, items = found
        keys = [k for k, _ in items]
        specs = _element_specs(spec, keys, what, _kind_name(value, kind))
        cols = [split(v, n, f"{what}[{k!r}]", s) for (k, v), s in zip(items, specs)]
        if kind == "dict":
            return [{k: c[i] for k, c in zip(keys, cols)} for i in range(n)]
        return [type(value)(c[i] for c in cols) for i in range(n)]
    if spec is not None:
        raise ValueError(f"zbpipe: {what} is a {type(value).__name__}, which chunk spec {spec} cannot "
                         "split (a TensorChunkSpec splits a tensor; use _Replicate or no spec)")
    return [value] * n


def _split_dim(spec, what: str) -> int:
    if not hasattr(spec, "split_dim"):
        raise ValueError(f"zbpipe: the chunk spec of {what} is {spec!r}: a tensor takes "
                         "TensorChunkSpec(dim) or _Replicate")
    return spec.split_dim


def _split_tensor(value: torch.Tensor, n: int, what: str, dim: int) -> list:
    if value.dim() == 0:
        raise ValueError(f"zbpipe: {what} is a 0-d tensor, which cannot be split into "
                         f"n_microbatches={n} (replicate it with _Replicate, or pass a batch)")
    if not -value.dim() <= dim < value.dim():
        raise ValueError(f"zbpipe: {what} has {value.dim()} dimension(s); its chunk spec splits dim {dim}")
    size = value.size(dim)
    on = "" if dim == 0 else f" along dim {dim}"
    if size == 0:
        raise ValueError(f"zbpipe: {what} has 0 rows{on} (shape {tuple(value.shape)}): a step needs at "
                         f"least n_microbatches={n} of them, one per microbatch")
    if size % n != 0:
        raise ValueError(f"zbpipe: {what} has batch size {size}{on}, which is not divisible by "
                         f"n_microbatches={n}")
    return list(value.split(size // n, dim))


def _kind_name(value, kind: str) -> str:
    """What messages call a container: its type's name ("dict" for any dict)."""
    return "dict" if kind == "dict" else type(value).__name__


def _element_specs(spec, keys, what: str, kind: str) -> list:
    """The spec of each element of a container: None everywhere without one, the container's
    own entries where it mirrors the value, ValueError otherwise."""
    keys = list(keys)
    if spec is None:
        return [None] * len(keys)
    if isinstance(spec, dict) and kind == "dict" and set(spec) == set(keys):
        return [spec[k] for k in keys]
    if isinstance(spec, (tuple, list)) and kind != "dict" and len(spec) == len(keys):
        return list(spec)
    raise ValueError(f"zbpipe: {what} is a {kind} of {len(keys)} element(s) but its chunk spec is {spec!r}: "
                     "a spec mirrors the structure of its value (or is _Replicate)")


def merge(chunks: list, spec: Any = None) -> Any:
    """Inverse of split for outputs. Without a spec: tensors concatenate along dim 0 (0-d ones
    stack), tuples, lists and dicts merge per element, other values come back as the list of
    chunks. With torch's output_merge_spec (a pytree mirroring the output):
    TensorChunkSpec(dim) concatenates along dim, a _CustomReducer folds the chunks with its
    reduce_fn from its init_value, any other leaf keeps the value every microbatch gave
    (ValueError where they differ)."""
    first = chunks[0]
    if _is_leaf_spec(spec):
        return _merge_leaf(chunks, spec)
    if isinstance(first, torch.Tensor):
        if spec is not None:
            raise ValueError(f"zbpipe: output_merge_spec {spec!r} does not mirror a tensor output")
        return torch.cat(chunks) if first.dim() > 0 else torch.stack(chunks)
    found = _tree.node(first)
    if found is None:
        return chunks
    kind, items = found
    keys = [k for k, _ in items]
    specs = _element_specs(spec, keys, "the output", _kind_name(first, kind))
    merged = [merge([c[k] for c in chunks], s) for k, s in zip(keys, specs)]
    return dict(zip(keys, merged)) if kind == "dict" else type(first)(merged)


def _merge_leaf(chunks: list, spec) -> Any:
    tensor_chunk_spec, _, custom_reducer = _torch_specs()
    if isinstance(spec, tensor_chunk_spec):
        return torch.cat(chunks, dim=spec.split_dim)
    if isinstance(spec, custom_reducer):
        value = spec.init_value
        for c in chunks:
            value = spec.reduce_fn(value, c)
        return value
    first = chunks[0]
    for i, c in enumerate(chunks[1:], 1):
        same = torch.equal(c, first) if isinstance(first, torch.Tensor) else c == first
        if not same:
            raise ValueError(f"zbpipe: output_merge_spec keeps one value ({spec!r}) but microbatch {i}'s "
                             "differs from microbatch 0's")
    return first


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
