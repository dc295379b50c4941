"""Shapes may change between steps: a batch of 8 rows, then 12, then 8 again, then sequences of
length 5 and 7. Each new input signature of the first stage renegotiates every stage's shapes
(the handshake runs once per distinct signature: a signature seen before is reused), and every
step's loss and the accumulated gradients equal a single-process run of the same batches. With
static_shapes=True the first step's shapes stay, and a changed input fails every rank, saying so.

pp=3 on Gloo, 1f1b (one stage per rank) and zbv (rank 0 holds the first and the last stage),
in ONE spawned world.
"""

from __future__ import annotations

import copy

import torch

from _models import MODELS, build, call_chain
from _pp_world import run_world

PP = 3
M = 4
SHAPES = [(8, 8), (12, 8), (8, 8), (4, 5, 8), (4, 7, 8), (12, 8)]  # 4 distinct signatures
RTOL, ATOL = 1e-4, 1e-6


def _renegotiating(zbpipe, group, rank, name):
    prog = zbpipe._C.build(name, PP, M)
    num_stages, stage_to_rank = prog.num_stages, list(prog.stage_to_rank)
    loss_fn = MODELS["mlp"][2]
    mods = build("mlp", num_stages)
    ref = copy.deepcopy(mods)
    mine = [s for s in range(num_stages) if stage_to_rank[s] == rank]
    stages = [zbpipe.PipelineStage(mods[s], s, num_stages, "cpu", group=group) for s in mine]
    sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=loss_fn, timeout=60)
    failures = []
    for k, shape in enumerate(SHAPES):
        g = torch.Generator().manual_seed(10 + k)
        x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        ref_loss = loss_fn(call_chain(ref, x), y)
        ref_loss.backward()
        losses = []
        sched.step(*((x,) if 0 in mine else ()), target=y if num_stages - 1 in mine else None, losses=losses)
        if num_stages - 1 in mine:
            got = torch.stack(losses).mean()
            if not torch.allclose(got, ref_loss, rtol=RTOL, atol=ATOL):
                failures.append(f"{name} step {k} {shape}: loss {got.item()} != {ref_loss.item()}")
    for s in mine:
        for (pname, p), q in zip(mods[s].named_parameters(), ref[s].parameters()):
            if not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL):
                failures.append(f"{name} rank {rank}: stage {s} grad of {pname} differs by "
                                f"{(p.grad - q.grad).abs().max().item():.3g}")
    return {"failures": failures, "handshakes": sched._get_executor().handshakes}


def _static(zbpipe, group, rank):
    mods = build("mlp", PP)
    stage = zbpipe.PipelineStage(mods[rank], rank, PP, "cpu", group=group)
    sched = zbpipe.Schedule1F1B(stage, M, loss_fn=MODELS["mlp"][2], timeout=60, static_shapes=True)
    out = []
    for rows in (8, 8, 12):
        x, y = torch.randn(rows, 8), torch.randn(rows, 8)
        try:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == PP - 1 else None)
            out.append(("ok", "", sched._get_executor().handshakes))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e), sched._get_executor().handshakes))
    return out


def _world(rank, pp):
    import torch.distributed as dist

    import zbpipe

    out = {}
    for name in ("1f1b", "zbv"):
        out[name] = _renegotiating(zbpipe, dist.new_group(list(range(PP))), rank, name)
    out["static"] = _static(zbpipe, dist.new_group(list(range(PP))), rank)
    dist.barrier()
    return out


def test_shapes_renegotiate_between_steps():
    results, codes, leftover = run_world(PP, _world, timeout=240)
    assert not leftover and codes == [0] * PP, (leftover, codes)
    for rank in range(PP):
        assert "error" not in results[rank], results[rank].get("error")
        r = results[rank]
        for name in ("1f1b", "zbv"):
            assert not r[name]["failures"], "\n".join(r[name]["failures"])
            assert r[name]["handshakes"] == 4, (name, rank, r[name]["handshakes"])
        first, second, changed = r["static"]
        assert first == ("ok", "", 1) and second == ("ok", "", 1), r["static"]
        kind, msg, handshakes = changed
        assert kind == "PipelineError" and handshakes == 1, changed
        assert "(float32[3, 8]) but the pipeline agreed on (float32[2, 8])" in msg, msg
        if rank == 0:
            assert "static_shapes=True" in msg and ">>0F0<<" in msg, msg
        else:
            assert "rank 0 failed at action 0F0 (its step 3)" in msg, msg
