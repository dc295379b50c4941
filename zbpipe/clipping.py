"""clip_grad_norm_: gradient clipping by the norm of the whole model's gradients, when the model
is split into pipeline stages on several ranks (torch.nn.utils.clip_grad_norm_ on one rank sees
only that rank's stages, which is silently wrong under pipelining).

The total norm is reduced as torchtitan's ``clip_grad_norm_(..., pp_mesh)`` does: each rank
computes the norm of its gradients, the partial norms are combined over the pipeline group (sum
of p-th powers; max for the inf norm), then every gradient is scaled by the same coefficient.
Data parallelism adds no double counting: DDP replicas hold identical (already averaged)
gradients, so each replica computes the same total on its own; FSDP2 gradients are DTensor
shards, whose norm torch reduces over the shard group (``full_tensor``) before the pipeline
reduction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without DTensor
    DTensor = ()


def _parameters_and_group(stages_or_params, group):
    """(parameters, group, device) from stages (their modules and pipeline group), modules, or
    tensors. Without stages or `group`, the group is the default (world) group."""
    items = [stages_or_params] if isinstance(stages_or_params, (torch.Tensor, nn.Module)) or \
        hasattr(stages_or_params, "submod") else list(stages_or_params)
    params, groups, device = [], [], None
    for item in items:
        if hasattr(item, "submod"):  # a zbpipe.PipelineStage (or torch's): its module, its group
            params += list(item.submod.parameters())
            groups.append(item.group)
            device = device or torch.device(item.device)
        elif isinstance(item, nn.Module):
            params += list(item.parameters())
        elif isinstance(item, torch.Tensor):
            params.append(item)
        else:
            raise TypeError(f"clip_grad_norm_: expected PipelineStages, modules or tensors, got {type(item).__name__}")
    if group is None and groups:
        if any(g is not groups[0] for g in groups):
            raise ValueError("clip_grad_norm_: the stages belong to different process groups; pass group=")
        group = groups[0]
    if device is None:
        device = next((p.device for p in params), torch.device("cpu"))
    return params, group, device


def _norm(grads: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool, foreach, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    if DTensor and isinstance(norm, DTensor):
        norm = norm.full_tensor()  # partial norms of the shards, reduced over their mesh
    return norm.to(device)


@torch.no_grad()
def clip_grad_norm_(
    stages_or_params,
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clips the gradients of this rank's stages by the norm of the whole pipeline's gradients,
    like ``torch.nn.utils.clip_grad_norm_`` on the whole model in one process; returns that total
    norm (a float tensor, the same on every rank of the group).

    Args:
        stages_or_params: this rank's ``PipelineStage`` objects (their modules' parameters,
            their pipeline group), or modules, or parameters (one or an iterable).
        max_norm, norm_type, error_if_nonfinite, foreach: as in torch's (``float("inf")`` for
            the max norm).
        group: the group to reduce over: the pipeline group, one rank per stage position
            (default: the stages' group; for modules or parameters the default group). Every
            rank of it must call, also one without gradients. With data parallelism it must not
            include replicas: DDP replicas compute the same total on their own, and FSDP2's
            sharded (DTensor) gradients are reduced over their own mesh first.
    """
    norm_type = float(norm_type)
    params, group, device = _parameters_and_group(stages_or_params, group)
    grads = [p.grad for p in params if p.grad is not None]
    # Sharded and plain gradients cannot share one norm call (DTensor refuses mixed operands).
    sharded = [g for g in grads if DTensor and isinstance(g, DTensor)]
    plain = [g for g in grads if not (DTensor and isinstance(g, DTensor))]
    parts = torch.stack([_norm(gs, norm_type, error_if_nonfinite, foreach, device) for gs in (plain, sharded)])
    if math.isinf(norm_type):
        total = parts.max()
        op = dist.ReduceOp.MAX
    else:
        total = parts.pow(norm_type).sum()
        op = dist.ReduceOp.SUM
    if group is not None or dist.is_initialized():
        dist.all_reduce(total, op=op, group=group)
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is non-finite ({float(total)})")
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
