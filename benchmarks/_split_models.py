"""The compute-bound stages of the split-backward benchmarks (bench_split.py, bench_bubble.py):
one stage module per model, and the shape of one microbatch (64 rows of activations).

- `linear`: four nn.Linear(1024, 1024) in sequence (issue #8's measurement).
- `block`: one transformer encoder block, attention + MLP (d=512, 8 heads, MLP 2048, pre-norm).
  Its attention calls its projections through their weights (F.multi_head_attention_forward),
  so `deferred_linear` defers only the MLP's two Linears there.
- `twice`: two nn.Linear(1024, 1024), each applied twice (a weight used twice in one stage).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Twice(nn.Module):
    def __init__(self, width: int = 1024):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        h = self.a(torch.relu(self.a(x)))
        return self.b(torch.relu(self.b(torch.relu(h))))


def _linear() -> nn.Module:
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))


def _block() -> nn.Module:
    return nn.TransformerEncoderLayer(512, nhead=8, dim_feedforward=2048, dropout=0.0, batch_first=True,
                                      norm_first=True)


# name -> (stage factory, shape of one microbatch)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "linear": (_linear, (64, 1024)),
    "block": (_block, (2, 32, 512)),
    "twice": (Twice, (64, 1024)),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()

