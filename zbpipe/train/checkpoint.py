"""Checkpoints of the trainer with torch.distributed.checkpoint (DCP): model, optimizer state and
data position, saved by parameter name so that a run at one pipeline size resumes at another.

Every rank saves the state of its own stages under the whole model's names (split_by_fqn keeps
them); the optimizer state is flattened to one entry per (parameter name, state key), so it
follows its parameter to whichever rank holds it at the next size; DCP writes replicated
entries (data-parallel replicas) once. The data position is the number of steps done: a batch
is a pure function of (seed, step). A checkpoint is DIR/step-N, as torchtitan lays them out.
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"step-(\d+)")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def latest(directory: str) -> tuple[str, int] | None:
    """(path, step) of the newest complete checkpoint in `directory`, or None."""
    if not os.path.isdir(directory):
        return None
    steps = [int(m.group(1)) for name in os.listdir(directory) if (m := _STEP_DIR.fullmatch(name))
             and os.path.isfile(os.path.join(directory, name, ".metadata"))]
    return (os.path.join(directory, f"step-{max(steps)}"), max(steps)) if steps else None


def saved_parameters(path: str) -> set[str]:
    """The parameter names of the model saved at `path` (from DCP's metadata, on this process)."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k.removeprefix("model.") for k in keys if k.startswith("model.")}


def _state(modules: list[nn.Module], optims: list[torch.optim.Optimizer], step: int) -> dict:
    """The DCP state of this rank's stages: one namespace of parameter names for the modules,
    one for their optimizers (one optimizer per stage module), and the data position."""
    model, optim = {}, {}
    for module, opt in zip(modules, optims):
        model.update(get_model_state_dict(module))
        optim.update(get_optimizer_state_dict(module, opt, options=_OPTIONS))
    return {"model": model, "optim": optim, "train": {"step": torch.tensor(step)}}


def save(directory: str, step: int, modules: list[nn.Module], optims: list[torch.optim.Optimizer],
         group: dist.ProcessGroup | None = None) -> str:
    """Writes DIR/step-`step` from every rank of `group` (a collective); returns its path."""
    path = os.path.join(directory, f"step-{step}")
    dcp.save(_state(modules, optims, step), checkpoint_id=path, process_group=group)
    return path


def load(path: str, modules: list[nn.Module], optims: list[torch.optim.Optimizer],
         group: dist.ProcessGroup | None = None) -> int:
    """Loads this rank's stages and optimizers from `path` (a collective); returns the data
    position (steps done). DCP raises when a parameter is missing or has another shape."""
    state = _state(modules, optims, 0)
    dcp.load(state, checkpoint_id=path, process_group=group)
    for module, opt in zip(modules, optims):
        set_model_state_dict(module, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(module, opt, state["optim"], options=_OPTIONS)
    return int(state["train"]["step"])
