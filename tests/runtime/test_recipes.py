"""The recipes real trainers use (issue 44), each on 2 Gloo ranks against one process under the
same recipe, over 1F1B, ZBV and interleaved zero bubble (DualPipeV too where the RNG is
concerned). docs/runtime.md#recipes lists them with these tests.

- autocast (bf16, fp16) around step() and eval(); autocast inside a stage's own forward;
  autocast changing between steps (a new signature, negotiated; static_shapes names dtypes);
  fp16 with GradScaler (scaled losses, gradients, the inf checks and the optimizer steps);
- devices as users name them (cpu, cpu:0, cpu:<LOCAL_RANK>, torch.device objects);
- shape inference with no side effects: Dropout, torch.rand and BatchNorm in stages that fake
  tensors can run and in stages they cannot (a real run), against per-rank RNG replay
  (tests/helpers/rng_replay.py), buffers and each rank's generator state after two steps;
- lazy modules, materialized at their first real forward;
- a loss that cannot give gradients fails every rank naming the microbatch; a frozen model runs;
- torch's chunk specs (a batch on dim 1, a replicated keyword argument, merge specs with a
  reducer); a batch of 0 rows.

Low-precision results compare at LOWP_RTOL/ATOL (2e-2), fp32 ones at the suite's tolerance.
One spawned world of 2 ranks for the file; the failure cases run on fresh groups.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.asserts import assert_close, assert_grads_close
from helpers.model_registry import WIDTH, MLPStage
from helpers.rng_replay import replay_step, seeded_states
from helpers.schedule_registry import rank_schedule

import zbpipe

PP, M, ROWS = 2, 4, 3  # ranks, microbatches, rows per microbatch
SPLIT = ["1f1b", "zbv", "interleaved_zb"]
SEED = 1234
LOWP = (torch.bfloat16, torch.float16)


# ---- models ----------------------------------------------------------------------------------

class AutocastInside(nn.Module):
    """A stage that runs its Linear under its own torch.autocast (bf16) and returns bf16."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.tanh(self.lin(x))


class NoisyStage(nn.Module):
    """Linear, Dropout, a torch.rand draw and BatchNorm. data_dependent: also a scale read
    from the data with .item(), which fake tensors cannot run (shape inference then runs
    the stage for real)."""

    def __init__(self, data_dependent: bool):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.data_dependent = data_dependent

    def forward(self, x):
        h = self.drop(torch.tanh(self.lin(x))) + 0.1 * torch.rand_like(x)
        if self.data_dependent:
            h = h / max(1.0, x.detach().abs().max().item())
        return self.bn(h)


class LazyStage(nn.Module):
    """nn.LazyLinear (its in_features found at the first forward), then Dropout."""

    def __init__(self):
        super().__init__()
        self.lin = nn.LazyLinear(WIDTH)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(torch.tanh(self.lin(x)))


class SpecStage(nn.Module):
    """Takes the batch on dim 1 ([WIDTH, rows]) where first, returns [rows, WIDTH] between
    stages and, where last, {"y": [WIDTH, rows], "rows": a 0-d count}; a replicated mask
    reaches every stage as a keyword argument."""

    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.first, self.last = first, last

    def forward(self, x, mask):
        h = torch.tanh(self.lin(x.t() if self.first else x)) * mask
        return {"y": h.t(), "rows": torch.tensor(float(h.shape[0]))} if self.last else h


def spec_loss(out, y):
    return F.mse_loss(out["y"].t(), y)


# ---- helpers ---------------------------------------------------------------------------------

def _build(name, make, rank, *, group=None, **schedule_kwargs):
    """Every stage's module, made by make(stage) from one seed on every rank, a deep copy for
    the reference, this rank's schedule over them and its stage indices."""
    num_stages = zbpipe.compile(name, PP, M).num_stages
    torch.manual_seed(0)
    mods = [make(s, num_stages) for s in range(num_stages)]
    ref = copy.deepcopy(mods)
    sched, mine = rank_schedule(name, mods, rank, PP, M, group=group, timeout=30, **schedule_kwargs)
    return mods, ref, sched, mine


def _step(sched, mine, num_stages, x, y, call="step", **kwargs):
    losses = []
    out = getattr(sched, call)(*((x,) if 0 in mine else ()), target=y if num_stages - 1 in mine else None,
                               losses=losses, **kwargs)
    return out, losses


def _one_process(ref, x, y, loss_fn=F.mse_loss, autocast=None, train=True, **kwargs):
    """The whole model over the microbatches in order: the forward and the loss under
    `autocast` (a dtype) where given, each loss's backward outside it, scaled by 1/M (torch's
    recipe). Returns the losses and the merged output."""
    losses, outs = [], []
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            h = xm
            for m in ref:
                h = m(h, **kwargs)
            loss = loss_fn(h, ym)
        if train:
            (loss / M).backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    return losses, torch.cat(outs)


def _data(seed=5, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M * rows, WIDTH, generator=g), torch.randn(M * rows, WIDTH, generator=g)


def _compare(name, mods, ref, mine, losses, want, low_precision=False):
    if len(mods) - 1 in mine:
        assert_close(losses, want, msg=lambda m: f"{name} losses: {m}", low_precision=low_precision)
    assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine], msg=name, low_precision=low_precision)


def _fresh_group():
    import torch.distributed as dist

    return dist.new_group(list(range(PP)), backend="gloo")


def _failure(sched, mine, num_stages, x, y, **kwargs) -> str:
    try:
        _step(sched, mine, num_stages, x, y, **kwargs)
    except Exception as e:  # noqa: BLE001 - the message is the point
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---- autocast --------------------------------------------------------------------------------

def case_autocast_around_step(rank, world):
    """step() and eval() under torch.autocast("cpu", bf16 / fp16): the stages' messages carry
    the autocast dtype, the losses, gradients and outputs are one process's."""
    x, y = _data()
    for name in SPLIT:
        for dtype in LOWP:
            tag = f"{name} {dtype}"
            mods, ref, sched, mine = _build(name, lambda s, n: MLPStage(), rank, loss_fn=F.mse_loss)
            with torch.autocast("cpu", dtype=dtype):
                _, losses = _step(sched, mine, len(mods), x, y)
            want, _ = _one_process(ref, x, y, autocast=dtype)
            _compare(tag, mods, ref, mine, losses, want, low_precision=True)
            for s in mine:
                if s != len(mods) - 1:
                    assert sched.output_specs(s) == [((ROWS, WIDTH), dtype)], (tag, sched.output_specs(s))
            with torch.autocast("cpu", dtype=dtype):
                out, _ = _step(sched, mine, len(mods), x, y, call="eval")
            with torch.no_grad():
                _, want_out = _one_process(ref, x, y, autocast=dtype, train=False)
            if len(mods) - 1 in mine:
                assert out.dtype == dtype, (tag, out.dtype)
                assert_close(out, want_out, msg=lambda m, tag=tag: f"{tag} eval: {m}", low_precision=True)


def case_autocast_inside_the_stage(rank, world):
    """Each stage's module enters autocast itself: bf16 crosses the stage boundaries."""
    x, y = _data()

    def loss_fn(out, target):
        return F.mse_loss(out.float(), target)

    for name in SPLIT:
        mods, ref, sched, mine = _build(name, lambda s, n: AutocastInside(), rank, loss_fn=loss_fn)
        _, losses = _step(sched, mine, len(mods), x, y)
        want, _ = _one_process(ref, x, y, loss_fn=loss_fn)
        _compare(f"{name} autocast inside", mods, ref, mine, losses, want, low_precision=True)


def case_autocast_changes_between_steps(rank, world):
    """fp32, bf16, fp32 again: each step negotiates under its own autocast state (two
    handshakes) and equals one process; with static_shapes=True the bf16 step fails on every
    rank naming the dtypes."""
    x, y = _data()
    mods, ref, sched, mine = _build("1f1b", lambda s, n: MLPStage(), rank, loss_fn=F.mse_loss)
    for k, dtype in enumerate([None, torch.bfloat16, None]):
        for m in mods + ref:
            m.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            _, losses = _step(sched, mine, len(mods), x, y)
        want, _ = _one_process(ref, x, y, autocast=dtype)
        _compare(f"step {k} under {dtype}", mods, ref, mine, losses, want, low_precision=dtype is not None)
    handshakes = sched._runner.last.handshakes

    mods, ref, sched, mine = _build("1f1b", lambda s, n: MLPStage(), rank, group=_fresh_group(),
                                    loss_fn=F.mse_loss, static_shapes=True)
    _step(sched, mine, len(mods), x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return handshakes, _failure(sched, mine, len(mods), x, y)


def case_grad_scaler(rank, world):
    """fp16 autocast with torch.amp.GradScaler("cpu") scaling the loss in loss_fn: the scaled
    losses, the unscaled gradients, each rank's inf check (the scale after update) and the
    optimizer step equal one process's scaler over the same parameters; at an init_scale that
    overflows fp16 every rank finds the inf and skips its step."""
    x, y = _data()
    for name in SPLIT:
        for init_scale, overflows in [(2.0**8, False), (2.0**24, True)]:
            tag = f"{name} init_scale={init_scale}"
            scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
            mods, ref, sched, mine = _build(name, lambda s, n: MLPStage(), rank,
                                            loss_fn=lambda out, t: scaler.scale(F.mse_loss(out, t)))
            scaler.scale(torch.ones(()))  # GradScaler makes its scale at its first scale() call
            with torch.autocast("cpu", dtype=torch.float16):
                _, losses = _step(sched, mine, len(mods), x, y)
            ref_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
            want, _ = _one_process(ref, x, y, loss_fn=lambda out, t: ref_scaler.scale(F.mse_loss(out, t)),
                                   autocast=torch.float16)
            before = [p.detach().clone() for s in mine for p in mods[s].parameters()]
            for sc, ms in [(scaler, mods), (ref_scaler, ref)]:
                opt = torch.optim.SGD([p for s in mine for p in ms[s].parameters()], lr=0.1)
                sc.step(opt)  # unscales the gradients, checks them for inf, steps unless found
                sc.update()
            assert scaler.get_scale() == ref_scaler.get_scale(), (tag, scaler.get_scale(), ref_scaler.get_scale())
            assert (scaler.get_scale() < init_scale) == overflows, (tag, scaler.get_scale())
            after = [p.detach() for s in mine for p in mods[s].parameters()]
            if overflows:
                assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{tag}: stepped despite inf"
                continue
            _compare(tag, mods, ref, mine, losses, want, low_precision=True)
            assert_close(after, [p.detach() for s in mine for p in ref[s].parameters()], low_precision=True,
                         msg=lambda m, tag=tag: f"{tag} parameters after the step: {m}")


# ---- devices ---------------------------------------------------------------------------------

def case_device_forms(rank, world):
    """A stage on each form a user names a CPU device with; the local rank's form (torchtitan:
    torch.device(f"cpu:{LOCAL_RANK}")) on a V schedule too. Returns each stage's device."""
    x, y = _data()
    got = []
    forms = ["cpu", "cpu:0", f"cpu:{rank}", torch.device("cpu"), torch.device("cpu", 0), torch.device("cpu", rank)]
    for name, device in [("1f1b", d) for d in forms] + [("zbv", torch.device("cpu", rank))]:
        mods, ref, sched, mine = _build(name, lambda s, n: MLPStage(), rank, loss_fn=F.mse_loss,
                                        device=device)
        _, losses = _step(sched, mine, len(mods), x, y)
        want, _ = _one_process(ref, x, y)
        _compare(f"{name} on {device!r}", mods, ref, mine, losses, want)
        got += [str(s.device) for s in sched._stages]
    return got


# ---- shape inference without side effects -----------------------------------------------------

def case_rng_and_buffers(rank, world):
    """Dropout, torch.rand and BatchNorm, two steps (the second with another batch size, so
    shape inference runs again mid-training), against per-rank RNG replay: losses,
    gradients, BatchNorm's buffers and this rank's generator state after the steps."""
    for name in SPLIT + ["dualpipev"]:
        for data_dependent in (True, False):
            tag = f"{name} data_dependent={data_dependent}"
            mods, ref, sched, mine = _build(name, lambda s, n: NoisyStage(data_dependent), rank,
                                            loss_fn=F.mse_loss)
            program = sched.program
            states = seeded_states(SEED, PP)
            torch.manual_seed(SEED)
            for k, rows in enumerate([ROWS, ROWS + 1]):
                x, y = _data(seed=k, rows=rows)
                _, losses = _step(sched, mine, len(mods), x, y)
                want = replay_step(ref, program, [(c,) for c in x.chunk(M)], list(y.chunk(M)), F.mse_loss,
                                   states, 1.0 / M)
                _compare(f"{tag} step {k}", mods, ref, mine, losses, want)
            for s in mine:
                for (n, b), (_, rb) in zip(mods[s].named_buffers(), ref[s].named_buffers()):
                    assert_close(b, rb, msg=lambda m, n=n, s=s: f"{tag} stage {s} buffer {n}: {m}")
            assert torch.equal(torch.get_rng_state(), states[rank]), f"{tag}: the generator drew another amount"


def case_lazy_modules(rank, world):
    """nn.LazyLinear stages materialize at their first real forward, drawing their initial
    values where one process's first forward does (per-rank replay): the same parameters,
    losses and gradients."""
    x, y = _data()
    for name in SPLIT:
        mods, ref, sched, mine = _build(name, lambda s, n: LazyStage(), rank, loss_fn=F.mse_loss)
        states = seeded_states(SEED, PP)
        torch.manual_seed(SEED)
        _, losses = _step(sched, mine, len(mods), x, y)
        want = replay_step(ref, sched.program, [(c,) for c in x.chunk(M)], list(y.chunk(M)), F.mse_loss,
                           states, 1.0 / M)
        _compare(f"{name} lazy", mods, ref, mine, losses, want)
        for s in mine:
            assert_close(list(mods[s].parameters()), list(ref[s].parameters()),
                         msg=lambda m, s=s: f"{name} stage {s} initial parameters: {m}")
        assert torch.equal(torch.get_rng_state(), states[rank]), f"{name}: the generator drew another amount"


# ---- losses that cannot give gradients --------------------------------------------------------

def case_loss_without_grad(rank, world):
    """A detached loss and a constant one fail every rank naming microbatch 0; a frozen model
    (no parameter requires grad) runs, with one process's losses and no gradient."""
    x, y = _data()
    failures = []
    bad = {"detached": lambda out, t: F.mse_loss(out.detach(), t), "constant": lambda out, t: torch.tensor(1.0)}
    for name in SPLIT:
        for what, loss_fn in bad.items():
            mods, _, sched, mine = _build(name, lambda s, n: MLPStage(), rank, group=_fresh_group(),
                                          loss_fn=loss_fn)
            failures.append((name, what, _failure(sched, mine, len(mods), x, y)))
        mods, ref, sched, mine = _build(name, lambda s, n: MLPStage(), rank, loss_fn=F.mse_loss)
        for m in mods + ref:
            m.requires_grad_(False)
        _, losses = _step(sched, mine, len(mods), x, y)
        want, _ = _one_process(ref, x, y, train=False)
        _compare(f"{name} frozen", mods, ref, mine, losses, want)
        assert all(p.grad is None for s in mine for p in mods[s].parameters()), f"{name}: a frozen model got grads"
    return failures


# ---- chunk specs -----------------------------------------------------------------------------

def case_chunk_specs(rank, world):
    """args_chunk_spec splitting the batch along dim 1, a mask replicated by kwargs_chunk_spec,
    an output merged along dim 1 with its row counts summed by torch's sum_reducer."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate, sum_reducer

    x, y = _data()
    xt, mask = x.t().contiguous(), torch.linspace(0.5, 1.5, WIDTH)
    for name in SPLIT:
        mods, ref, sched, mine = _build(
            name, lambda s, n: SpecStage(s == 0, s == n - 1), rank, loss_fn=spec_loss,
            args_chunk_spec=(TensorChunkSpec(1),), kwargs_chunk_spec={"mask": _Replicate},
            output_merge_spec={"y": TensorChunkSpec(1), "rows": sum_reducer})
        out, losses = _step(sched, mine, len(mods), xt, y, mask=mask)
        want, outs = [], []
        for xm, ym in zip(xt.chunk(M, dim=1), y.chunk(M)):
            h = xm
            for m in ref:
                h = m(h, mask=mask)
            loss = spec_loss(h, ym)
            (loss / M).backward()
            want.append(loss.detach())
            outs.append(h["y"].detach())
        _compare(f"{name} chunk specs", mods, ref, mine, losses, want)
        if len(mods) - 1 in mine:
            assert_close(out["y"], torch.cat(outs, dim=1), msg=lambda m: f"{name} merged output: {m}")
            assert float(out["rows"]) == float(x.shape[0]), out["rows"]


def case_zero_rows(rank, world):
    """A batch of 0 rows (the target has its rows): ValueError on the first stage's rank,
    PipelineError naming it on the other."""
    mods, _, sched, mine = _build("1f1b", lambda s, n: MLPStage(), rank, group=_fresh_group(), loss_fn=F.mse_loss)
    return _failure(sched, mine, len(mods), torch.randn(0, WIDTH), torch.randn(M * ROWS, WIDTH))


# ---- the tests -------------------------------------------------------------------------------

def test_autocast_around_step_and_eval(spawn_world):
    spawn_world(PP).run(case_autocast_around_step, timeout_s=300)


def test_autocast_inside_a_stage_forward(spawn_world):
    spawn_world(PP).run(case_autocast_inside_the_stage, timeout_s=300)


def test_autocast_change_between_steps_is_a_new_signature(spawn_world):
    for handshakes, failure in spawn_world(PP).run(case_autocast_changes_between_steps, timeout_s=300):
        assert handshakes == 2, handshakes
        assert "of dtype bfloat16 where the pipeline agreed on float32 (tensor 0 of 1)" in failure, failure
        assert "the shapes match" in failure, failure


def test_grad_scaler_fp16(spawn_world):
    spawn_world(PP).run(case_grad_scaler, timeout_s=300)


def test_devices_as_users_name_them(spawn_world):
    for got in spawn_world(PP).run(case_device_forms, timeout_s=300):
        assert set(got) == {"cpu"}, got


def test_shape_inference_draws_nothing_and_keeps_buffers(spawn_world):
    spawn_world(PP).run(case_rng_and_buffers, timeout_s=300)


def test_lazy_modules_materialize_at_the_first_real_forward(spawn_world):
    spawn_world(PP).run(case_lazy_modules, timeout_s=300)


def test_loss_without_grad_fails_every_rank_frozen_model_runs(spawn_world):
    for failures in spawn_world(PP).run(case_loss_without_grad, timeout_s=300):
        for name, what, msg in failures:
            assert "the loss of microbatch 0 (stage" in msg and "does not require grad" in msg, (name, what, msg)
            assert msg.startswith(("PipelineError", "RuntimeError")), (name, what, msg)


def test_torch_chunk_specs(spawn_world):
    spawn_world(PP).run(case_chunk_specs, timeout_s=300)


def test_zero_row_batch_is_a_clear_error(spawn_world):
    first, second = spawn_world(PP).run(case_zero_rows, timeout_s=120)
    assert first.startswith("ValueError: zbpipe: argument[0] has 0 rows"), first
    assert "has 0 rows" in second and second.startswith("PipelineError"), second


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_forms_are_placed_as_torch_places_tensors():
    from zbpipe.devices import placement

    current = torch.device("cuda", torch.cuda.current_device())
    assert placement("cuda") == current
    assert placement(torch.device("cuda")) == current
    assert placement("cuda:0") == torch.device("cuda", 0)
    assert placement(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert torch.empty(1, device=placement("cuda")).device == current


def test_one_stage_frozen_model_runs_and_a_detached_loss_fails():
    """One stage on one in-process loopback rank: with no parameter requiring grad the loss has
    no graph and the step runs (no gradient); with trained parameters a detached loss fails."""
    from zbpipe import _C

    x, y = _data()
    world = _C._LoopbackWorld(1)
    frozen = MLPStage().requires_grad_(False)
    stage = zbpipe.PipelineStage(frozen, 0, 1, "cpu", group=world.group(0))
    losses = []
    zbpipe.Schedule1F1B(stage, M, loss_fn=F.mse_loss).step(x, target=y, losses=losses)
    assert_close(losses, _one_process([frozen], x, y, train=False)[0])
    assert all(p.grad is None for p in frozen.parameters())
    stage = zbpipe.PipelineStage(MLPStage(), 0, 1, "cpu", group=world.group(0))
    sched = zbpipe.Schedule1F1B(stage, M, loss_fn=lambda out, t: F.mse_loss(out.detach(), t))
    with pytest.raises(zbpipe.PipelineError, match=r"the loss of microbatch 0 \(stage 0\) does not require grad"):
        sched.step(x, target=y)
