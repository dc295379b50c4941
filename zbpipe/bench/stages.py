"""The stages `zbpipe bench` runs: emulated blocks (fixed F / I / W, optionally under
torch.utils.checkpoint, whose recompute costs one more F) or the trainer's tiny transformer, with
one step's data and loss for either."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import BenchConfig
from .emulated import EmulatedBlock


class Checkpointed(nn.Module):
    """`checkpoint(block, x)`, non-reentrant: the block's saved buffer is dropped after F and
    remade by a second forward (one more F) in the backward of the input path (I or B)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def emulated_modules(cfg: BenchConfig, num_stages: int, ac: bool) -> list[nn.Module]:
    """One EmulatedBlock per schedule stage with the stage's share of the 1F1B stage costs."""
    costs = cfg.stage_costs(num_stages)
    saved = cfg.saved_elems(num_stages)
    out = []
    for s in range(num_stages):
        block = EmulatedBlock(cfg.width, costs["f"][s], costs["i"][s], costs["w"][s], saved_elems=saved)
        out.append(Checkpointed(block) if ac else block)
    return out


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class Workload:
    """Modules, one step's (input, target) on `device`, the loss, and example (input, output)
    microbatches per stage for static shape declaration."""

    def __init__(self, cfg: BenchConfig, num_stages: int, ac: bool, device: torch.device):
        self.cfg, self.num_stages, self.device = cfg, num_stages, device
        m = cfg.microbatches
        if cfg.model == "emulated":
            self.modules = emulated_modules(cfg, num_stages, ac)
            self.x = torch.zeros(m, cfg.width, device=device)
            self.y = torch.zeros(m, cfg.width, device=device)
            self.loss_fn = _mse
        else:
            from ..train.data import MarkovTask
            from ..train.model import TinyConfig, build_stages, lm_loss

            self.tiny = TinyConfig()
            self.modules = build_stages(self.tiny, num_stages, seed=0)
            x, y = MarkovTask(self.tiny.vocab, self.tiny.seq_len, seed=0).batch(0, 2 * m)
            self.x, self.y = x.to(device), y.to(device)
            self.loss_fn = lm_loss

    def io_examples(self, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.model == "trainer":
            from ..train.model import stage_io_examples

            return stage_io_examples(self.tiny, stage, self.num_stages, 2, self.device)
        shape = (1, self.cfg.width)
        x = torch.empty(shape, device=self.device, requires_grad=stage > 0)
        return x, torch.empty(shape, device=self.device, requires_grad=True)

    def nominal(self, stage: int, kind: str, ac: bool) -> float | None:
        """The emulated time (ms) of one action of `stage`; None for the trainer's model."""
        if self.cfg.model != "emulated":
            return None
        c = nominal_costs(self.cfg, self.num_stages, ac)
        f, i, w = c["f"][stage], c["i"][stage], c["w"][stage]
        return {"F": f, "I": i, "W": w, "B": i + w}[kind]


def nominal_costs(cfg: BenchConfig, num_stages: int, ac: bool) -> dict[str, list[float]]:
    """Per schedule stage, the ms each split action spends: AC's recompute (one more F) runs
    in the input path's backward (I); on the first stage, whose input needs no gradient, the
    input path runs in W and I has nothing to do."""
    c = cfg.stage_costs(num_stages)
    i = [v + (f if ac else 0.0) for v, f in zip(c["i"], c["f"])]
    w = list(c["w"])
    w[0], i[0] = w[0] + i[0], 0.0
    return {"f": list(c["f"]), "i": i, "w": w}
