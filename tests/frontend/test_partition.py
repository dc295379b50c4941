"""zbpipe.plan_partition: the search finds the best contiguous split x schedule that brute force
finds (and respects the budget), bad input fails with a ValueError naming the culprit, and a
plan run through split_by_fqn on two Gloo ranks trains with the single-process gradients, the
same plan on both ranks."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers.asserts import assert_close, assert_grads_close
from torch import nn

import zbpipe
from zbpipe import _C
from zbpipe.partition import UnitCost, _programs, _search, unit_profile
from zbpipe.train.model import Block, TinyConfig, lm_loss


def _units(n: int, seed: int) -> list[UnitCost]:
    """n units of random costs, the last one heavy (an LM head)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        scale = 4.0 if k == n - 1 else 1.0
        f, i, w = (scale * rng.uniform(0.5, 1.5) for _ in range(3))
        mem_f = rng.uniform(1e5, 2e5) * (3 if k == n - 1 else 1)
        out.append(UnitCost(f"u{k}", f, i, w, 0.9 * (i + w), mem_f, mem_f * rng.uniform(0.2, 0.6), 1e4, 4e4))
    return out


def _brute_force(units, programs, budget):
    """(least step, least max peak) over every split of every program, by zbpipe.simulate."""
    best, least_peak = float("inf"), float("inf")
    for prog in programs:
        for cuts in itertools.combinations(range(1, len(units)), prog.num_stages - 1):
            bounds = [0, *cuts, len(units)]
            groups = [units[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
            mem_f = [sum(u.mem_f for u in g) for g in groups]
            b = [sum(u.i for u in g) for g in groups]
            w = [sum(u.w for u in g) for g in groups]
            mem_w = [sum(u.mem_w for u in g) for g in groups]
            # the first stage's input needs no gradient: no I there, W does its whole backward
            w[0], b[0], mem_w[0] = w[0] + b[0], 0.0, mem_f[0]
            res = zbpipe.simulate(prog, f=[sum(u.f for u in g) for g in groups], b=b, w=w,
                                  b_full=[sum(u.b for u in g) for g in groups], mem_f=mem_f, mem_w=mem_w)
            peak = list(res.peak_memory)
            for s, g in enumerate(groups):
                peak[prog.stage_to_rank[s]] += sum(u.static_bytes for u in g)
            least_peak = min(least_peak, max(peak))
            if budget is None or max(peak) <= budget:
                best = min(best, res.makespan)
    return best, least_peak


@pytest.mark.parametrize("n,pp,m,seed", [(7, 2, 4, 0), (9, 3, 6, 1), (8, 2, 8, 2)])
def test_the_search_equals_brute_force(n, pp, m, seed):
    units = _units(n, seed)
    programs, _ = _programs(["1f1b", "zb_h1", "zbv", "interleaved_zb"], pp, m, n)
    best, least_peak = _brute_force(units, programs, None)
    plan = _search(units, programs, [], pp, m, None, 0.0, 50_000)
    assert plan.exact
    assert plan.predicted_step_s == pytest.approx(best, rel=1e-9)
    # The enumeration alone (no local search to give it a good incumbent) finds it too.
    alone = _C.plan_partition(programs, unit_profile(units), local_search_evals=0)
    assert alone.best.makespan == pytest.approx(best, rel=1e-9)
    # The plan's split, re-simulated through zbpipe.simulate, gives what the plan predicts.
    prog = plan.program()
    res = zbpipe.simulate(prog, **plan.stage_costs())
    assert res.makespan == pytest.approx(plan.predicted_step_s, rel=1e-9)
    # A budget between the least peak and the unconstrained plan's peak: brute force under it.
    budget = (least_peak + max(plan.peak_bytes)) / 2
    if budget > least_peak:
        limited, _ = _brute_force(units, programs, budget)
        under = _search(units, programs, [], pp, m, budget, 0.0, 50_000)
        assert max(under.peak_bytes) <= budget
        assert under.predicted_step_s == pytest.approx(limited, rel=1e-9)


def test_the_local_search_alone_stays_near_brute_force():
    """With enumeration off (exhaustive_limit=0) the min-max start and local search still land
    within 5% of brute force on a head-heavy chain."""
    units = _units(10, 3)
    programs, _ = _programs(["1f1b", "zb_h1", "zbv"], 2, 8, 10)
    best, _ = _brute_force(units, programs, None)
    plan = _search(units, programs, [], 2, 8, None, 0.0, 0)
    assert not plan.exact
    assert best <= plan.predicted_step_s <= best * 1.05


def test_a_budget_no_split_fits_names_the_smallest_peak():
    units = _units(6, 4)
    programs, _ = _programs(["1f1b", "zb_h1"], 2, 4, 6)
    _, least_peak = _brute_force(units, programs, None)
    with pytest.raises(ValueError, match="fits no split; the smallest peak found is") as e:
        _search(units, programs, [], 2, 4, least_peak * 0.99, 0.0, 50_000)
    assert f"{least_peak:.0f} bytes" in str(e.value)
    assert max(_search(units, programs, [], 2, 4, least_peak, 0.0, 50_000).peak_bytes) <= least_peak * (1 + 1e-9)


def test_a_unit_bigger_than_a_ranks_share_is_named_in_the_table():
    units = _units(6, 5)
    units[-1] = UnitCost("head", 30.0, 30.0, 30.0, 60.0, 1e5, 1e4, 1e4, 4e4)
    plan = _search(units, _programs(["1f1b"], 2, 4, 6)[0], [], 2, 4, None, 0.0, 50_000)
    assert plan.bounding_unit == "head"
    assert "unit 'head' bounds the step on its own" in plan.table()
    balanced = _search(_units(6, 5), _programs(["1f1b"], 2, 4, 6)[0], [], 2, 4, None, 0.0, 50_000)
    assert balanced.bounding_unit is None and "bounds the step" not in balanced.table()


# ---- measuring on a real model ---------------------------------------------------------------

CFG = TinyConfig(n_layers=4, vocab=512)


class _Lm(nn.Module):
    """torchtitan's layout: embedding, a list of blocks, norm, head; the forward skips what a
    stage lacks (a None child, the blocks the list no longer holds)."""

    def __init__(self, cfg=CFG):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, x):
        x = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers if self.layers is not None else []:
            x = layer(x)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


def build_model(cfg, seed):
    torch.manual_seed(seed)
    return _Lm(cfg)


def _batch(cfg=CFG, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(cfg.vocab, (b, cfg.seq_len), generator=g),
            torch.randint(cfg.vocab, (b, cfg.seq_len), generator=g))


def test_default_units_run_in_forward_order_and_measures_leave_the_model_alone():
    model = build_model(CFG, seed=0)
    x, y = _batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    plan = zbpipe.plan_partition(model, (x,), pp=2, microbatches=4, loss_fn=lm_loss, mb_target=y,
                                 schedules=["1f1b", "zb_h1"], measure_steps=1)
    assert [u.fqn for u in plan.units] == ["tok_embeddings", *[f"layers.{k}" for k in range(4)], "norm", "output"]
    assert [n for names in plan.module_fqns_per_stage for n in names] == [u.fqn for u in plan.units]
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    head = plan.units[-1]
    assert head.param_bytes == sum(p.numel() * 4 for p in model.output.parameters())
    assert head.static_bytes == 4 * head.param_bytes  # parameters, gradients, Adam's two states
    assert head.mem_f > 0 and 0 <= head.mem_w <= head.mem_f and head.f > 0 and head.i > 0 and head.w > 0


def test_the_plan_in_torchtitans_config_names_its_schedule_class():
    units = _units(8, 6)
    plan = _search(units, _programs(["zbv", "1f1b"], 2, 4, 8)[0], [], 2, 4, None, 0.0, 50_000)
    cfg = plan.torchtitan_config()
    assert cfg["module_fqns_per_model_part"] == plan.module_fqns_per_stage
    assert cfg["pipeline_parallel_degree"] == 2
    assert zbpipe.get_schedule_class(cfg["pipeline_parallel_schedule"]) is zbpipe.get_schedule_class(plan.schedule)


class _NoSkip(nn.Module):
    """A forward that calls every child: it cannot run with units removed."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


@pytest.mark.parametrize("units,pp,match", [
    (["emb", "body"], 2, "parameter 'head.weight' is in no unit"),
    (["emb", "body", "head", "body"], 2, "names 'body' twice"),
    (["emb", "body", "head.weight"], 2, "unit 'head.weight' is not a splittable module \\(it is a parameter\\)"),
    (["emb", "body", "tail"], 2, "unit 'tail' is not a splittable module"),
    (["emb", "body", "head"], 4, "pp=4 is larger than the number of units \\(3"),
])
def test_bad_units_and_pp_name_the_culprit(units, pp, match):
    with pytest.raises(ValueError, match=match):
        zbpipe.plan_partition(_NoSkip(), (torch.randn(2, 4),), pp=pp, microbatches=2, units=units,
                              loss_fn=lambda o, t: o.sum())


def test_a_unit_inside_another_is_named():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unit '0.0' is inside unit '0'"):
        zbpipe.plan_partition(model, (torch.randn(2, 2),), pp=1, microbatches=1, units=["0", "0.0", "1"],
                              loss_fn=lambda o, t: o.sum())


def test_zbpipe_train_trains_the_planned_split(capsys):
    from zbpipe.train.main import main

    rc = main(["--pp", "2", "--schedule", "zb_h1", "--partition", "auto", "--steps", "2", "--layers", "4",
               "--batch-size", "8", "--microbatches", "2", "--timeout", "120"])
    out = capsys.readouterr().out
    assert rc == 0 and "MATCH" in out
    assert "plan_partition: pp=2, 2 microbatches, 4 units" in out and "schedule zb_h1" in out


def test_units_kept_together_are_one_unit():
    plan = zbpipe.plan_partition(_NoSkip(), (torch.randn(2, 4),), pp=1, microbatches=2,
                                 units=[["emb", "body", "head"]], loss_fn=lambda o, t: o.sum(), measure_steps=1)
    assert plan.module_fqns_per_stage == [["emb", "body", "head"]] and plan.units[0].fqn == "emb+body+head"


def test_a_forward_that_needs_every_unit_is_named():
    with pytest.raises(ValueError, match="does not tolerate removed units: with only unit 'emb' kept.*"
                                         "skip a None child, loop over what a list holds"):
        zbpipe.plan_partition(_NoSkip(), (torch.randn(2, 4),), pp=2, microbatches=2, loss_fn=lambda o, t: o.sum())


# ---- two ranks: same plan, exact gradients ----------------------------------------------------

def _plan_and_train(rank, size):
    torch.manual_seed(0)
    model = build_model(CFG, seed=0)
    x, y = _batch(b=4)
    plan = zbpipe.plan_partition(model, (x[:1],), pp=size, microbatches=4, loss_fn=lm_loss, mb_target=y[:1],
                                 schedules=["1f1b", "zb_h1", "zbv"], measure_steps=1)
    modules = zbpipe.split_by_fqn(model, plan.module_fqns_per_stage)
    program = plan.program()
    mine = [s for s, r in enumerate(program.stage_to_rank) if r == rank]
    stages = [zbpipe.PipelineStage(modules[s], s, program.num_stages, torch.device("cpu")) for s in mine]
    sched = zbpipe.PipelineSchedule.from_program(stages, program, lm_loss)
    losses = []
    sched.step(x, target=y, losses=losses)
    ref = build_model(CFG, seed=0)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for s in mine:
        assert_grads_close({n: p for n, p in modules[s].named_parameters()},
                           {n: ref_params[n] for n, _ in modules[s].named_parameters()}, f"stage {s}")
    if program.stage_to_rank[-1] == rank:
        assert_close(torch.stack(losses).mean(), ref_loss.detach())
    try:
        zbpipe.plan_partition(_NoSkip(), (torch.randn(2, 4),), pp=size, microbatches=2, loss_fn=lambda o, t: o.sum())
        refused = ""
    except ValueError as e:
        refused = str(e)
    return plan.module_fqns_per_stage, plan.schedule, plan.predicted_step_s, refused


def test_two_ranks_reach_one_plan_and_train_exactly(spawn_world):
    (a_split, a_sched, a_step, a_err), (b_split, b_sched, b_step, b_err) = spawn_world(2).run(
        _plan_and_train, timeout_s=180)
    assert (a_split, a_sched, a_step) == (b_split, b_sched, b_step)
    assert "with only unit 'emb' kept" in a_err and "with only unit 'emb' kept" in b_err


# ---- a transformers LlamaForCausalLM --------------------------------------------------------

class _Llama(nn.Module):
    """A LlamaForCausalLM's own modules under a forward that skips what a stage lacks (its rotary
    embedding, which has no parameters, runs on every stage, held outside the module tree)."""

    def __init__(self, hf):
        super().__init__()
        self.embed_tokens, self.layers, self.norm, self.lm_head = (hf.model.embed_tokens, hf.model.layers,
                                                                   hf.model.norm, hf.lm_head)
        self._rotary = [hf.model.rotary_emb]

    def forward(self, x):
        x = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        pe = self._rotary[0](x, position_ids=pos)
        for layer in self.layers if self.layers is not None else []:
            x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
        x = self.norm(x) if self.norm is not None else x
        return self.lm_head(x) if self.lm_head is not None else x


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                        attn_implementation="sdpa", tie_word_embeddings=False))


def _llama_rank(rank, size):
    hf = _hf_llama()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(2000, (4, 16), generator=g), torch.randint(2000, (4, 16), generator=g)
    model = _Llama(hf)
    plan = zbpipe.plan_partition(model, (x[:1],), pp=size, microbatches=4, loss_fn=lm_loss, mb_target=y[:1],
                                 schedules=["1f1b", "zb_h1"], measure_steps=1)
    modules = zbpipe.split_by_fqn(model, plan.module_fqns_per_stage)
    program = plan.program()
    mine = [s for s, r in enumerate(program.stage_to_rank) if r == rank]
    stages = [zbpipe.PipelineStage(modules[s], s, program.num_stages, torch.device("cpu")) for s in mine]
    losses = []
    zbpipe.PipelineSchedule.from_program(stages, program, lm_loss).step(x, target=y, losses=losses)
    ref = _hf_llama()
    ref_loss = lm_loss(ref(x).logits, y)
    ref_loss.backward()
    theirs = dict(ref.named_parameters())
    for s in mine:  # the HF model's names: model.<name> for all but lm_head
        named = dict(modules[s].named_parameters())
        assert_grads_close(named, {n: theirs[n if n.startswith("lm_head") else f"model.{n}"] for n in named},
                           f"stage {s}")
    if program.stage_to_rank[-1] == rank:
        assert_close(torch.stack(losses).mean(), ref_loss.detach())
    return [u.fqn for u in plan.units], plan.module_fqns_per_stage


def test_a_transformers_llama_plan_trains_like_one_process(spawn_world):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install --no-deps transformers "
                                               "tokenizers huggingface_hub safetensors)")
    (units, a), (_, b) = spawn_world(2).run(_llama_rank, timeout_s=240)
    assert a == b
    assert units == ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"]
