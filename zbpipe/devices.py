"""Devices as users name them, compared as torch places tensors: `cpu`, `cpu:N` and
torch.device("cpu", N) are one device (a CPU tensor reports no index), and an accelerator named
without an index (`cuda`) is the current one, the device its tensors land on."""

from __future__ import annotations

import torch


def placement(device: torch.device | str | int) -> torch.device:
    """The device a tensor made on `device` reports: torch.device("cpu") for every CPU form, an
    accelerator's current index where none is given (torch.cuda.current_device(), which a
    trainer sets from LOCAL_RANK), the device itself otherwise (an int is torch's accelerator
    index, as torch.device(int) reads it; an accelerator this torch cannot use stays as named, for
    the setup checks to refuse). TypeError for what torch.device does not take."""
    try:
        d = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"zbpipe: device {device!r} is not a device torch knows ({e})") from e
    if d.type == "cpu":
        return torch.device("cpu")
    if d.index is None and d.type != "meta":
        module = torch.get_device_module(d.type)
        if module.is_available():  # else left as named: the stage's setup checks refuse it
            return torch.device(d.type, module.current_device())
    return d
