"""VocabParallelOutput: the LM head and its cross-entropy loss split by vocabulary rows over every
pipeline rank (vocabulary parallelism, Yeung et al. 2025; docs/vocab_parallel.md).

Each rank builds one from the full head and keeps its contiguous shard of rows; a schedule given
it as ``output=`` runs the head's S and T passes and their collectives as actions of its program
(csrc/include/zbpipe/vocab.h), the math in the C++ executor (csrc/runtime/vocab_run.h).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

from . import control_plane


def vocabulary_shard(who: str, vocab: int,
                     group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, tuple[int, int]]:
    """The pipeline group (None: the world's) and this rank's contiguous rows [begin, end) of a
    vocabulary of `vocab` rows split over it, as `who` (the class, for the error) shards them;
    ValueError for fewer rows than ranks."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    pp, rank = group.size(), group.rank()
    if vocab < pp:
        raise ValueError(f"{who}: a vocabulary of {vocab} rows cannot be split over the pipeline's {pp} ranks "
                         "(every rank needs at least one row)")
    return group, (rank * vocab // pp, (rank + 1) * vocab // pp)


class VocabParallelOutput(nn.Module):
    """This rank's shard of an LM head (an ``nn.Linear`` from the hidden width to the vocabulary)
    and of its loss, the mean token cross-entropy of each microbatch.

    Args:
        head: the full head; its rows ``[r*V//p, (r+1)*V//p)`` (and bias entries) are copied into
            this rank's ``weight`` (and ``bias``), r being this rank in ``group`` of p ranks (V
            need not divide: the shards then differ by a row). ``shard_range`` says which rows.
        group: the pipeline's process group (default: the world): the same group as the stages.
        ignore_index: a target that counts in no loss (as ``F.cross_entropy``'s).
        data_parallel_group: with data-parallel pipeline replicas (DDP or FSDP stages), the group
            of this rank's replicas: after each training step the shard's gradients are averaged
            over it, as DDP averages a stage's.
        collective_group: on a stream-ordered pipeline (NCCL, or ``stream_ordered=True``), the
            group the head's collectives run on: the pipeline's ranks in its order, on a
            communicator of their own (on the pipeline's one they would deadlock:
            docs/vocab_parallel.md). None: zbpipe makes one at the first step, of the pipeline
            group's backend (NCCL or Gloo) over its store. Unused on Gloo pipelines, whose
            collectives go over ``group``.

    Use: remove the head from the last stage (which then returns the hidden states after the
    final norm), give ``output=VocabParallelOutput(head)`` to any schedule class instead of
    ``loss_fn=``, and ``target=`` (the token ids, one per position of the last stage's output) to
    ``step`` and ``eval`` on every rank: each rank needs every microbatch's targets for its
    shard. Losses are reported on the last stage's rank, as with a loss_fn. Train the shard's
    parameters (``output.parameters()``) with the rest of the rank's.
    """

    def __init__(self, head: nn.Linear, group: dist.ProcessGroup | None = None, ignore_index: int = -100, *,
                 data_parallel_group: dist.ProcessGroup | None = None,
                 collective_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(head, nn.Linear):
            raise TypeError(f"VocabParallelOutput: head must be an nn.Linear (hidden width -> vocabulary), got "
                            f"{type(head).__name__}")
        group, (begin, end) = vocabulary_shard("VocabParallelOutput", head.out_features, group)
        pp, rank = group.size(), group.rank()
        vocab, width = head.out_features, head.in_features
        self.group = group
        self.data_parallel_group = data_parallel_group
        if collective_group is not None and (collective_group.size(), collective_group.rank()) != (pp, rank):
            raise ValueError(f"VocabParallelOutput: collective_group has rank {collective_group.rank()} of "
                             f"{collective_group.size()}, the pipeline group {rank} of {pp}: it must hold the "
                             f"pipeline's ranks in the same order")
        self.collective_group = collective_group
        self.shard_range = (begin, end)
        self.vocab_size = vocab
        self.in_features = width
        self.ignore_index = int(ignore_index)
        # Emulated devices (benchmarks/bench_vocab.py): (S ms, T ms) each pass also sleeps.
        self._emulate_ms = (0.0, 0.0)
        with torch.no_grad():
            self.weight = nn.Parameter(head.weight[begin:end].detach().clone())
            self.bias = nn.Parameter(head.bias[begin:end].detach().clone()) if head.bias is not None else None

    def extra_repr(self) -> str:
        return (f"rows {self.shard_range[0]}..{self.shard_range[1]} of {self.vocab_size}, "
                f"in_features={self.in_features}, ignore_index={self.ignore_index}")

    def forward(self, *args, **kwargs):
        raise RuntimeError("VocabParallelOutput runs inside a schedule: pass it as output= to a schedule class")

    def check_targets(self, targets: list) -> list[torch.Tensor]:
        """The microbatches' targets as integer tensors; ValueError for one that is not an
        integer tensor or holds a token outside [0, vocab_size) other than ignore_index."""
        out = []
        for mb, t in enumerate(targets):
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"VocabParallelOutput: the targets of microbatch {mb} must be an integer tensor "
                                 f"of token ids, got {type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
            bad = ((t < 0) | (t >= self.vocab_size)) & (t != self.ignore_index)
            if bool(bad.any()):
                first = t[bad].flatten()[0].item()
                raise ValueError(f"VocabParallelOutput: microbatch {mb} has target {first} outside [0, "
                                 f"{self.vocab_size}) (ignore_index={self.ignore_index}); "
                                 f"{int(bad.sum())} such target(s)")
            out.append(t)
        return out

    def _zb_targets(self, step) -> list[torch.Tensor]:
        """The executor's call at a step's start (csrc/python/py_vocab.h)."""
        return step.targets

    def _zb_collective_group(self, pipeline, store, timeout_s: float):
        """The executor's call on a stream-ordered pipeline, at its first step (csrc/python/
        py_vocab.h): ``collective_group``, else a new group of the pipeline group's backend over
        ``store`` (prefixed for it; every rank of the pipeline makes it now), else None."""
        if self.collective_group is not None:
            return self.collective_group
        if store is None:
            return None
        rank, size = pipeline.rank(), pipeline.size()
        kinds = {control_plane.backend_name(pipeline, d) for d in ("cpu", "cuda")}
        if "nccl" in kinds:  # the pipeline's own kind: the head's tensors are on its device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=timeout_s)
            backend = dist.ProcessGroupNCCL(store, rank, size, options)
            group = dist.ProcessGroup(store, rank, size)
            group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
            return group
        if "gloo" in kinds:
            return control_plane.gloo_control_group(store, rank, size, timeout_s)
        return None

    def _sync_gradients(self) -> None:
        """After a training step: the shard's gradients averaged over the data-parallel group."""
        group = self.data_parallel_group
        if group is None or group.size() == 1:
            return
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(group.size())
