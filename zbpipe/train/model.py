"""A tiny pre-norm decoder-only transformer and its split into pipeline stages.

Stage 0 owns the token/position embeddings, the last stage owns the final norm and LM head, and
the blocks are spread as evenly as possible (earlier stages get the extra ones). Every process
builds the whole model from one seed (bit-identical initial weights everywhere) and keeps its
stages with zbpipe.split_by_fqn, so parameter names do not depend on the pipeline size; the
whole model is the single-process reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zbpipe.module_split import split_by_fqn


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 16
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4


class CausalSelfAttention(nn.Module):
    """Plain matmul attention (no SDPA kernel) so every op has a simple autograd formula."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads != 0:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})")
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """The whole model: token and position embeddings, blocks, final norm and LM head.

    A pipeline stage is a copy of it with the other stages' parts removed (split_by_fqn), so a
    parameter has the same name (``blocks.3.attn.qkv.weight``) at every pipeline size. The
    forward skips what the stage lacks: without the embeddings its input is the previous
    stage's hidden states [b, t, d] (else int64 tokens [b, t]); without the head its output is
    hidden states (else logits [b, t, vocab]).
    """

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        with torch.no_grad():
            self.pos_emb.weight.mul_(0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb.weight[: x.shape[1]]
        for block in self.blocks if self.blocks is not None else []:  # a stage may hold the head alone
            x = block(x)
        if self.ln_f is not None:  # the last stage (with or without the head: see vocab_parallel)
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x


def blocks_per_stage(n_layers: int, num_stages: int) -> list[int]:
    """Even split of `n_layers` blocks over `num_stages`; every stage needs at least one block
    so each stage has weights of its own to compute gradients for."""
    if n_layers < num_stages:
        raise ValueError(
            f"n_layers ({n_layers}) must be >= num_stages ({num_stages}): one block per stage at least"
        )
    base, extra = divmod(n_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def stage_module_names(cfg: TinyConfig, num_stages: int, head: bool = True) -> list[list[str]]:
    """What each stage keeps of TinyTransformer: the embeddings go to the first, the final norm
    and head to the last (head=False: the norm only, the head being split over the ranks by
    zbpipe.VocabParallelOutput), the blocks are spread as blocks_per_stage says."""
    names, first = [], 0
    for s, n in enumerate(blocks_per_stage(cfg.n_layers, num_stages)):
        names.append([f"blocks.{i}" for i in range(first, first + n)])
        first += n
    names[0][:0] = ["tok_emb", "pos_emb"]
    names[-1] += ["ln_f", "head"] if head else ["ln_f"]
    return names


def build_model(cfg: TinyConfig, seed: int) -> TinyTransformer:
    """The whole model, initialised from `seed` (same on every rank)."""
    torch.manual_seed(seed)
    return TinyTransformer(cfg)


def build_stages(cfg: TinyConfig, num_stages: int, seed: int, head: bool = True) -> list[nn.Module]:
    """All `num_stages` stage modules of the model built from `seed`, with its parameter names
    (head=False: without the LM head)."""
    model = build_model(cfg, seed)
    if not head:
        model.head = None
    return split_by_fqn(model, stage_module_names(cfg, num_stages, head))


def stage_io_examples(
    cfg: TinyConfig, stage_index: int, num_stages: int, microbatch_size: int, device: torch.device,
    head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Example (input, output) of one microbatch for a stage, for static shape declaration.
    Float tensors require grad: torch.distributed.pipelining reads that flag as "this tensor
    carries a gradient" (without it on outputs, stage 0 is sent no gradient at all)."""
    b, t, d = microbatch_size, cfg.seq_len, cfg.d_model
    if stage_index == 0:
        x = torch.zeros(b, t, dtype=torch.long, device=device)
    else:
        x = torch.empty(b, t, d, device=device, requires_grad=True)
    out_dim = cfg.vocab if stage_index == num_stages - 1 and head else d
    return x, torch.empty(b, t, out_dim, device=device, requires_grad=True)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; the pipeline calls it per microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
