"""The schedules the tests sweep, and how a test places and builds them.

RULES is the tests' own statement of every schedule's legal sizes (topology, stages per rank,
microbatch counts), written independently of the builders, so a builder that drifts from it
fails tests/core/test_schedule_grid.py. rank_schedule() builds a rank's stages and schedule
object the way every multi-process test does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

import zbpipe


@dataclass(frozen=True)
class Rule:
    topology: str = "loop"           # "loop": stage s on rank s % pp; "v": down then back up
    fixed_spr: int = 0               # > 0: stages_per_rank the schedule fixes
    min_spr: int = 1                 # otherwise: the smallest legal stages_per_rank ...
    default_spr: int = 1             # ... and the default one
    rounds: bool = False             # PyTorch's interleaved rule: m % max(1, m // pp) == 0
    min_mb_per_pp: int = 0           # m >= min_mb_per_pp * pp
    forward_only: bool = False
    extra_illegal: tuple = field(default=())  # (kwargs, message fragment)

    def spr_values(self):
        # None exercises the default; then the minimum (when it differs) and a larger value.
        return [None] if self.fixed_spr else [None] + sorted({self.min_spr, 3} - {self.default_spr})

    def spr(self, given):
        return self.fixed_spr or given or self.default_spr

    def legal_mb(self, pp, m):
        if self.rounds and m % max(1, m // pp):
            return False
        return m >= max(1, self.min_mb_per_pp * pp)

    def microbatch_counts(self, pp):
        """The smallest legal count, an odd legal one, and a large one."""
        smallest = next(m for m in range(1, 64 * pp) if self.legal_mb(pp, m))
        odd = next(m for m in range(2 * pp - 1, 64 * pp, 2) if self.legal_mb(pp, m))
        large = next(m for m in range(4 * pp, 64 * pp) if self.legal_mb(pp, m))
        return sorted({smallest, odd, large})


ONE = dict(fixed_spr=1)
V2 = dict(topology="v", fixed_spr=2)
RULES = {
    "inference": Rule(**ONE, forward_only=True),
    "gpipe": Rule(**ONE),
    "1f1b": Rule(**ONE),
    "looped_bfs": Rule(min_spr=1, default_spr=2),
    "interleaved_1f1b": Rule(min_spr=1, default_spr=2, rounds=True),
    "interleaved_zb": Rule(min_spr=1, default_spr=2, rounds=True),
    "zb_h1": Rule(**ONE),
    "zb_h2": Rule(**ONE),
    "zbv": Rule(**V2),
    "dualpipev": Rule(**V2, min_mb_per_pp=2),
    "zb_auto": Rule(**ONE, extra_illegal=((dict(pp=2, microbatches=4, memory_cap=-1), "memory_cap"),)),
    "v_half": Rule(**V2),
    "v_min": Rule(**V2),
}
NAMES = zbpipe.schedule_names()


def rule_of(name) -> Rule:
    if name not in RULES:
        pytest.fail(f"schedule '{name}' is registered but has no legal-size rule in "
                    f"tests/helpers/schedule_registry.py RULES: add one")
    return RULES[name]


def topology(style, pp, n_stages):
    return [s % pp if style == "loop" or (s // pp) % 2 == 0 else pp - 1 - s % pp
            for s in range(n_stages)]


def training_names() -> list[str]:
    """Every registered schedule that trains (all but the forward-only ones)."""
    return [n for n in NAMES if not rule_of(n).forward_only]


def small_microbatch_counts(name: str, pp: int, n: int = 2) -> list[int]:
    """The first `n` legal microbatch counts of `name` among pp, 2pp, 3pp, 4pp."""
    return [m for m in range(pp, 5 * pp, pp) if rule_of(name).legal_mb(pp, m)][:n]


def local_stages(program: zbpipe.Program, rank: int) -> list[int]:
    """Stage indices `program` places on `rank`, in increasing order."""
    return [s for s, r in enumerate(program.stage_to_rank) if r == rank]


def rank_schedule(name: str, modules, rank: int, pp: int, microbatches: int, *, stages_per_rank=None, group=None,
                  wrap=None, device="cpu", stage_kwargs: dict | None = None, **schedule_kwargs):
    """This rank's zbpipe.PipelineStages over `modules` (every stage's module, indexed by stage;
    `wrap(module)` wraps the local ones, e.g. in DDP) on `device` as schedule `name` places
    them, and its schedule class over them (a single-stage class takes the stage, a
    multi-stage one the list). Returns (schedule, local stage indices)."""
    program = zbpipe.compile(name, pp, microbatches, stages_per_rank)
    mine = local_stages(program, rank)
    stages = [zbpipe.PipelineStage(wrap(modules[s]) if wrap else modules[s], s, program.num_stages, device,
                                   group=group, **(stage_kwargs or {})) for s in mine]
    cls = zbpipe.get_schedule_class(name)
    arg = stages[0] if issubclass(cls, zbpipe.PipelineScheduleSingle) else stages
    return cls(arg, microbatches, **schedule_kwargs), mine
