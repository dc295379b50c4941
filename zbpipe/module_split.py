"""split_by_fqn: one module per pipeline stage, each a copy of the whole model keeping only its
own submodules, so every parameter keeps its fully qualified name (FQN) from the whole model.

This is torchtitan's ``pipeline_module_split`` idea. Because the names do not depend on the
split, a checkpoint saved by name (torch.distributed.checkpoint) at one pipeline size loads at
another, and optimizer state keyed by name moves with its parameter.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn


class SparseModuleList(nn.ModuleList):
    """A ModuleList that holds some entries of the original list under their original indices
    (``blocks.2`` stays ``blocks.2``). Iteration, ``len`` and positional indexing (``[0]`` is
    the first kept entry) see only the kept entries, in order, so a forward that loops over the
    list runs the stage's part of it. Changing the list (append, insert, assignment, deletion)
    raises TypeError: it would renumber or collide with the original indices."""

    def __init__(self, kept: "OrderedDict[str, nn.Module]"):
        super().__init__()
        self._modules.update(kept)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return SparseModuleList(OrderedDict(list(self._modules.items())[idx]))
        return list(self._modules.values())[idx]

    def _refuse(self, *args, **kwargs):
        raise TypeError("SparseModuleList keeps the original indices of a split model: it cannot be changed")

    append = extend = insert = __setitem__ = __delitem__ = __iadd__ = _refuse


def prune(module: nn.Module, prefix: str, keep: set[str]) -> nn.Module:
    """`module` (named `prefix` in the model) without the children that are neither kept nor
    an ancestor of a kept module: a list entry leaves the list (the result is then a
    SparseModuleList, the others keep their indices), a dict or Sequential entry leaves it, any other
    child becomes None (the forward must skip it)."""
    kept = OrderedDict()
    for name, child in list(module.named_children()):
        fqn = f"{prefix}{name}"
        if fqn in keep:
            kept[name] = child
        elif any(k.startswith(fqn + ".") for k in keep):
            kept[name] = prune(child, fqn + ".", keep)
            if not isinstance(module, nn.ModuleList):
                setattr(module, name, kept[name])
        elif isinstance(module, (nn.ModuleDict, nn.Sequential)):
            del module._modules[name]  # the others keep their names; a Sequential runs the rest
        elif not isinstance(module, nn.ModuleList):
            setattr(module, name, None)
    if isinstance(module, nn.ModuleList):
        return SparseModuleList(kept)
    return module


def split_by_fqn(model: nn.Module, module_names_per_stage: Sequence[Sequence[str]]) -> list[nn.Module]:
    """One module per stage: a deep copy of `model` that keeps the named submodules (dotted
    paths such as ``"tok_emb"``, ``"blocks.0"``) and their ancestors, the rest removed as
    ``prune`` says. Parameter and buffer names are those of `model`.

    `model.forward` must tolerate the removals (skip a None child, loop over what a list holds,
    take the previous stage's output where its first part is gone). Raises ValueError naming
    the module or parameter when a name does not exist, a module is in two stages, a parameter
    of `model` would be in no stage, or a parameter sits directly on a module that is split
    (it would be copied into several stages)."""
    stages = [list(names) for names in module_names_per_stage]
    if not stages:
        raise ValueError("split_by_fqn: module_names_per_stage is empty")
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}
    for s, names in enumerate(stages):
        for name in names:
            if name not in modules or name == "":
                raise ValueError(f"split_by_fqn: stage {s} names '{name}', which is not a submodule of the model")
            if name in owner:
                raise ValueError(f"split_by_fqn: '{name}' is in stages {owner[name]} and {s}")
            owner[name] = s
    for pname, _ in model.named_parameters():
        parts = pname.split(".")
        holders = [".".join(parts[:i]) for i in range(1, len(parts))]
        in_stages = sorted({owner[h] for h in holders if h in owner})
        if len(in_stages) > 1:
            raise ValueError(f"split_by_fqn: parameter '{pname}' is in stages {in_stages} (a module "
                             "and one inside it are named by different stages)")
        if not in_stages:
            mod = ".".join(parts[:-1]) or "the root module"
            why = ("it sits directly on a module that is split; move it into a submodule"
                   if any(o.startswith(f"{mod}.") or mod == "the root module" for o in owner)
                   else "no stage names it or a module above it")
            raise ValueError(f"split_by_fqn: parameter '{pname}' would be in no stage: {why}")
    out = []
    for names in stages:
        out.append(prune(copy.deepcopy(model), "", set(names)))
    return out
