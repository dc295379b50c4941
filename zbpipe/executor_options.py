"""The executor's options as schedule keywords: every field of zbpipe._C.ExecutorOptions (its
name, default and doc written once, in C++: the struct and its line in csrc/python/module.cpp)
is a keyword parameter of every schedule class, ``timeout_s`` under the schedules' name
``timeout``. A schedule builds one ExecutorOptions from them and passes it whole to each
executor it builds (zbpipe/schedule_runner.py).
"""

from __future__ import annotations

import inspect
import textwrap

from . import _C

# ExecutorOptions field -> the schedules' keyword, where they differ.
_KEYWORD = {"timeout_s": "timeout"}
_FIELD = {k: f for f, k in _KEYWORD.items()}


def keyword(field: str) -> str:
    return _KEYWORD.get(field, field)


def parameters() -> list[inspect.Parameter]:
    """One keyword-only parameter per option, with its default."""
    defaults = _C.ExecutorOptions()
    return [inspect.Parameter(keyword(f), inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, f))
            for f in _C.ExecutorOptions.fields]


def declared(init):
    """Declares `init`'s signature with the options' keyword parameters in place of its
    ``**options`` (before its private ``_`` keywords): help() and inspect show them all."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    public = [p for p in own if not p.name.startswith("_")]
    init.__signature__ = inspect.Signature(public + parameters() + [p for p in own if p.name.startswith("_")])
    return init


def build(keywords: dict, owner: str) -> _C.ExecutorOptions:
    """ExecutorOptions from a schedule's keywords (each an option's keyword); TypeError naming
    `owner` for any other keyword, as Python's for an unexpected one."""
    fields = {}
    for name, value in keywords.items():
        field = _FIELD.get(name, name)
        if field not in _C.ExecutorOptions.fields or name in _KEYWORD:  # timeout_s goes by timeout
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        fields[field] = value
    return _C.ExecutorOptions(**fields)


def docs(indent: str = "    ") -> str:
    """The options as a docstring's Args entries."""
    lines = []
    for f in _C.ExecutorOptions.fields:
        text = f"{keyword(f)}: {getattr(_C.ExecutorOptions, f).__doc__.strip()}"
        lines += textwrap.wrap(text, 96, initial_indent=indent, subsequent_indent=indent + "    ")
    return "\n".join(lines)
