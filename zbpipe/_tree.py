"""Every walk over the nested values zbpipe handles: what a container is (node), a stage's
outputs flattened with a structure string and rebuilt from it, the layout and tensors of a
step's arguments, the shapes of a value's tensors, and a value's detached copy.

One rule for every walk (node): tuples, lists and dicts (their subclasses too) are containers,
anything else a leaf. torch.utils._pytree's rule differs (a namedtuple or a registered class
keeps its type and needs a registered name to be serialized, None is a container) and its
serialized specs are several times longer, so the structure strings that travel between ranks
(the handshake's, and the first stage's input layout each step negotiates under) are zbpipe's
own: the same on every rank, as every rank runs this code.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def node(value: Any) -> tuple[str, list[tuple[Any, Any]]] | None:
    """(kind, [(key, child)]) of a container: kind "tuple" or "list" (keys: indices) or "dict"
    (keys: its keys, in its order); None for a leaf."""
    if isinstance(value, (tuple, list)):
        return ("tuple" if isinstance(value, tuple) else "list"), list(enumerate(value))
    if isinstance(value, dict):
        return "dict", list(value.items())
    return None


# ---- a stage's outputs: flat tensors and a JSON structure string, and back -------------------

def _spec(obj: Any, out: list[torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return "T"
    found = node(obj)
    if found is None:
        raise TypeError(
            f"stage inputs/outputs must be tensors, tuples/lists or dicts of tensors; {where} is a "
            f"{type(obj).__name__}"
        )
    kind, items = found
    if kind != "dict":
        return [kind, [_spec(v, out, f"{where}[{i}]") for i, v in items]]
    entries = []
    for k, v in items:
        if not isinstance(k, str):
            raise TypeError(f"stage values: dict keys must be str, got {k!r} in {where}")
        entries.append([k, _spec(v, out, f"{where}[{k!r}]")])
    return ["dict", entries]


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


def detached(value: Any) -> Any:
    """`value` with its tensors detached (a stage's output kept for the caller); a value with
    leaves other than tensors is returned as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        flat, structure = flatten(value)
    except TypeError:
        return value
    return unflatten([t.detach() for t in flat], structure)


# ---- a step's arguments: any leaves, dict keys in sorted order ---------------------------------

def tensor_layout(obj: Any, out: list) -> str:
    """Collects the tensors nested in `obj` into `out`; returns the layout (containers, keys and
    where the tensors sit; other leaves are only marked "."), dict keys in sorted order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return "T"
    found = node(obj)
    if found is None:
        return "."
    kind, items = found
    if kind != "dict":
        return "(" + ",".join(tensor_layout(v, out) for _, v in items) + ")"
    return "{" + ",".join(f"{k!r}:{tensor_layout(v, out)}" for k, v in sorted(items, key=lambda kv: str(kv[0]))) + "}"


def tensor_specs(obj: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of every tensor nested in `obj`, in tensor_layout's order."""
    tensors: list[torch.Tensor] = []
    tensor_layout(obj, tensors)
    return specs_of(tensors)


def specs_of(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def format_specs(specs) -> str:
    return "(" + ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in specs) + ")"


def differentiable(t: torch.Tensor | torch.dtype) -> bool:
    dtype = t.dtype if isinstance(t, torch.Tensor) else t
    return dtype.is_floating_point or dtype.is_complex
