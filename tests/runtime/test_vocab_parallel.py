"""Vocabulary parallelism runs exactly (docs/vocab_parallel.md): with the LM head split by rows
over every rank (zbpipe.VocabParallelOutput as output=), the step's losses and every gradient
(the stages', and each shard's weight and bias rows) equal one process running the whole model
with F.cross_entropy per microbatch, on every training schedule (V, interleaved and DualPipeV
placements included), at pp=2 and pp=4, with an uneven vocabulary and ignored targets; under
DDP stages with data-parallel replicas; and on a transformers Llama at a 32k vocabulary. A rank
failing mid-step stops every rank waiting in a vocabulary collective, naming the culprit.

One spawned world per size (2 and 4 ranks), shared by the module's tests.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers.grids import pp2_dp2_grid
from helpers.schedule_registry import local_stages, training_names

import zbpipe

TRAINING = training_names()
D, V, SEQ = 16, 37, 6  # V=37: shards of 18 and 19 rows at pp=2, 9 and 10 at pp=4
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _lm(num_stages: int, seed: int = 0):
    """A small LM as one module per stage (embedding on the first, a LayerNorm on the last) and
    its head, the same on every rank."""
    torch.manual_seed(seed)
    mods = []
    for s in range(num_stages):
        layers = [nn.Embedding(V, D)] if s == 0 else []
        layers.append(nn.Sequential(nn.Linear(D, D), nn.Tanh()))
        if s == num_stages - 1:
            layers.append(nn.LayerNorm(D))
        mods.append(nn.Sequential(*layers))
    return mods, nn.Linear(D, V)


def _batch(m: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(V, (2 * m, SEQ), generator=g), torch.randint(V, (2 * m, SEQ), generator=g)
    y[0, :2] = -100  # ignored tokens
    y[3, 1] = -100
    return x, y


def _reference(mods, head, x, y, m):
    """One process: per-microbatch mean cross-entropy, their mean; returns the losses."""
    h = x
    for mod in mods:
        h = mod(h)
    losses = [F.cross_entropy(head(hc).flatten(0, 1), yc.flatten()) for hc, yc in zip(h.chunk(m), y.chunk(m))]
    torch.stack(losses).mean().backward()
    return [loss.detach() for loss in losses]


def _schedule(name, stages, m, **kwargs):
    cls = zbpipe.get_schedule_class(name)
    return cls(stages[0] if issubclass(cls, zbpipe.PipelineScheduleSingle) else stages, m, timeout=60, **kwargs)


def _check_shard(out, ref_head, what):
    b, e = out.shard_range
    assert _rel(out.weight.grad, ref_head.weight.grad[b:e]) <= TOL, f"{what}: weight rows {b}:{e}"
    assert _rel(out.bias.grad, ref_head.bias.grad[b:e]) <= TOL, f"{what}: bias rows {b}:{e}"


def _exact(rank, size, name, **options):
    m = 2 * size
    program = zbpipe.compile(name, size, m)
    mods, head = _lm(program.num_stages)
    ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    x, y = _batch(m)
    ref_losses = _reference(ref_mods, ref_head, x, y, m)
    mine = local_stages(program, rank)
    stages = [zbpipe.PipelineStage(mods[s], s, program.num_stages, "cpu") for s in mine]
    out = zbpipe.VocabParallelOutput(head)
    losses = []
    _schedule(name, stages, m, output=out, **options).step(*((x,) if 0 in mine else ()), target=y, losses=losses)
    for s in mine:
        for (n, p), q in zip(mods[s].named_parameters(), ref_mods[s].parameters()):
            assert _rel(p.grad, q.grad) <= TOL, f"{name}: stage {s} {n}"
    _check_shard(out, ref_head, name)
    if program.stage_to_rank[-1] == rank:
        assert len(losses) == m
        for got, want in zip(losses, ref_losses):
            assert abs(got.item() - want.item()) <= TOL * abs(want.item())
    else:
        assert losses == []
    return out.shard_range


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", TRAINING)
def test_loss_and_every_gradient_equal_one_process(spawn_world, name, pp):
    ranges = spawn_world(pp).run(_exact, name, timeout_s=180)
    assert ranges == [(r * V // pp, (r + 1) * V // pp) for r in range(pp)]  # uneven shards, in order


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", TRAINING)
def test_stream_ordered_posting_is_exact_with_the_collectives_on_a_group_of_their_own(spawn_world, name, pp):
    # NCCL's posting discipline over Gloo (stream_ordered=True): issue-order matching, receives
    # at their RECV, the collectives on a group zbpipe makes at the first step (Gloo, like the
    # pipeline's), the head's actions on a lane of their own (a thread: the CPU has no stream
    # to give them), and the executor's rendezvous check, which models both, passing. Without
    # the lane, 1f1b at pp=4 deadlocks here (T waiting for its statistics holds back a RECV).
    ranges = spawn_world(pp).run(_exact_stream_ordered, name, timeout_s=180)
    assert ranges == [(r * V // pp, (r + 1) * V // pp) for r in range(pp)]


def _exact_stream_ordered(rank, size, name):
    return _exact(rank, size, name, stream_ordered=True)


def _eval_and_two_steps(rank, size):
    """eval() reports the losses without gradients; two steps accumulate as one process does."""
    name, m = "zbv", 2 * size
    program = zbpipe.compile(name, size, m)
    mods, head = _lm(program.num_stages)
    ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    batches = [_batch(m, seed) for seed in (3, 4)]
    mine = local_stages(program, rank)
    stages = [zbpipe.PipelineStage(mods[s], s, program.num_stages, "cpu") for s in mine]
    out = zbpipe.VocabParallelOutput(head)
    sched = _schedule(name, stages, m, output=out)
    losses = []
    x, y = batches[0]
    sched.eval(*((x,) if 0 in mine else ()), target=y, losses=losses)
    assert out.weight.grad is None and all(p.grad is None for s in mine for p in mods[s].parameters())
    for x, y in batches:
        _reference(ref_mods, ref_head, x, y, m)
        sched.step(*((x,) if 0 in mine else ()), target=y)
    for s in mine:
        for p, q in zip(mods[s].parameters(), ref_mods[s].parameters()):
            assert _rel(p.grad, q.grad) <= TOL
    _check_shard(out, ref_head, "two steps")
    return [loss.item() for loss in losses]


def test_eval_reports_the_losses_and_steps_accumulate(spawn_world):
    results = spawn_world(2).run(_eval_and_two_steps, timeout_s=120)
    program = zbpipe.compile("zbv", 2, 4)
    mods, head = _lm(program.num_stages)
    x, y = _batch(4, 3)
    with torch.no_grad():
        h = x
        for mod in mods:
            h = mod(h)
        want = [F.cross_entropy(head(hc).flatten(0, 1), yc.flatten()).item() for hc, yc in zip(h.chunk(4), y.chunk(4))]
    root = program.stage_to_rank[-1]
    assert results[root] == pytest.approx(want, rel=TOL)
    assert results[1 - root] == []


# ---- DDP stages: pp 2 x dp 2 in the 4-rank world --------------------------------------------

def _ddp(rank, size, name):
    from torch.nn.parallel import DistributedDataParallel as DDP

    pp_group, dp_group, pp_rank, dp_rank = pp2_dp2_grid()
    m = 4
    program = zbpipe.compile(name, 2, m)
    mods, head = _lm(program.num_stages)
    ref_mods, ref_head = copy.deepcopy(mods), copy.deepcopy(head)
    x, y = _batch(2 * m)  # the global batch: 2 replicas x m microbatches of 2 rows
    _reference(ref_mods, ref_head, x, y, 2 * m)
    rows = slice(dp_rank * 2 * m, (dp_rank + 1) * 2 * m)
    mine = local_stages(program, pp_rank)
    stages = [zbpipe.PipelineStage(DDP(mods[s], process_group=dp_group), s, program.num_stages, "cpu",
                                   group=pp_group) for s in mine]
    out = zbpipe.VocabParallelOutput(head, group=pp_group, data_parallel_group=dp_group)
    _schedule(name, stages, m, output=out).step(*((x[rows],) if 0 in mine else ()), target=y[rows])
    for s in mine:
        for p, q in zip(mods[s].parameters(), ref_mods[s].parameters()):
            assert _rel(p.grad, q.grad) <= TOL, f"{name}: stage {s}"
    _check_shard(out, ref_head, f"{name} replica {dp_rank}")
    return out.weight.grad.flatten().tolist()


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_ddp_stages_with_data_parallel_replicas(spawn_world, name):
    grads = spawn_world(4).run(_ddp, name, timeout_s=180)
    assert grads[0] == grads[2] and grads[1] == grads[3]  # the replicas of a shard agree


# ---- a failure mid-step reaches the ranks waiting in a collective ------------------------------

class _FailsAt(nn.Module):
    """Raises in its training forward of the given microbatch (shape inference runs without
    gradients and is not counted)."""

    def __init__(self, inner, at):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x):
        if not torch.is_grad_enabled():
            return self.inner(x)
        self.calls += 1
        if self.calls == self.at + 1:
            raise RuntimeError("stage 0 broke on purpose")
        return self.inner(x)


def _failing(rank, size, **options):
    group = dist.new_group(list(range(size)))  # a failed step leaves its group unusable: not the world's
    m = 2 * size
    program = zbpipe.compile("1f1b", size, m)
    mods, head = _lm(program.num_stages)
    mods[0] = _FailsAt(mods[0], at=2)
    x, y = _batch(m)
    mine = local_stages(program, rank)
    stages = [zbpipe.PipelineStage(mods[s], s, program.num_stages, "cpu", group=group) for s in mine]
    sched = _schedule("1f1b", stages, m, output=zbpipe.VocabParallelOutput(head, group=group), **options)
    start = time.monotonic()
    try:
        sched.step(*((x,) if 0 in mine else ()), target=y)
    except zbpipe.PipelineError as e:
        return str(e).splitlines()[0], time.monotonic() - start
    return "no error", 0.0


def _failing_stream_ordered(rank, size):
    return _failing(rank, size, stream_ordered=True)


@pytest.mark.parametrize("posting", ["gloo", "stream_ordered"])
def test_a_failure_mid_step_reaches_every_rank_naming_the_culprit(spawn_world, posting):
    # stream_ordered: the waits of the head's lane (a thread) end with the abort too.
    results = spawn_world(4).run(_failing if posting == "gloo" else _failing_stream_ordered, timeout_s=120)
    assert results[0][0].startswith("rank 0 failed in stage 0 at action 0F2"), results[0][0]
    for line, seconds in results[1:]:
        assert line.startswith("aborted because rank 0 failed in stage 0 at action 0F2"), line
        assert seconds < 30  # the watch, not the 60 s timeout, ended the waits


def _too_wide(rank, size):
    group = dist.new_group(list(range(size)))
    mods, head = _lm(size)
    mods[-1] = nn.Sequential(mods[-1], nn.Linear(D, D + 1))  # the last stage's output is one wider
    x, y = _batch(size)
    stage = zbpipe.PipelineStage(mods[rank], rank, size, "cpu", group=group)
    sched = zbpipe.Schedule1F1B(stage, size, output=zbpipe.VocabParallelOutput(head, group=group), timeout=60)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y)
    except zbpipe.PipelineError as e:
        return str(e).splitlines()[0]
    return "no error"


def test_a_last_stage_wider_than_the_head_fails_every_rank_before_any_action(spawn_world):
    first, last = spawn_world(2).run(_too_wide, timeout_s=120)
    assert last.startswith("rank 1 failed at the start of step 1: the last stage's output is (float32[2, 6, 17]) "
                           "but the vocabulary-parallel head takes float32[2, 6, 16]"), last
    assert first.startswith("aborted because rank 1 failed at the start of step 1"), first


# ---- a transformers Llama at a 32k vocabulary ---------------------------------------------------

def _llama_rank(rank, size, names):
    from transformers import LlamaConfig, LlamaForCausalLM

    def hf():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=16, attn_implementation="sdpa",
                                            tie_word_embeddings=False))

    class Part(nn.Module):
        """Units [lo, hi) of embed_tokens, layers.0..5, norm (the head is the vocabulary's)."""

        def __init__(self, model, lo, hi):
            super().__init__()
            units = [model.model.embed_tokens, *model.model.layers, model.model.norm]
            self.units = nn.ModuleList(units[lo:hi])
            self._rotary = [model.model.rotary_emb]

        def forward(self, x):
            pos = torch.arange(x.shape[1]).unsqueeze(0)
            for u in self.units:
                if isinstance(u, nn.Embedding):
                    x = u(x)
                elif hasattr(u, "self_attn"):  # a decoder layer
                    pe = self._rotary[0](x, position_ids=pos)
                    x = u(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
                else:  # the final norm
                    x = u(x)
            return x

    g = torch.Generator().manual_seed(1)
    out_errors = {}
    for name in names:
        m = 2 * size
        x, y = torch.randint(32000, (m, 8), generator=g), torch.randint(32000, (m, 8), generator=g)
        ref = hf()
        logits = ref(x).logits
        ref_losses = [F.cross_entropy(lc.flatten(0, 1), yc.flatten()) for lc, yc in zip(logits.chunk(m), y.chunk(m))]
        torch.stack(ref_losses).mean().backward()
        model = hf()
        program = zbpipe.compile(name, size, m)
        n = program.num_stages
        bounds = [round(i * 8 / n) for i in range(n + 1)]  # 8 units over the stages
        parts = [Part(model, bounds[s], bounds[s + 1]) for s in range(n)]
        mine = local_stages(program, rank)
        stages = [zbpipe.PipelineStage(parts[s], s, n, "cpu") for s in mine]
        out = zbpipe.VocabParallelOutput(model.lm_head)
        losses = []
        _schedule(name, stages, m, output=out).step(*((x,) if 0 in mine else ()), target=y, losses=losses)
        theirs = dict(ref.named_parameters())
        worst = 0.0
        for s in mine:
            for pname, p in parts[s].named_parameters():
                unit = bounds[s] + int(pname.split(".")[1])
                rest = pname.split(".", 2)[2]
                ref_name = ("model.embed_tokens." if unit == 0 else "model.norm." if unit == 7
                            else f"model.layers.{unit - 1}.") + rest
                worst = max(worst, _rel(p.grad, theirs[ref_name].grad))
        b, e = out.shard_range
        worst = max(worst, _rel(out.weight.grad, ref.lm_head.weight.grad[b:e]))
        if losses:
            worst = max(worst, max(abs(a.item() - r.item()) / abs(r.item()) for a, r in zip(losses, ref_losses)))
        out_errors[name] = worst
    return out_errors


@pytest.mark.parametrize("pp", [2, 4])
def test_a_transformers_llama_at_32k_is_exact_on_every_schedule(spawn_world, pp):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install --no-deps transformers "
                                               "tokenizers huggingface_hub safetensors)")
    errors = spawn_world(pp).run(_llama_rank, TRAINING, timeout_s=300)
    for rank_errors in errors:
        assert set(rank_errors) == set(TRAINING)
        for name, err in rank_errors.items():
            assert err <= TOL, f"{name}: relative error {err:.2e}"
