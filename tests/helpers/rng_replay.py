"""The one-process reference of a pipelined training step whose stages draw random numbers
(Dropout, torch.rand, a lazy module's initialization): per-rank RNG replay, as
docs/runtime.md#recipes defines it.

A pipeline rank draws from its own default generator, for its own stages only, in the order its
program runs their forwards (shape inference draws nothing; a backward draws nothing outside a
checkpoint's recompute, which restores the forward's state). So the one process a pipelined step
equals keeps one generator state per pipeline rank, each seeded as that rank was, and runs the
forward of stage s on microbatch k under the state of the rank holding s, in that rank's
program order; the loss and backward follow microbatch by microbatch. With one stage per rank
that is: each stage over microbatches 0..n-1 in order, drawing from a generator of its own.
"""

from __future__ import annotations

import torch

import zbpipe


def forward_order(program: zbpipe.Program, rank: int) -> list[tuple[int, int]]:
    """(stage, microbatch) of every forward `rank` runs, in program order (an OVERLAP_F_B's F
    included)."""
    order = []
    for a in program.action_values(rank):
        for part in (a.sub_actions or [a]) if a.is_compute else []:
            if part.kind == zbpipe.Kind.F:
                order.append((part.stage, part.microbatch))
    return order


def seeded_state(seed: int) -> torch.Tensor:
    """The CPU generator state right after torch.manual_seed(seed), leaving the generator as
    it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.get_rng_state()


def seeded_states(seed: int, pp: int) -> dict[int, torch.Tensor]:
    """Every pipeline rank's generator state after torch.manual_seed(seed) on each."""
    return {r: seeded_state(seed) for r in range(pp)}


def replay_step(mods, program: zbpipe.Program, arg_mbs: list, target_mbs: list, loss_fn, states: dict,
                loss_scale: float, kwarg_mbs: list | None = None) -> list:
    """One training step of the stage modules `mods` (indexed by stage) in this process, under
    per-rank RNG replay from `states` ({rank: generator state}, advanced in place to each
    rank's state after the step): every forward as `program` places and orders it, then per
    microbatch loss_fn(output, target) scaled by loss_scale and its backward. Returns the
    microbatch losses. The process's own generator is left as it was."""
    todo = {r: forward_order(program, r) for r in range(program.pp)}
    last = program.num_stages - 1
    outs: dict[tuple[int, int], object] = {}
    with torch.random.fork_rng(devices=[]):
        while any(todo.values()):
            ran = False
            for r, queue in todo.items():
                while queue and (queue[0][0] == 0 or (queue[0][0] - 1, queue[0][1]) in outs):
                    s, k = queue.pop(0)
                    x = arg_mbs[k] if s == 0 else (outs[s - 1, k],)
                    torch.set_rng_state(states[r])
                    outs[s, k] = mods[s](*x, **(kwarg_mbs[k] if kwarg_mbs else {}))
                    states[r] = torch.get_rng_state()
                    ran = True
            assert ran, f"the program's forwards cannot run in order: {todo}"
    losses = []
    for k, target in enumerate(target_mbs):
        loss = loss_fn(outs[last, k], target)
        (loss * loss_scale).backward()
        losses.append(loss.detach())
    return losses
