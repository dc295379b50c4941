"""zbpipe/_tree.py, the one walk over nested values: what a container is (tuples, lists, dicts
and their subclasses), a stage output's flat tensors and structure string and back (subclasses
rebuilt as plain containers), a step's argument layout and tensor shapes (dict keys sorted,
other leaves marked), a value's detached copy; and the walks elsewhere (microbatch.split and
merge, ScheduleAuto's shapes) going by the same rule."""

from __future__ import annotations

import collections

import pytest
import torch

from zbpipe import _tree, microbatch
from zbpipe.schedule_auto import _shapes

Point = collections.namedtuple("Point", "x y")


def test_containers_are_tuples_lists_and_dicts_with_their_subclasses():
    a = torch.zeros(1)
    assert _tree.node((a, 1)) == ("tuple", [(0, a), (1, 1)])
    assert _tree.node([a]) == ("list", [(0, a)])
    assert _tree.node(collections.OrderedDict(b=1, a=2)) == ("dict", [("b", 1), ("a", 2)])  # its order
    assert _tree.node(Point(a, a))[0] == "tuple"
    assert _tree.node(a) is None and _tree.node("ab") is None and _tree.node(None) is None


def test_a_stage_output_flattens_to_tensors_and_a_structure_and_back():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    value = (a, {"h": b, "m": [c]}, Point(a, b))
    tensors, structure = _tree.flatten(value)
    assert len(tensors) == 5 and all(t is u for t, u in zip(tensors, [a, b, c, a, b]))
    assert structure == '["tuple",["T",["dict",[["h","T"],["m",["list",["T"]]]]],["tuple",["T","T"]]]]'
    back = _tree.unflatten(tensors, _tree.parse(structure))
    assert type(back[2]) is tuple and back[1]["m"][0] is c  # a namedtuple comes back as a tuple
    assert _tree.flatten(a) == ([a], '"T"')
    with pytest.raises(TypeError, match=r"output\[1\]\['h'\] is a int"):
        _tree.flatten((a, {"h": 3}))
    with pytest.raises(TypeError, match="dict keys must be str, got 1 in output"):
        _tree.flatten({1: a})


def test_a_steps_arguments_give_their_layout_and_shapes_keys_sorted():
    a, b = torch.zeros(2, 3), torch.ones(4, dtype=torch.long)
    value = ([a, "s"], {"z": b, "a": (a, None)})
    out: list = []
    assert _tree.tensor_layout(value, out) == "((T,.),{'a':(T,.),'z':T})"
    assert len(out) == 3 and all(t is u for t, u in zip(out, [a, a, b]))
    assert _tree.tensor_specs(value) == [((2, 3), torch.float32), ((2, 3), torch.float32), ((4,), torch.int64)]
    # ScheduleAuto's step shapes: the positional arguments, then the keywords but `losses`.
    assert _shapes((a,), {"target": b, "losses": [a]}) == [((2, 3), torch.float32), ((4,), torch.int64)]
    assert _shapes((a,), {"target": b}) == _shapes((a,), {"losses": [], "target": b})


def test_detached_keeps_the_structure_or_returns_the_value():
    w = torch.ones(2, requires_grad=True)
    out = _tree.detached({"y": (w * 2, [w * 3])})
    assert not out["y"][0].requires_grad and not out["y"][1][0].requires_grad
    odd = (w * 2, "label")  # a leaf other than a tensor: returned as it is
    assert _tree.detached(odd) is odd


def test_microbatching_walks_the_same_containers():
    x = torch.arange(8.0).reshape(4, 2)
    chunks = microbatch.split(collections.OrderedDict(a=x, b=[x, 7]), 2, "argument")
    assert [list(c) for c in chunks] == [["a", "b"], ["a", "b"]] and chunks[1]["b"][1] == 7
    assert torch.equal(chunks[1]["b"][0], x[2:])
    merged = microbatch.merge([{"a": x[:2], "b": (x[:2],)}, {"a": x[2:], "b": (x[2:],)}])
    assert torch.equal(merged["a"], x) and type(merged["b"]) is tuple and torch.equal(merged["b"][0], x)
    with pytest.raises(ValueError, match=r"argument\['b'\]\[1\] is a int, which chunk spec"):
        microbatch.split({"b": [x, 7]}, 2, "argument", {"b": [None, object()]})
