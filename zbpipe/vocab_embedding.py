"""VocabParallelEmbedding: the input embedding split by vocabulary rows over every pipeline rank
(vocabulary parallelism's input layer, Yeung et al. 2025; docs/vocab_parallel.md).

Each rank builds one from the full nn.Embedding and keeps its contiguous shard of rows; a
schedule given it as ``input_embedding=`` runs its E and EW passes and their collectives as
actions of its program (csrc/include/zbpipe/vocab.h), the math in the C++ executor
(csrc/runtime/embed_run.h).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .vocab_parallel import vocabulary_shard


class VocabParallelEmbedding(nn.Module):
    """This rank's shard of an input embedding (an ``nn.Embedding``).

    Args:
        embedding: the full embedding; its rows ``[r*V//p, (r+1)*V//p)`` are copied into this
            rank's ``weight``, r being this rank in ``group`` of p ranks (V need not divide).
            ``shard_range`` says which rows. ``padding_idx`` is kept (that row gets no
            gradient, as nn.Embedding's); ``max_norm``, ``scale_grad_by_freq`` and
            ``sparse=True`` are refused (ValueError).
        group: the pipeline's process group (default: the world): the same group as the stages.
        data_parallel_group: with data-parallel pipeline replicas (DDP or FSDP stages), the group
            of this rank's replicas: after each training step the shard's gradient is averaged
            over it, as DDP averages a stage's.

    Use: remove the embedding from stage 0 (whose module then takes the embedding's output, of
    the token ids' shape plus ``embedding_dim``, as its first positional argument), give
    ``input_embedding=VocabParallelEmbedding(embedding)`` to any schedule class, and the token
    ids as the first positional argument of ``step`` and ``eval`` on every rank: each rank
    looks up the tokens of its rows. Train the shard's ``weight`` with the rest of the rank's
    parameters.
    """

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup | None = None, *,
                 data_parallel_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding: embedding must be an nn.Embedding (vocabulary -> width), got "
                            f"{type(embedding).__name__}")
        refused = [(embedding.max_norm is not None, f"max_norm={embedding.max_norm} (renormalizes rows in place "
                    "during the forward)"),
                   (embedding.scale_grad_by_freq, "scale_grad_by_freq=True (scales by counts over the whole batch)"),
                   (embedding.sparse, "sparse=True (a sparse gradient)")]
        for bad, what in refused:
            if bad:
                raise ValueError(f"VocabParallelEmbedding: {what} is not supported; build the nn.Embedding without it")
        group, (begin, end) = vocabulary_shard("VocabParallelEmbedding", embedding.num_embeddings, group)
        vocab, width = embedding.num_embeddings, embedding.embedding_dim
        self.group = group
        self.data_parallel_group = data_parallel_group
        self.shard_range = (begin, end)
        self.num_embeddings = vocab
        self.embedding_dim = width
        self.padding_idx = embedding.padding_idx
        with torch.no_grad():
            self.weight = nn.Parameter(embedding.weight[begin:end].detach().clone())

    def extra_repr(self) -> str:
        return (f"rows {self.shard_range[0]}..{self.shard_range[1]} of {self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}, padding_idx={self.padding_idx}")

    def forward(self, *args, **kwargs):
        raise RuntimeError("VocabParallelEmbedding runs inside a schedule: pass it as input_embedding= to a "
                           "schedule class")

    def check_ids(self, ids: list) -> list[torch.Tensor]:
        """The microbatches' token ids as integer tensors; ValueError for one that is not an
        integer tensor or holds a token outside [0, num_embeddings)."""
        for mb, t in enumerate(ids):
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"VocabParallelEmbedding: the token ids of microbatch {mb} (step's first positional "
                                 f"argument) must be an integer tensor, got "
                                 f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
            bad = (t < 0) | (t >= self.num_embeddings)
            if bool(bad.any()):
                first = t[bad].flatten()[0].item()
                raise ValueError(f"VocabParallelEmbedding: microbatch {mb} has token id {first} outside [0, "
                                 f"{self.num_embeddings}); {int(bad.sum())} such id(s)")
        return list(ids)

    def _zb_ids(self, step) -> list[torch.Tensor]:
        """The executor's call at a step's start (csrc/python/py_embed.h)."""
        return step.embedding_ids

    def _sync_gradients(self) -> None:
        """After a training step: the shard's gradient averaged over the data-parallel group."""
        group = self.data_parallel_group
        if group is None or group.size() == 1 or self.weight.grad is None:
            return
        dist.all_reduce(self.weight.grad, group=group)
        self.weight.grad.div_(group.size())
