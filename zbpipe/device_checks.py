"""Setup checks of a schedule's stages against their process group, run when the schedule builds
an executor (its first step), before anything is posted:

- a stage on an accelerator needs a backend that carries that device's tensors: on a group
  with no backend for them, or with Gloo, whose send reads the tensor's memory on the host
  (torch lists Gloo's send/recv as CPU only), the first message would fail or read garbage;
- a stage module compiled with CUDA graphs (torch.compile mode="reduce-overhead" or
  "max-autotune", or options={"triton.cudagraphs": True}) is refused on CUDA: the graph's next
  replay rewrites the outputs zbpipe sends (docs/nccl.md#cuda-graphs; the executor also
  refuses the send of a replayed graph's output, for graphs these checks cannot see);
- TORCH_NCCL_BLOCKING_WAIT=1 draws a warning: ProcessGroupNCCL then makes every Work::wait
  block the host until the work completes, so each of the step's stream waits becomes a host
  wait and the host no longer runs ahead of the GPU.

One-rank pipelines send nothing: the first two checks pass them.
"""

from __future__ import annotations

import os
import warnings

import torch

BLOCKING_WAIT_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")  # torch's name, and its old one
_TRUE = ("1", "true", "yes", "y", "on")


def backend_name(group, device: torch.device) -> str | None:
    """The name of `group`'s backend for tensors on `device` ("gloo", "nccl", ...), None where
    the group has none for that device type."""
    try:
        return group._get_backend(torch.device(device)).name().lower()
    except RuntimeError:  # "No backend type associated with device type cuda"
        return None


def _sends_device_memory(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


def check_transport(group, device: torch.device, stage_index: int) -> None:
    """ValueError where a stage on an accelerator would send its tensors over a group that
    cannot carry them (no backend for the device type, or Gloo)."""
    device = torch.device(device)
    if group.size() < 2 or not _sends_device_memory(device):
        return
    name = backend_name(group, device)
    if name is not None and name != "gloo":
        return
    has = (f"no backend for {device.type} tensors" if name is None
           else f"Gloo for {device.type} tensors, whose send and receive take CPU tensors only")
    raise ValueError(
        f"stage {stage_index} computes on {device}, but its process group has {has}: create the "
        f"pipeline's group with NCCL for {device.type} tensors, e.g. dist.init_process_group("
        f"\"cpu:gloo,cuda:nccl\", device_id=device) or dist.new_group(ranks, backend=\"nccl\") "
        f"(docs/nccl.md)")


def blocking_wait_set(environ=os.environ) -> str | None:
    """The variable that turns ProcessGroupNCCL's blocking wait on, if one does."""
    for var in BLOCKING_WAIT_VARS:
        if environ.get(var, "").strip().lower() in _TRUE:
            return var
    return None


def warn_blocking_wait(group, device: torch.device, environ=os.environ) -> str | None:
    """Warns (UserWarning) when `group` runs NCCL for `device` with blocking waits on; returns
    the warning's text."""
    var = blocking_wait_set(environ)
    if var is None or backend_name(group, device) != "nccl":
        return None
    text = (f"zbpipe: {var}={environ[var]} makes every wait on NCCL block the host until the work "
            f"completes: each of the step's stream waits (a compute waiting for a receive) becomes a "
            f"host wait, so the host no longer runs ahead of the GPU and every message's latency "
            f"stalls the launch of the next kernels; unset it (zbpipe bounds its own waits by the "
            f"schedule's timeout; docs/nccl.md#blocking-wait)")
    warnings.warn(text, UserWarning, stacklevel=3)
    return text


def _compiled_with_cuda_graphs(obj) -> bool:
    getter = getattr(obj, "get_compiler_config", None)
    if getter is None:
        return False
    try:
        config = getter()
    except Exception:  # noqa: BLE001 - a backend whose config cannot be read: nothing to tell
        return False
    return bool(isinstance(config, dict) and config.get("triton.cudagraphs"))


def cuda_graph_module(module: torch.nn.Module) -> str | None:
    """The qualified name ("" for `module` itself) of the first module in `module` compiled by
    inductor with CUDA graphs: torch.compile(m, mode=...) (an OptimizedModule), m.compile(...)
    (in place), or a compiled forward assigned to m.forward; None without any."""
    for name, m in module.named_modules(remove_duplicate=True):
        candidates = [m, m.__dict__.get("_compiled_call_impl"), m.__dict__.get("forward")]
        if any(c is not None and _compiled_with_cuda_graphs(c) for c in candidates):
            return name
    return None


def check_cuda_graphs(module: torch.nn.Module, device: torch.device, group, stage_index: int) -> None:
    """ValueError for a CUDA stage of a multi-rank pipeline whose module uses CUDA graphs."""
    device = torch.device(device)
    if device.type != "cuda" or group.size() < 2:
        return
    name = cuda_graph_module(module)
    if name is None:
        return
    where = "its module" if name == "" else f"its submodule '{name}'"
    raise ValueError(
        f"stage {stage_index}: {where} is compiled with CUDA graphs (torch.compile mode=\"reduce-overhead\" "
        f"or \"max-autotune\", or triton.cudagraphs): the graph's next replay rewrites the outputs this "
        f"stage sends while a message may still be read from them. Compile it with "
        f"mode=\"max-autotune-no-cudagraphs\" or the default mode (docs/nccl.md#cuda-graphs)")


def check_stages(stages, group) -> None:
    """Every check above for a schedule's `stages` on `group` (ValueError, UserWarning)."""
    for s in stages:
        check_transport(group, s.device, s.stage_index)
        check_cuda_graphs(s.submod, s.device, group, s.stage_index)
    if stages:
        warn_blocking_wait(group, stages[0].device)
