"""A tiny pre-norm decoder-only transformer built directly as a list of pipeline stages.

Stage 0 owns the token/position embeddings, the last stage owns the final norm and LM head, and
the blocks are spread as evenly as possible (earlier stages get the extra ones). Building the
whole list from one seed in every process gives every rank bit-identical initial weights, and
`nn.Sequential(*build_stages(...))` is the single-process reference model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


class Stage(nn.Module):
    """One pipeline stage: optional embedding, some blocks, optional head.

    Input is int64 tokens [b, t] on the first stage and float hidden states [b, t, d] elsewhere;
    output is logits [b, t, vocab] on the last stage and hidden states elsewhere.
    """

    def __init__(self, cfg: TinyConfig, n_blocks: int, first: bool, last: bool):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model) if first else None
        self.pos_emb = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02) if first else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(cfg.d_model) if last else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
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


def build_stages(cfg: TinyConfig, num_stages: int, seed: int) -> list[Stage]:
    """All `num_stages` stages, initialised from `seed` in stage order (same on every rank)."""
    torch.manual_seed(seed)
    counts = blocks_per_stage(cfg.n_layers, num_stages)
    return [Stage(cfg, n, s == 0, s == num_stages - 1) for s, n in enumerate(counts)]


def stage_io_examples(
    cfg: TinyConfig, stage_index: int, num_stages: int, microbatch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Example (input, output) of one microbatch for a stage, for static shape declaration.
    Float tensors require grad: torch.distributed.pipelining reads that flag as "this tensor
    carries a gradient" (without it on outputs, stage 0 is sent no gradient at all)."""
    b, t, d = microbatch_size, cfg.seq_len, cfg.d_model
    if stage_index == 0:
        x = torch.zeros(b, t, dtype=torch.long, device=device)
    else:
        x = torch.empty(b, t, d, device=device, requires_grad=True)
    out_dim = cfg.vocab if stage_index == num_stages - 1 else d
    return x, torch.empty(b, t, out_dim, device=device, requires_grad=True)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; the pipeline calls it per microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
