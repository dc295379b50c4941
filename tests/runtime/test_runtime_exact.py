"""Pipelined steps equal a single-process reference: loss and every parameter gradient, for
every schedule of zbpipe.schedule_names(), pp in {2, 4}, two microbatch counts, five models
(MLP, transformer blocks, a weight used twice, dict outputs, non-reentrant checkpoint), the
deferred-Linear option (also under checkpoint), gradient accumulation over two steps and
receives posted at their RECV action instead of at step start; inference checks the forward
only.

All configurations of one pp run inside ONE spawned Gloo world (2 CPU cores in CI).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _models import MODELS, build, call_chain, data
from _pp_world import run_world

RTOL, ATOL = 1e-4, 1e-6  # float reassociation only (microbatch sums vs one batch)


def _microbatch_counts(zbpipe, name: str, pp: int) -> list[int]:
    counts = []
    for m in (pp, 2 * pp, 3 * pp, 4 * pp):
        try:
            zbpipe._C.build(name, pp, m) if name == "inference" else zbpipe.compile(name, pp, m)
        except zbpipe.ScheduleError:
            continue
        counts.append(m)
        if len(counts) == 2:
            break
    return counts


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _check(zbpipe, rank, pp, name, m, model, *, steps=1, deferred=False, kwargs=None, train=True,
           prepost=True):
    """One configuration; returns a failure description or None."""
    prog = zbpipe._C.build(name, pp, m)  # topology only
    num_stages = prog.num_stages
    stage_to_rank = list(prog.stage_to_rank)
    loss_fn = MODELS[model][2]
    kwargs = kwargs or {}
    mods = build(model, num_stages)
    ref = copy.deepcopy(mods)
    batches = [data(model, 2 * m, seed=1 + k) for k in range(steps)]

    ref_losses = []
    for x, y in batches:
        out = call_chain(ref, x, **kwargs)
        if train:
            loss = loss_fn(out, y)
            loss.backward()
            ref_losses.append(loss.detach())
        else:
            ref_out = out.detach()

    mine = [s for s in range(num_stages) if stage_to_rank[s] == rank]
    stages = [
        zbpipe.PipelineStage(mods[s], s, num_stages, "cpu", deferred_linear=deferred) for s in mine
    ]
    cls = zbpipe.get_schedule_class(name)
    sched = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=loss_fn if train else None, timeout=30,
                prepost_receives=prepost)
    tag = f"{name} pp={pp} mb={m} model={model} steps={steps} deferred={deferred} prepost={prepost} rank={rank}"
    for k, (x, y) in enumerate(batches):
        losses = []
        args = (x,) if 0 in mine else ()
        out = sched.step(*args, target=y if num_stages - 1 in mine else None, losses=losses, **kwargs)
        if num_stages - 1 in mine:
            if train:
                got = torch.stack(losses).mean()
                if len(losses) != m or not torch.allclose(got, ref_losses[k], rtol=RTOL, atol=ATOL):
                    return f"{tag}: loss {got.item()} != reference {ref_losses[k].item()} ({len(losses)} losses)"
            elif not torch.allclose(out, ref_out, rtol=RTOL, atol=ATOL):
                return f"{tag}: inference output differs by {(out - ref_out).abs().max().item()}"
    if train:
        for s in mine:
            for (pname, p), q in zip(mods[s].named_parameters(), ref[s].parameters()):
                if not _close(p.grad, q.grad):
                    diff = "None vs tensor" if (p.grad is None) != (q.grad is None) else (p.grad - q.grad).abs().max().item()
                    return f"{tag}: stage {s} grad of {pname} differs ({diff})"
    return None


def _exact_world(rank, pp):
    import zbpipe

    failures, checked = [], 0
    for name in zbpipe.schedule_names():
        counts = _microbatch_counts(zbpipe, name, pp)
        if not counts:
            failures.append(f"{name}: no valid microbatch count for pp={pp}")
            continue
        if name == "inference":
            for m in counts:
                for model in ("mlp", "block"):
                    failures.append(_check(zbpipe, rank, pp, name, m, model, train=False))
                    checked += 1
            continue
        for m in counts:
            for model in MODELS:
                kwargs = {"gain": 0.5, "shift": data("mlp", 2 * m, seed=9)[0]} if model == "mlp" else None
                failures.append(_check(zbpipe, rank, pp, name, m, model, kwargs=kwargs))
                checked += 1
        m = counts[0]
        for model in ("mlp", "twice", "block", "ckpt"):
            failures.append(_check(zbpipe, rank, pp, name, m, model, deferred=True))
            checked += 1
        failures.append(_check(zbpipe, rank, pp, name, m, "twice", steps=2))
        failures.append(_check(zbpipe, rank, pp, name, m, "mlp", steps=2, deferred=True))
        failures.append(_check(zbpipe, rank, pp, name, m, "mlp", train=False))  # forward only
        # Receives posted at their RECV action (the NCCL path) instead of at step start.
        failures.append(_check(zbpipe, rank, pp, name, m, "dict", steps=2, prepost=False))
        checked += 4
    return {"failures": [f for f in failures if f], "checked": checked}


# pp=2 runs on two Gloo devices (each direction of the rank pair on its own connection, the
# launcher's default), pp=4 on one (the default of a plain Gloo group): both tag paths.
@pytest.mark.parametrize("pp,gloo_devices", [(2, 2), (4, 1)], ids=["pp2-2dev", "pp4-1dev"])
def test_every_schedule_matches_single_process(pp, gloo_devices):
    results, codes, leftover = run_world(pp, _exact_world, timeout=240, gloo_devices=gloo_devices)
    assert not leftover, f"ranks {leftover} had to be killed"
    assert sorted(results) == list(range(pp)), f"missing results: {results} (exit codes {codes})"
    for rank, res in results.items():
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert res["checked"] > 0
        assert not res["failures"], "\n".join(res["failures"])
