"""Pipelined steps equal a single-process reference: loss and every parameter gradient, for
every schedule of zbpipe.schedule_names() x five models (MLP with keyword arguments,
transformer blocks, a weight used twice, dict outputs, non-reentrant checkpoint), pp in {2, 4},
two microbatch counts each; per model also the deferred-Linear option (also under checkpoint),
gradient accumulation over two steps, a forward-only pass and receives posted at their RECV
action instead of at step start; inference checks the forward only.

One case per (pp, schedule, model); the cases of one pp share one spawned Gloo world.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.asserts import assert_close, assert_grads_close
from helpers.model_registry import MODELS, build, call_chain, data
from helpers.schedule_registry import NAMES, rank_schedule, rule_of, small_microbatch_counts

import zbpipe

# pp=2 runs on two Gloo devices (each direction of the rank pair on its own connection, the
# launcher's default), pp=4 on one (the default of a plain Gloo group): both tag paths.
WORLDS = {2: 2, 4: 1}  # pp -> Gloo devices
FORWARD_ONLY_MODELS = ("mlp", "block")


def _check(rank, pp, name, m, model, *, steps=1, deferred=False, kwargs=None, train=True, prepost=True):
    """One configuration: `steps` pipelined steps against the same steps in one process."""
    tag = f"{name} pp={pp} mb={m} model={model} steps={steps} deferred={deferred} prepost={prepost} rank={rank}"
    num_stages = zbpipe.compile(name, pp, m).num_stages
    loss_fn = MODELS[model][2]
    kwargs = kwargs or {}
    mods = build(model, num_stages)
    ref = copy.deepcopy(mods)
    batches = [data(model, 2 * m, seed=1 + k) for k in range(steps)]
    ref_outs = []
    for x, y in batches:
        out = call_chain(ref, x, **kwargs)
        if train:
            loss = loss_fn(out, y)
            loss.backward()
            out = loss
        ref_outs.append(out.detach())
    sched, mine = rank_schedule(name, mods, rank, pp, m, stage_kwargs=dict(deferred_linear=deferred),
                                loss_fn=loss_fn if train else None, timeout=30, prepost_receives=prepost)
    last = num_stages - 1 in mine
    for (x, y), want in zip(batches, ref_outs):
        losses = []
        out = sched.step(*((x,) if 0 in mine else ()), target=y if last else None, losses=losses, **kwargs)
        if last and train:
            assert len(losses) == m, f"{tag}: {len(losses)} losses"
            assert_close(torch.stack(losses).mean(), want, msg=f"{tag}: loss")
        elif last:
            assert_close(out, want, msg=f"{tag}: inference output")
    if train:
        assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine], msg=tag)


def _schedule_with_model(rank, pp, name, model):
    """Every configuration of (schedule, model); returns how many ran."""
    counts = small_microbatch_counts(name, pp)
    if rule_of(name).forward_only:
        for m in counts:
            _check(rank, pp, name, m, model, train=False)
        return len(counts)
    for m in counts:
        kwargs = {"gain": 0.5, "shift": data("mlp", 2 * m, seed=9)[0]} if model == "mlp" else None
        _check(rank, pp, name, m, model, kwargs=kwargs)
    m = counts[0]
    extra = {
        "mlp": [dict(deferred=True), dict(steps=2, deferred=True), dict(train=False)],
        "twice": [dict(deferred=True), dict(steps=2)],
        "block": [dict(deferred=True)],
        "ckpt": [dict(deferred=True)],
        # Receives posted at their RECV action (the NCCL path) instead of at step start.
        "dict": [dict(steps=2, prepost=False)],
    }[model]
    for options in extra:
        _check(rank, pp, name, m, model, **options)
    return len(counts) + len(extra)


def _cases():
    for pp in WORLDS:
        for name in NAMES:
            models = FORWARD_ONLY_MODELS if rule_of(name).forward_only else list(MODELS)
            for model in models:
                yield pytest.param(pp, name, model, id=f"pp{pp}-{name}-{model}")


@pytest.mark.parametrize("pp,name,model", _cases())
def test_pipelined_step_matches_single_process(spawn_world, pp, name, model):
    assert small_microbatch_counts(name, pp), f"{name}: no valid microbatch count for pp={pp}"
    checked = spawn_world(pp, WORLDS[pp]).run(_schedule_with_model, name, model, timeout_s=240)
    assert len(set(checked)) == 1 and checked[0] > 0, checked
