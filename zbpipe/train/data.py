"""Synthetic next-token task: sequences from a fixed random sparse second-order Markov chain.

The next token depends on the previous two, each pair having `branching` possible successors
with skewed probabilities, so the model has to use attention (not just a bigram table) to drive
the loss from ln(vocab) towards the chain's entropy (reported as the floor). A batch is a pure
function of (seed, step): every rank and the single-process reference see the same data without
any communication.
"""

from __future__ import annotations

import math

import torch

_DENSE_UP_TO = 128  # vocabularies with a dense transition table (vocab^3 floats)


class MarkovTask:
    def __init__(self, vocab: int, seq_len: int, seed: int, branching: int = 2):
        if not 1 <= branching <= vocab:
            raise ValueError(f"branching ({branching}) must be in [1, vocab={vocab}]")
        if seq_len < 2:
            raise ValueError(f"seq_len ({seq_len}) must be >= 2 for a second-order chain")
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        # One row per (token[t-2], token[t-1]) pair: a dense table up to a 128-token vocabulary;
        # beyond it (the vocabulary-parallel trainings, 32k tokens) the pairs share 65536 rows of
        # `branching` successors each (a dense table would hold vocab^3 floats).
        self.rows = vocab * vocab if vocab <= _DENSE_UP_TO else min(vocab * vocab, 1 << 16)
        if vocab <= _DENSE_UP_TO:
            succ = torch.rand(self.rows, vocab, generator=g).argsort(-1)[:, :branching]
        else:
            succ = torch.randint(vocab, (self.rows, branching), generator=g)
        probs = (torch.randn(self.rows, branching, generator=g) * 1.5).softmax(-1)
        self.succ, self.probs = succ, probs
        self.transition = torch.zeros(self.rows, vocab).scatter_(1, succ, probs) if vocab <= _DENSE_UP_TO else None

    def _sample(self, g: torch.Generator, batch_size: int) -> torch.Tensor:
        seq = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(self.vocab, (batch_size, 2), generator=g)
        for t in range(2, self.seq_len + 1):
            row = (seq[:, t - 2] * self.vocab + seq[:, t - 1]) % self.rows
            if self.transition is not None:
                seq[:, t] = torch.multinomial(self.transition[row], 1, generator=g).squeeze(1)
            else:
                pick = torch.multinomial(self.probs[row], 1, generator=g)
                seq[:, t] = self.succ[row].gather(1, pick).squeeze(1)
        return seq

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [batch_size, seq_len]; targets are inputs shifted by one."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        seq = self._sample(g, batch_size)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def entropy_floor(self, samples: int = 512) -> float:
        """Best achievable mean loss in nats, estimated on `samples` sequences: the first target
        is uniform (ln vocab), every later one has its transition row's entropy."""
        seq = self._sample(torch.Generator().manual_seed(-1 - self.seed), samples)
        p = self.transition if self.transition is not None else self.probs
        h_rows = -(p * p.clamp_min(1e-30).log()).sum(-1)
        h = h_rows[(seq[:, :-2] * self.vocab + seq[:, 1:-1]) % self.rows]  # targets at positions 2..seq_len
        return (math.log(self.vocab) + float(h.mean()) * (self.seq_len - 1)) / self.seq_len
