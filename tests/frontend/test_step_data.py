"""StepData.build (zbpipe/step_data.py): a step's data from what step() / eval() were given, in
process, with no world: whole batches split into microbatches, pre-split microbatches taken as
given, the two forms refused together, a missing target refused, and each rank keeping only the
parts its stages use. Also input_signature, under which the ranks negotiate shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zbpipe import microbatch
from zbpipe.step_data import StepData, autocast_state, input_signature, tensor_layout

N = 2


def _build(**kw) -> StepData:
    base = dict(train=True, has_first=True, has_last=True, loss_fn=F.mse_loss)
    return StepData.build(N, **{**base, **kw})


def _same_tensors(got: list, want: list) -> bool:
    return len(got) == len(want) and all(g is w for g, w in zip(got, want))


# ---- whole batches ------------------------------------------------------------------------

def test_whole_batches_split_along_dim_0_into_n_microbatches():
    x, mask, y = torch.randn(4, 3), torch.ones(4, 1), torch.randn(4, 3)
    step = _build(args=(x, "tag"), kwargs={"mask": mask, "scale": 2.0}, target=y,
                  loss_kwargs={"reduction": "sum"}, keep_outputs=False)
    assert [len(a) for a in step.args] == [2, 2] and [a[1] for a in step.args] == ["tag", "tag"]
    torch.testing.assert_close(torch.cat([a[0] for a in step.args]), x)
    assert [a[0].shape for a in step.args] == [(2, 3), (2, 3)]
    torch.testing.assert_close(torch.cat([k["mask"] for k in step.kwargs]), mask)
    assert [k["scale"] for k in step.kwargs] == [2.0, 2.0]
    torch.testing.assert_close(torch.cat(step.targets), y)
    assert step.loss_fn is F.mse_loss and step.loss_kwargs == {"reduction": "sum"}
    assert step.train and not step.keep_outputs and step.weight_work == {} and step.memory_probe is None
    assert step.microbatch_kwargs(1)["scale"] == 2.0


def test_a_batch_that_does_not_split_names_what_and_the_count():
    with pytest.raises(ValueError, match=r"^zbpipe: argument\[0\] has batch size 5, which is not divisible "
                                         r"by n_microbatches=2$"):
        _build(args=(torch.randn(5, 3),), target=torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"^zbpipe: target has batch size 3, "):
        _build(args=(torch.randn(4, 3),), target=torch.randn(3, 3))


def test_a_batch_of_no_rows_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^zbpipe: argument\[0\] has 0 rows \(shape \(0, 3\)\): a step needs at "
                                         r"least n_microbatches=2 of them"):
        _build(args=(torch.randn(0, 3),), target=torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"is a 0-d tensor, which cannot be split"):
        _build(args=(torch.tensor(1.0),), target=torch.randn(4, 3))


# ---- torch's chunk specs --------------------------------------------------------------------

def test_chunk_specs_split_along_their_dim_and_replicate():
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    x, mask, y = torch.randn(3, 4), torch.randn(5), torch.randn(4, 3)
    nested = (torch.randn(2, 4), torch.randn(4, 2))
    specs = microbatch.ChunkSpecs(args=(TensorChunkSpec(1), (TensorChunkSpec(1), TensorChunkSpec(0))),
                                  kwargs={"mask": _Replicate, "scale": _Replicate()})
    step = _build(args=(x, nested), kwargs={"mask": mask, "scale": 2.0}, target=y, chunk_specs=specs)
    torch.testing.assert_close(torch.cat([a[0] for a in step.args], dim=1), x)
    assert [a[0].shape for a in step.args] == [(3, 2), (3, 2)]
    assert [a[1][0].shape for a in step.args] == [(2, 2), (2, 2)] and [a[1][1].shape for a in step.args] == [(2, 2)] * 2
    assert all(k["mask"] is mask and k["scale"] == 2.0 for k in step.kwargs)
    assert [t.shape for t in step.targets] == [(2, 3), (2, 3)]  # targets along dim 0, as torch's
    with pytest.raises(ValueError, match=r"argument\[0\] has batch size 3 along dim 1, which is not divisible"):
        _build(args=(torch.randn(4, 3),), target=y, chunk_specs=microbatch.ChunkSpecs(args=(TensorChunkSpec(1),)))


def test_chunk_specs_that_do_not_fit_are_named():
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    cases = [
        (dict(args=(TensorChunkSpec(0), TensorChunkSpec(0))), {}, r"args_chunk_spec has 2 spec\(s\) for 1 positional"),
        (dict(kwargs={"other": TensorChunkSpec(0)}), {"mask": x}, r"kwargs_chunk_spec names \['other'\]"),
        (dict(args=(TensorChunkSpec(2),)), {}, r"argument\[0\] has 2 dimension\(s\); its chunk spec splits dim 2"),
        (dict(args=((TensorChunkSpec(0),),)), {}, "a tensor takes TensorChunkSpec\\(dim\\) or _Replicate"),
    ]
    for spec, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            _build(args=(x,), kwargs=kwargs, target=y, chunk_specs=microbatch.ChunkSpecs(**spec))
    with pytest.raises(TypeError, match="args_chunk_spec must be a tuple"):
        microbatch.ChunkSpecs(args=TensorChunkSpec(0))


def test_merge_specs_concatenate_reduce_or_keep():
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate, sum_reducer

    chunks = [{"y": torch.full((2, 1), float(i)), "n": torch.tensor(2.0), "tag": "a"} for i in range(3)]
    out = microbatch.merge(chunks, {"y": TensorChunkSpec(1), "n": sum_reducer, "tag": _Replicate})
    torch.testing.assert_close(out["y"], torch.tensor([[0.0, 1.0, 2.0]] * 2))
    torch.testing.assert_close(out["n"], torch.tensor(6.0))
    assert out["tag"] == "a"
    with pytest.raises(ValueError, match="microbatch 1's differs from microbatch 0's"):
        microbatch.merge([{"t": "a"}, {"t": "b"}], {"t": _Replicate})
    # Without a spec: dim 0, 0-d tensors stacked, other values as the list of chunks.
    out = microbatch.merge([(torch.ones(1, 2), torch.tensor(1.0), "x")] * 2)
    assert out[0].shape == (2, 2) and out[1].shape == (2,) and out[2] == ["x", "x"]


def test_no_keyword_arguments_leave_kwargs_none():
    step = _build(args=(torch.randn(4, 3),), target=torch.randn(4, 3))
    assert step.kwargs is None and step.microbatch_kwargs(0) == {}


# ---- pre-split microbatches ---------------------------------------------------------------

def test_presplit_microbatches_run_as_given_and_are_not_split_again():
    xs, ys = [torch.randn(3, 3), torch.randn(5, 3)], [torch.randn(3, 3), torch.randn(5, 3)]
    step = _build(arg_mbs=[[xs[0]], (xs[1],)], kwarg_mbs=[{"k": 1}, {"k": 2}], target_mbs=ys)
    assert step.args == [(xs[0],), (xs[1],)] and all(type(a) is tuple for a in step.args)
    assert step.kwargs == [{"k": 1}, {"k": 2}]
    assert _same_tensors(step.targets, ys) and step.loss_fn is F.mse_loss


def test_presplit_without_arguments_gives_the_first_stage_empty_calls_and_no_kwargs():
    step = _build(kwarg_mbs=[{}, {}], target_mbs=[torch.zeros(1), torch.zeros(1)])
    assert step.args == [(), ()] and step.kwargs is None


def test_an_empty_list_selects_the_presplit_form():
    with pytest.raises(ValueError, match=r"^Expecting 2 arg_mbs but got 0$"):
        _build(arg_mbs=[])


def test_presplit_lists_are_checked_in_order_as_torch_checks_them():
    ok = [(torch.zeros(1),), (torch.zeros(1),)]
    with pytest.raises(TypeError, match=r"^arg_mbs must be a list but got a <class 'tuple'>$"):
        _build(arg_mbs=tuple(ok), target_mbs=[1])
    with pytest.raises(TypeError, match=r"^kwarg_mbs\[1\] must be a dict but got a <class 'list'>$"):
        _build(arg_mbs=ok, kwarg_mbs=[{}, []], target_mbs=[1])
    with pytest.raises(ValueError, match=r"^Expecting 2 target_mbs but got 1$"):
        _build(arg_mbs=ok, target_mbs=[1])


# ---- mixed forms, missing target ----------------------------------------------------------

@pytest.mark.parametrize("whole, got", [
    (dict(args=(torch.zeros(2),)), "1 positional argument(s), keyword argument(s) [], target None"),
    (dict(kwargs={"b": 1, "a": 2}), "0 positional argument(s), keyword argument(s) ['a', 'b'], target None"),
    (dict(target=torch.zeros(2)), "0 positional argument(s), keyword argument(s) [], target given"),
])
def test_mixed_forms_are_refused_naming_what_was_given(whole, got):
    with pytest.raises(ValueError) as info:
        _build(target_mbs=[torch.zeros(1)] * N, **whole)
    assert str(info.value) == ("zbpipe: pre-split arg_mbs / kwarg_mbs / target_mbs cannot be mixed with "
                               f"whole-batch inputs (got {got})")


@pytest.mark.parametrize("form", ["whole", "presplit"])
def test_a_training_step_without_target_is_refused_where_the_loss_runs(form):
    inputs = dict(args=(torch.randn(4, 3),)) if form == "whole" else dict(arg_mbs=[(torch.randn(2, 3),)] * N)
    with pytest.raises(ValueError) as info:
        _build(**inputs)
    assert str(info.value) == "zbpipe: the last stage needs target= (or target_mbs=) when a loss_fn is set"
    assert _build(has_last=False, **inputs).targets is None  # no loss on this rank: nothing needed
    assert _build(loss_fn=None, **inputs).targets is None    # no loss_fn: nothing needed


def test_an_eval_step_without_target_runs_without_loss():
    step = _build(train=False, args=(torch.randn(4, 3),))
    assert step.targets is None and step.loss_fn is None and not step.train


def test_without_a_loss_fn_targets_are_dropped():
    step = _build(loss_fn=None, args=(torch.randn(4, 3),), target=torch.randn(4, 3))
    assert step.targets is None and step.loss_fn is None


# ---- per-rank parts -----------------------------------------------------------------------

@pytest.mark.parametrize("form", ["whole", "presplit"])
@pytest.mark.parametrize("first, last", [(True, False), (False, False), (False, True)])
def test_each_rank_keeps_only_the_parts_its_stages_use(form, first, last):
    if form == "whole":
        inputs = dict(args=(torch.randn(4, 3),), kwargs={"m": torch.ones(4)}, target=torch.randn(4, 3))
    else:
        inputs = dict(arg_mbs=[(torch.randn(2, 3),)] * N, kwarg_mbs=[{"m": torch.ones(2)}] * N,
                      target_mbs=[torch.randn(2, 3)] * N)
    step = _build(has_first=first, has_last=last, **inputs)
    assert (step.args is not None) == first and (step.targets is not None) == last
    assert (step.loss_fn is not None) == last
    assert [k["m"].shape for k in step.kwargs] == [(2,), (2,)]  # keyword arguments reach every stage


def test_a_rank_without_the_first_stage_does_not_split_its_arguments():
    step = _build(has_first=False, args=(torch.randn(5, 3),), target=torch.randn(4, 3))
    assert step.args is None and len(step.targets) == N


# ---- input signature ----------------------------------------------------------------------

def test_input_signature_names_microbatch_0s_tensors_and_their_layout():
    x, m = torch.randn(4, 3), torch.ones(4, 2, dtype=torch.long)
    step = _build(args=(x, 7), kwargs={"z": m, "a": [m, "s"]}, target=torch.randn(4, 3))
    specs, layout = input_signature(step)
    assert specs == [((2, 3), torch.float32), ((2, 2), torch.int64), ((2, 2), torch.int64)]
    assert layout == "((T,.),{'a':(T,.),'z':T})"


def test_tensor_layout_collects_the_tensors_in_order():
    a, b = torch.zeros(1), torch.ones(2)
    out: list = []
    assert tensor_layout({"y": (a, None), "x": [b]}, out) == "{'x':(T),'y':(T,.)}"
    assert out[0] is b and out[1] is a


def test_input_signature_names_the_autocast_state():
    """A step under autocast has another signature than one without it, or under another
    dtype (the ranks negotiate its shapes anew); the state of the stages' device type and the
    CPU's."""
    step = _build(args=(torch.randn(4, 3),), target=torch.randn(4, 3))
    plain = input_signature(step)
    assert autocast_state("cpu") == "" and plain[1] == "((T),{})"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = input_signature(step)
        assert autocast_state("cuda") == " autocast(cpu=bfloat16)"
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = input_signature(step)
    assert bf16[1] == "((T),{}) autocast(cpu=bfloat16)" and fp16[1] == "((T),{}) autocast(cpu=float16)"
    assert plain[0] == bf16[0] == fp16[0]
