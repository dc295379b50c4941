"""zbpipe.split_by_fqn: stage modules that keep the whole model's parameter names, run the
model's forward in pieces (their chain equals the whole model), and refuse splits that would
lose or duplicate a parameter."""

from __future__ import annotations

import pytest
import torch
from helpers.asserts import assert_close
from torch import nn

import zbpipe
from zbpipe.module_split import SparseModuleList
from zbpipe.train.model import TinyConfig, build_model, stage_module_names


def _chain(stages, x):
    for s in stages:
        x = s(x)
    return x


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
def test_stages_keep_the_names_and_chain_to_the_whole_model(num_stages):
    cfg = TinyConfig(n_layers=5)
    model = build_model(cfg, seed=0)
    stages = zbpipe.split_by_fqn(model, stage_module_names(cfg, num_stages))
    whole = dict(model.named_parameters())
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    # Every parameter in exactly one stage, under its own name and with its own value.
    assert sorted(n for ns in names for n in ns) == sorted(whole)
    for s in stages:
        for n, p in s.named_parameters():
            assert torch.equal(p, whole[n]) and p is not whole[n], n  # a copy, not shared
    # The blocks keep their indices: the last stage's first block is not renumbered to 0.
    if num_stages > 1:
        assert not any(n.startswith("blocks.0.") for n in names[-1])
    x = torch.randint(cfg.vocab, (2, cfg.seq_len))
    assert_close(_chain(stages, x), model(x))


def test_state_dicts_load_across_splits():
    """A state saved by the stages of one split loads into the stages of another (what a
    checkpoint at another pipeline size needs), and the model does not change."""
    cfg = TinyConfig(n_layers=4)
    trained = zbpipe.split_by_fqn(build_model(cfg, seed=1), stage_module_names(cfg, 2))
    state = {k: v for s in trained for k, v in s.state_dict().items()}
    fresh = zbpipe.split_by_fqn(build_model(cfg, seed=2), stage_module_names(cfg, 4))
    for s in fresh:
        missing, _ = s.load_state_dict(state, strict=False)
        assert not missing
    x = torch.randint(cfg.vocab, (2, cfg.seq_len))
    assert_close(_chain(fresh, x), _chain(trained, x))


def test_sequential_and_dict_entries_keep_their_names():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)}))
    first, second = zbpipe.split_by_fqn(model, [["0", "1", "2.a"], ["2.b"]])
    assert [n for n, _ in first.named_parameters()] == ["0.weight", "0.bias", "2.a.weight", "2.a.bias"]
    assert [n for n, _ in second.named_parameters()] == ["2.b.weight", "2.b.bias"]
    assert list(second._modules) == ["2"]  # the Sequential runs what it holds


def test_a_sparse_list_iterates_its_entries_and_refuses_appends():
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    _, stage = zbpipe.split_by_fqn(model, [["layers.0", "layers.1"], ["layers.2", "layers.3"]])
    assert isinstance(stage.layers, SparseModuleList)
    assert len(stage.layers) == 2 and list(stage.layers) == [stage.layers[0], stage.layers[-1]]
    assert stage.layers[-1] is stage.layers._modules["3"] and len(stage.layers[1:]) == 1
    assert [n for n, _ in stage.named_parameters()][0] == "layers.2.weight"
    with pytest.raises(TypeError, match="original indices of a split model"):
        stage.layers.append(nn.Linear(2, 2))


@pytest.mark.parametrize("names,message", [
    ([["tok_emb", "blocks"], ["ln_f", "head"]], "parameter 'pos_emb.weight' would be in no stage"),
    ([["tok_emb", "pos_emb", "blocks"], ["blocks.1", "ln_f", "head"]], "'blocks.1.ln1.weight' is in stages [0, 1]"),
    ([["tok_emb", "pos_emb", "blocks", "ln_f"], ["head", "ln_f"]], "'ln_f' is in stages 0 and 1"),
    ([["tok_emb", "pos_emb", "blocks", "ln_f", "head", "lm_head"]], "names 'lm_head', which is not a submodule"),
    ([], "empty"),
])
def test_bad_splits_name_the_culprit(names, message):
    with pytest.raises(ValueError, match="split_by_fqn: .*" + "".join("\\" + c if c in "[]()." else c for c in message)):
        zbpipe.split_by_fqn(build_model(TinyConfig(n_layers=2), seed=0), names)


def test_a_parameter_on_a_split_module_is_refused():
    model = nn.Module()
    model.scale = nn.Parameter(torch.ones(1))
    model.a, model.b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'scale' would be in no stage: it sits directly on a module that is split"):
        zbpipe.split_by_fqn(model, [["a"], ["b"]])
