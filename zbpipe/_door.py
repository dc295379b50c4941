"""Argument checks at the Python door of the schedule core (compile, simulate, refine).

A wrong type raises a one-line TypeError naming the parameter and what it takes; an int beyond
what the core's arguments hold raises ScheduleError. Values the types allow (negative sizes,
non-finite costs, sizes above zbpipe's limits) are the core's to refuse, with ScheduleError.
The TypeError's text and the check of text come from the bindings' own door
(csrc/python/arguments.h), so both doors say the same.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Set, Sized

from . import _C


def wrong_type(function: str, name: str, takes: str, value) -> TypeError:
    """'<function>: <name> must be <takes>, got <type> <repr, cut to 60 characters>'."""
    return TypeError(_C._wrong_type_message(function, name, takes, value))


def text(function: str, name: str, value) -> str:
    """A str; TypeError otherwise, ScheduleError if UTF-8 cannot encode it (a lone surrogate)."""
    _C._check_text(function, name, value)
    return value


def integer(function: str, name: str, value, bits: int = 64) -> int:
    """An int (anything with __index__ but bool) that fits a signed `bits`-bit C++ argument."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise wrong_type(function, name, "an int", value)
    number = operator.index(value)
    bound = 1 << (bits - 1)
    if not -bound <= number < bound:
        raise _C.ScheduleError(
            f"{function}: {name}={number} is out of range (zbpipe's limits: {_C.size_limits()})"
        )
    return number


def _is_number(value) -> bool:
    return not isinstance(value, (bool, str, bytes)) and hasattr(type(value), "__float__")


def _as_float(value) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range: the core refuses it as non-finite
        return math.inf if value > 0 else -math.inf


def number(function: str, name: str, value) -> float:
    if not _is_number(value):
        raise wrong_type(function, name, "a number", value)
    return _as_float(value)


def costs(function: str, name: str, value) -> list[float]:
    """A cost: one number for every stage, or a sequence with one per stage."""
    if _is_number(value):
        return [_as_float(value)]
    takes = "a number or a sequence of numbers (one per stage)"
    if (
        isinstance(value, (str, bytes, bytearray, Mapping, Set))
        or not isinstance(value, Iterable)
        or not isinstance(value, Sized)
    ):
        raise wrong_type(function, name, takes, value)
    values = list(value)
    for i, v in enumerate(values):
        if not _is_number(v):
            raise wrong_type(function, f"{name}[{i}]", "a number", v)
    if not values:
        raise _C.ScheduleError(f"cost '{name}' needs at least one value")
    return [_as_float(v) for v in values]
