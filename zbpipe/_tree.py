"""Flat tensor lists <-> the tensor / tuple / list / dict values stages exchange.

The structure is a JSON string so the C++ handshake can carry it between ranks opaquely.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def _spec(obj: Any, out: list[torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return "T"
    if isinstance(obj, (tuple, list)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return [kind, [_spec(v, out, f"{where}[{i}]") for i, v in enumerate(obj)]]
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"stage values: dict keys must be str, got {k!r} in {where}")
            items.append([k, _spec(v, out, f"{where}[{k!r}]")])
        return ["dict", items]
    raise TypeError(
        f"stage inputs/outputs must be tensors, tuples/lists or dicts of tensors; {where} is a "
        f"{type(obj).__name__}"
    )


def flatten(obj: Any, where: str = "output") -> tuple[list[torch.Tensor], str]:
    """Returns the tensors of `obj` in a fixed order and its structure string."""
    if isinstance(obj, torch.Tensor):  # the common case, without building a string
        return [obj], '"T"'
    out: list[torch.Tensor] = []
    spec = _spec(obj, out, where)
    return out, json.dumps(spec, separators=(",", ":"))


def _build(spec: Any, it) -> Any:
    if spec == "T":
        return next(it)
    kind, items = spec
    if kind == "tuple":
        return tuple(_build(s, it) for s in items)
    if kind == "list":
        return [_build(s, it) for s in items]
    return {k: _build(s, it) for k, s in items}


class Parsed:
    """A parsed structure string (parse once, unflatten per microbatch)."""

    __slots__ = ("spec",)

    def __init__(self, structure: str):
        self.spec = json.loads(structure)


def parse(structure: str) -> Parsed:
    return Parsed(structure)


def unflatten(tensors: list[torch.Tensor], structure: str | Parsed) -> Any:
    """Inverse of flatten; `structure` is the string or its parse()d form."""
    spec = structure.spec if isinstance(structure, Parsed) else json.loads(structure)
    if spec == "T" and len(tensors) == 1:
        return tensors[0]
    it = iter(tensors)
    value = _build(spec, it)
    if next(it, None) is not None:
        raise ValueError(f"more tensors than the structure {structure} holds")
    return value


def as_call_args(value: Any) -> tuple[tuple, dict]:
    """How a previous stage's output becomes this stage's arguments: a tuple/list is spread
    positionally, a dict becomes keyword arguments, a tensor is the single argument."""
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    if isinstance(value, dict):
        return (), dict(value)
    return (value,), {}


def specs_of(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def format_specs(specs) -> str:
    return "(" + ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in specs) + ")"


def differentiable(t: torch.Tensor | torch.dtype) -> bool:
    dtype = t.dtype if isinstance(t, torch.Tensor) else t
    return dtype.is_floating_point or dtype.is_complex
