"""torchtitan's calls into the pipelining API, made on zbpipe's classes exactly as torchtitan
(0.3.0: torchtitan/distributed/pipeline_parallel.py, trainer.py, components/validate.py) makes
them on torch's, without installing torchtitan: the swapped import lines; a decoder split into
stage modules that keep the full model's parameter names (_split_module's deep copy, other
stages' modules removed); PipelineStage(chunk, idx, n, device, group=, get_mesh=) on the device
torchtitan's trainer makes, torch.device(f"{device_type}:{LOCAL_RANK}") (cpu:1 on rank 1 of
one CPU node: local_device below); the parallelized module
assigned to stage.submod after the stage is built (fully_shard included); the schedule built by
_build_pipeline_schedule's rules (looped schedules get backward_requires_autograd=, every one
scale_grads=False and a loss_fn that returns (loss, aux)); step(arg_mbs=, kwarg_mbs=,
target_mbs=, losses=, loss_kwargs=, return_outputs=False) with the microbatches the trainer
split; eval(arg_mbs=, kwarg_mbs=, target_mbs=, losses=) for validation. Losses and gradients
equal one process running the whole model over the same microbatches.

Also: scale_grads True/False (and the attribute), backward_requires_autograd=False under
no_grad, the pre-split argument checks, and torch's CSV runtime class (_load_csv), the last
three on one in-process loopback rank.

Gloo worlds: 2 ranks (pp=2), and 4 ranks (pp=2 x dp=2) for fully_shard.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.asserts import assert_close, assert_grads_close

# torchtitan's import lines, swapped: torch.distributed.pipelining -> zbpipe.
from zbpipe import PipelineStage
from zbpipe.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

import zbpipe
from zbpipe import _C

VOCAB, DIM, LAYERS, SEQ, MB_ROWS = 16, 8, 4, 6, 2
M = 4  # pipeline microbatches per step (torchtitan's num_pp_microbatches)
STEPS = 2


# ---- a torchtitan-shaped decoder --------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(DIM, DIM)
        self.pos_scale = nn.Parameter(torch.full((1,), 0.05))  # 1-d: fully_shard takes no scalars

    def forward(self, h, positions):
        return h + torch.tanh(self.w(h)) + self.pos_scale * positions.to(h.dtype).unsqueeze(-1)


class Decoder(nn.Module):
    """tok_embeddings, layers (a ModuleDict), norm, lm_head; forward tolerates removed modules
    (torchtitan's contract for pipeline_module_split) and takes positions as a keyword argument
    every stage receives (trainer.post_dataloading_process's extra_kwargs)."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, positions=None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, positions)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h


def fqns_per_stage(num_stages: int) -> list[list[str]]:
    per = LAYERS // num_stages
    names = [[f"layers.{i}" for i in range(s * per, (s + 1) * per)] for s in range(num_stages)]
    names[0].insert(0, "tok_embeddings")
    names[-1] += ["norm", "lm_head"]
    return names


def split_module(whole: nn.Module, module_names: list[str]) -> nn.Module:
    """torchtitan's _split_module: a deep copy keeping only `module_names` (names unchanged)."""
    model = copy.deepcopy(whole)
    keep = set(module_names)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.ModuleDict):
            for key in list(child.keys()):
                if f"{name}.{key}" not in keep:
                    del child[key]
        elif name not in keep:
            setattr(model, name, None)
    return model


def stage_indices(pp_rank: int, pp: int, schedule_class: type, num_stages: int) -> tuple[int, ...]:
    """torchtitan's _get_pp_rank_to_stage_indices_mapping."""
    if schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        return tuple(zip(range(pp), range(num_stages - 1, pp - 1, -1)))[pp_rank]
    return tuple(pp_rank + s * pp for s in range(num_stages // pp))


def loss_fn(pred, labels, global_valid_tokens=None):
    """torchtitan's loss: a token sum, over the global number of valid tokens where given (the
    trainer's loss_kwargs; validation passes none and gets sums), with an aux."""
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    return (loss if global_valid_tokens is None else loss / global_valid_tokens), {"tokens": labels.numel()}


def _scalar_loss_fn(*args, **kwargs):
    loss, _ = loss_fn(*args, **kwargs)
    return loss


def build_schedule(name: str, stages: list, scale_grads: bool = False) -> _PipelineSchedule:
    """torchtitan's _build_pipeline_schedule."""
    schedule_class = get_schedule_class(name)
    if schedule_class is PipelineScheduleSingle:
        raise ValueError("PipelineScheduleSingle is an abstract base class")
    if issubclass(schedule_class, PipelineScheduleMulti):
        return schedule_class(stages, n_microbatches=M, loss_fn=_scalar_loss_fn, scale_grads=scale_grads,
                              backward_requires_autograd=True)
    return schedule_class(stages[0], n_microbatches=M, loss_fn=_scalar_loss_fn, scale_grads=scale_grads)


def microbatches(step: int, replica: int = 0):
    """What torchtitan's dataloader hands one dp replica for one step: M (input_dict, labels)."""
    g = torch.Generator().manual_seed(100 * step + replica)
    out = []
    for _ in range(M):
        tokens = torch.randint(0, VOCAB, (MB_ROWS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MB_ROWS, SEQ), generator=g)
        positions = torch.arange(SEQ).repeat(MB_ROWS, 1) + torch.randint(0, 3, (MB_ROWS, 1), generator=g)
        out.append(({"input": tokens, "positions": positions}, labels))
    return out


def pp_forward_backward_step(schedule, has_first, has_last, mbs, global_valid_tokens=None, train=True):
    """torchtitan's Trainer.pp_forward_backward_step (train) and Validator's PP branch (eval)."""
    arg_mbs, kwarg_mbs = [], []
    target_mbs = [] if has_last else None
    for input_dict, labels in mbs:
        extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
        if has_first:
            arg_mbs.append((input_dict["input"],))
        kwarg_mbs.append(extra_kwargs)
        if target_mbs is not None:
            target_mbs.append(labels)
    losses = [] if has_last else None
    if train:
        schedule.step(arg_mbs=arg_mbs if has_first else None, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
                      losses=losses, loss_kwargs={"global_valid_tokens": global_valid_tokens},
                      return_outputs=False)
    else:
        schedule.eval(arg_mbs=arg_mbs if has_first else None, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
                      losses=losses)
    return losses


def reference(model, steps_mbs, scale, lr):
    """One process, the whole model: per step, every microbatch's loss (its backward scaled by
    `scale`), the gradients, then SGD. Returns [(losses, {name: grad})] per step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for mbs in steps_mbs:
        opt.zero_grad()
        tokens = sum(labels.numel() for _, labels in mbs)
        losses = []
        for input_dict, labels in mbs:
            loss = _scalar_loss_fn(model(input_dict["input"], positions=input_dict["positions"]), labels, tokens)
            (loss * scale).backward()
            losses.append(loss.detach())
        out.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def _grads_of(parts) -> dict:
    grads = {}
    for part in parts:
        for n, p in part.named_parameters():
            g = p.grad
            grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return grads


def local_device(rank: int) -> torch.device:
    """torchtitan's Trainer.device: torch.device(f"{device_type}:{int(os.environ['LOCAL_RANK'])}"),
    on one CPU node (LOCAL_RANK is the rank)."""
    return torch.device(f"cpu:{rank}")


_MESHES: dict = {}  # per rank process: one device mesh per shape, made once


def _mesh(dp: int, pp: int):
    from torch.distributed.device_mesh import init_device_mesh

    if (dp, pp) not in _MESHES:
        _MESHES[dp, pp] = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    return _MESHES[dp, pp]


# ---- pp=2: the forms, exact against one process -----------------------------------------------

def case_pipeline_llm(rank, world, name, scale_grads):
    """pipeline_llm on 2 ranks, two training steps (SGD between them), then validation."""
    torch.manual_seed(0)
    whole = Decoder()
    ref_model = copy.deepcopy(whole)
    mesh = _mesh(1, world)
    pp_mesh = mesh["pp"]
    schedule_class = get_schedule_class(name)
    names = fqns_per_stage(2 * world if issubclass(schedule_class, PipelineScheduleMulti) else world)
    mesh_calls = []

    def get_mesh(mesh_dim_names, mesh_layout):  # torchtitan's _build_get_mesh_callback
        mesh_calls.append(mesh_dim_names)
        return mesh[mesh_dim_names]

    stages, model_parts = [], []
    for idx in stage_indices(pp_mesh.get_local_rank(), pp_mesh.size(), schedule_class, len(names)):
        chunk = split_module(whole, names[idx])
        stages.append(PipelineStage(chunk, idx, len(names), local_device(rank),
                                    group=pp_mesh.get_group("pp"), get_mesh=get_mesh))
        model_parts.append(chunk)
    for i, m in enumerate(model_parts):
        m = torch.nn.Module.train(m)  # parallelize_fn's stand-in: returns the (same) module
        model_parts[i] = m
        stages[i].submod = m
    schedule = build_schedule(name, stages, scale_grads=scale_grads)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)

    lr = 0.1
    steps_mbs = [microbatches(k) for k in range(STEPS)]
    want = reference(ref_model, steps_mbs, 1.0 / M if scale_grads else 1.0, lr)
    opt = torch.optim.SGD([p for m in model_parts for p in m.parameters()], lr=lr)
    for k, mbs in enumerate(steps_mbs):
        opt.zero_grad()
        tokens = sum(labels.numel() for _, labels in mbs)
        losses = pp_forward_backward_step(schedule, has_first, has_last, mbs, tokens)
        if has_last:
            assert_close(losses, want[k][0], msg=lambda m, k=k: f"{name} step {k} losses: {m}")
        grads = _grads_of(model_parts)
        assert grads, "this rank holds no parameters"
        for n, g in grads.items():
            assert_close(g, want[k][1][n], msg=lambda m, n=n, k=k: f"{name} step {k} grad of {n}: {m}")
        opt.step()

    # Validation through the schedule: forward only, no gradients, the reference's losses.
    opt.zero_grad(set_to_none=True)
    for m in model_parts:
        m.eval()
    val_mbs = microbatches(7)
    with torch.no_grad():
        val = pp_forward_backward_step(schedule, has_first, has_last, val_mbs, train=False)
        ref_val = [_scalar_loss_fn(ref_model(d["input"], positions=d["positions"]), y) for d, y in val_mbs]
    if has_last:
        assert_close(val, ref_val, msg=lambda m: f"{name} validation losses: {m}")
    assert all(p.grad is None for m in model_parts for p in m.parameters()), "eval made gradients"
    return mesh_calls


FORMS = [("1F1B", False), ("Interleaved1F1B", False), ("ZBVZeroBubble", False), ("DualPipeV", False),
         ("1F1B", True), ("ZBVZeroBubble", True)]


@pytest.mark.parametrize("name,scale_grads", FORMS, ids=[f"{n}-scale_grads={s}" for n, s in FORMS])
def test_pipeline_llm_forms_match_one_process(spawn_world, name, scale_grads):
    mesh_calls = spawn_world(2).run(case_pipeline_llm, name, scale_grads, timeout_s=300)
    assert mesh_calls == [[], []], "zbpipe sends plain tensors and never calls get_mesh"


# ---- pp=2 x dp=2: fully_shard applied after the stages are built ------------------------------

def _count_reshards():
    """FSDP parameter-group reshards that free unsharded parameters (zbpipe's adapter keeps a
    stage unsharded for the whole step: one per group and step; FSDP alone: per microbatch)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    counts = {"n": 0}
    original = FSDPParamGroup._to_sharded

    def to_sharded(self):
        counts["n"] += not self.is_sharded
        return original(self)

    FSDPParamGroup._to_sharded = to_sharded
    return counts


def case_fully_shard_after_build(rank, world, name):
    """torchtitan's order: stages built on plain chunks, then parallelize_fn (fully_shard of each
    layer, then of the chunk) and stage.submod = the sharded chunk. FSDP keeps its mean over
    the replicas (torchtitan turns it off with set_gradient_divide_factor(1.0), a PREMUL_SUM
    that Gloo lacks), so the reference scales its global-batch gradients by 1/dp."""
    from torch.distributed.fsdp import fully_shard

    dp, pp = 2, world // 2
    mesh = _mesh(dp, pp)
    dp_rank, pp_rank = mesh.get_coordinate()
    torch.manual_seed(0)
    whole = Decoder()
    ref_model = copy.deepcopy(whole)
    schedule_class = get_schedule_class(name)
    names = fqns_per_stage(2 * pp)
    stages, model_parts = [], []
    for idx in stage_indices(pp_rank, pp, schedule_class, len(names)):
        chunk = split_module(whole, names[idx])
        stages.append(PipelineStage(chunk, idx, len(names), local_device(rank), group=mesh["pp"].get_group(),
                                    get_mesh=lambda names, layout: mesh[names]))
        model_parts.append(chunk)
    for i, m in enumerate(model_parts):
        for layer in m.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        m = fully_shard(m, mesh=mesh["dp"])
        model_parts[i] = m
        stages[i].submod = m
    schedule = build_schedule(name, stages)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    reshards = _count_reshards()

    # The global batch: both replicas' microbatches, the loss over the global token count.
    steps = [[microbatches(k, r) for r in range(dp)] for k in range(STEPS)]
    want = reference(ref_model, [sum(s, []) for s in steps], 1.0 / dp, 0.0)  # lr 0: the same weights
    for k, per_replica in enumerate(steps):
        for m in model_parts:
            m.zero_grad()
        tokens = sum(labels.numel() for mbs in per_replica for _, labels in mbs)
        losses = pp_forward_backward_step(schedule, has_first, has_last, per_replica[dp_rank], tokens)
        if has_last:
            assert_close(losses, want[k][0][dp_rank * M:(dp_rank + 1) * M], msg=lambda m: f"losses: {m}")
        for n, g in _grads_of(model_parts).items():
            assert_close(g, want[k][1][n], msg=lambda m, n=n, k=k: f"{name} step {k} grad of {n}: {m}")
    groups = sum(len(fully_shard.state(sub)._fsdp_param_groups) for m in model_parts for sub in m.modules()
                 if fully_shard.state(sub) is not None)
    return reshards["n"], groups


def test_fully_shard_applied_after_the_stage_is_built(spawn_world):
    for reshards, groups in spawn_world(4).run(case_fully_shard_after_build, "ZBVZeroBubble", timeout_s=300):
        # The stage's data parallelism was found at the first step: one reshard per
        # parameter group and step (FSDP on its own reshards at every microbatch's backward).
        assert reshards == groups * STEPS, (reshards, groups)


def case_sharded_after_first_step(rank, world):
    """fully_shard in place after the schedule's first step: refused on every rank."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(1, world)
    torch.manual_seed(0)
    names = fqns_per_stage(world)
    chunk = split_module(Decoder(), names[rank])
    stage = PipelineStage(chunk, rank, world, local_device(rank), group=mesh["pp"].get_group())
    schedule = build_schedule("1F1B", [stage])
    mbs = microbatches(0)
    pp_forward_backward_step(schedule, stage.is_first, stage.is_last, mbs, 48)
    fully_shard(chunk, mesh=mesh["dp"])
    try:
        pp_forward_backward_step(schedule, stage.is_first, stage.is_last, mbs, 48)
    except (ValueError, zbpipe.PipelineError) as e:
        return str(e)
    return "accepted"


def test_data_parallelism_gained_after_the_first_step_is_refused(spawn_world):
    for msg in spawn_world(2).run(case_sharded_after_first_step, timeout_s=120):
        assert "became data-parallel" in msg and "after this schedule's first step" in msg, msg


# ---- pp=2, FSDP's bf16 mixed precision: torchtitan's default ---------------------------------

def _write_v_fill_drain_csv(path: str) -> None:
    """The V placement (rank 0: stages 0 and 3, rank 1: stages 1 and 2) with full backwards:
    all forwards, then all backwards, each stage's microbatches in order (torch's CSV layout)."""
    def row(a, b):
        return ",".join([f"{a}F{m}" for m in range(M)] + [f"{b}F{m}" for m in range(M)]
                        + [f"{b}B{m}" for m in range(M)] + [f"{a}B{m}" for m in range(M)])

    with open(path, "w") as f:
        f.write(row(0, 3) + "\n" + row(1, 2) + "\n")


def case_mixed_precision_split_equals_fused(rank, world, split_name, csv_path, deferred=False):
    """torchtitan's parallelize_fn applies fully_shard (on a dp mesh of size 1 when dp is off)
    with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32). The schedule that
    splits the backward must give the gradients of the one with full backwards on the same
    stage placement: FSDP sums each microbatch's bf16 gradient in float32. Returns
    {schedule: [(losses, grads) per step]}."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh(1, world)
    placement = get_schedule_class(split_name)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for name in (split_name, "fused"):
        torch.manual_seed(0)
        whole = Decoder()
        names = fqns_per_stage(2 * world)
        stages, model_parts = [], []
        for idx in stage_indices(rank, world, placement, len(names)):
            chunk = split_module(whole, names[idx])
            stages.append(PipelineStage(chunk, idx, len(names), local_device(rank), group=mesh["pp"].get_group(),
                                        deferred_linear=deferred and name != "fused"))
            model_parts.append(chunk)
        for i, m in enumerate(model_parts):
            for layer in m.layers.values():
                fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
            model_parts[i] = stages[i].submod = fully_shard(m, mesh=mesh["dp"], mp_policy=mp)
        if name != "fused":
            schedule = build_schedule(name, stages)
        elif placement in (ScheduleZBVZeroBubble, ScheduleDualPipeV):  # V placement: torchtitan's CSV path, full backwards
            schedule = _PipelineScheduleRuntime(stages, n_microbatches=M, loss_fn=_scalar_loss_fn, scale_grads=False,
                                                backward_requires_autograd=True)
            schedule._load_csv(csv_path)
        else:
            schedule = build_schedule("Interleaved1F1B", stages)
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        opt = torch.optim.SGD([p for m in model_parts for p in m.parameters()], lr=0.1)
        steps = []
        for k in range(STEPS):
            opt.zero_grad()
            mbs = microbatches(k)
            losses = pp_forward_backward_step(schedule, has_first, has_last, mbs, sum(y.numel() for _, y in mbs))
            steps.append((losses, {n: g.clone() for n, g in _grads_of(model_parts).items()}))
            opt.step()
        out[name] = steps
    return out


MP_FORMS = [("InterleavedZeroBubble", False), ("ZBVZeroBubble", False), ("DualPipeV", False),
            ("InterleavedZeroBubble", True)]


@pytest.mark.parametrize("split_name,deferred", MP_FORMS, ids=[f"{n}-deferred_linear={d}" for n, d in MP_FORMS])
def test_split_backward_under_fsdp_mixed_precision_equals_full_backwards(spawn_world, tmp_path, split_name, deferred):
    csv_path = str(tmp_path / "v_fill_drain.csv")
    _write_v_fill_drain_csv(csv_path)
    for rank, got in enumerate(spawn_world(2).run(case_mixed_precision_split_equals_fused, split_name, csv_path,
                                                  deferred, timeout_s=300)):
        for k, ((losses, grads), (want_losses, want_grads)) in enumerate(zip(got[split_name], got["fused"])):
            assert_close(losses, want_losses, msg=lambda m, k=k: f"rank {rank} step {k} losses: {m}")
            assert grads.keys() == want_grads.keys() and grads, (rank, sorted(grads), sorted(want_grads))
            for n, g in grads.items():
                assert g.dtype == torch.float32, (n, g.dtype)
                assert_close(g, want_grads[n], msg=lambda m, n=n, k=k: f"{split_name} rank {rank} step {k} grad of {n}: {m}")


# ---- one loopback rank: argument forms and checks ---------------------------------------------

def _loopback_stages(num_stages: int, seed: int = 0):
    torch.manual_seed(seed)
    world = _C._LoopbackWorld(1)
    mods = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(num_stages)]
    stages = [PipelineStage(m, s, num_stages, "cpu", group=world.group(0)) for s, m in enumerate(mods)]
    return world, mods, stages


def _xy(n=M):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n * 2, DIM, generator=g), torch.randn(n * 2, DIM, generator=g)


def _reference_grads(mods, x, y, scale):
    ref = copy.deepcopy(mods)
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        h = xm
        for m in ref:
            h = m(h)
        (F.mse_loss(h, ym) * scale).backward()
    return ref


def test_scale_grads_true_false_and_the_attribute():
    x, y = _xy()
    for scale_grads, set_later in [(True, None), (False, None), (True, False)]:
        world, mods, stages = _loopback_stages(2)
        sched = zbpipe.ScheduleInterleaved1F1B(stages, M, loss_fn=F.mse_loss, scale_grads=scale_grads)
        if set_later is not None:
            sched.scale_grads = set_later  # torch's attribute, read at every step
        effective = scale_grads if set_later is None else set_later
        sched.step(x, target=y)
        ref = _reference_grads(mods, x, y, 1.0 / M if effective else 1.0)
        assert_grads_close(mods, ref, msg=f"scale_grads={scale_grads} then {set_later}")
    # torch's PipelineStage.scale_grads(factor): divides the stage's gradients.
    before = [p.grad.clone() for p in mods[0].parameters()]
    stages[0].scale_grads(4)
    assert_close([p.grad for p in mods[0].parameters()], [b / 4 for b in before])


def test_backward_requires_autograd_false_runs_registered_backwards_under_no_grad():
    x, y = _xy()
    world, mods, stages = _loopback_stages(2)
    sched = zbpipe.ScheduleInterleaved1F1B(stages, M, loss_fn=F.mse_loss, backward_requires_autograd=False)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"this rank's B actions have no function registered"):
        sched.step(x, target=y)

    def forward_with_graph(action, ctx):  # the registered functions own the graph
        with torch.enable_grad():
            ctx.run(action)

    sched.register_custom_function("FORWARD", forward_with_graph)
    sched.register_custom_function("FULL_BACKWARD", lambda action, ctx: ctx.run(action))
    with torch.no_grad():
        sched.step(x, target=y)
    assert_grads_close(mods, _reference_grads(mods, x, y, 1.0 / M), msg="backward_requires_autograd=False")

    # The default (True) refuses no_grad whatever is registered, as torch does.
    world2, mods2, stages2 = _loopback_stages(2)
    strict = zbpipe.ScheduleInterleaved1F1B(stages2, M, loss_fn=F.mse_loss)
    strict.register_custom_function("FORWARD", forward_with_graph)
    strict.register_custom_function("FULL_BACKWARD", lambda action, ctx: ctx.run(action))
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot run with gradients disabled"):
        strict.step(x, target=y)


def test_presplit_microbatches_equal_the_whole_batch_and_are_checked():
    x, y = _xy()
    world, mods, stages = _loopback_stages(2)
    sched = zbpipe.ScheduleInterleaved1F1B(stages, M, loss_fn=F.mse_loss)
    losses = []
    out = sched.step(arg_mbs=[(c,) for c in x.chunk(M)], target_mbs=list(y.chunk(M)), losses=losses)
    assert_grads_close(mods, _reference_grads(mods, x, y, 1.0 / M), msg="pre-split")
    whole = []
    world2, mods2, stages2 = _loopback_stages(2)
    want = zbpipe.ScheduleInterleaved1F1B(stages2, M, loss_fn=F.mse_loss).step(x, target=y, losses=whole)
    assert_close(out, want)
    assert_close(losses, whole)

    xs, ys = [(c,) for c in x.chunk(M)], list(y.chunk(M))
    bad = [
        (dict(arg_mbs=xs, target=y), ValueError, "cannot be mixed with whole-batch inputs"),
        (dict(arg_mbs=xs, target_mbs=ys, gain=2.0), ValueError, "cannot be mixed"),
        (dict(arg_mbs=tuple(xs), target_mbs=ys), TypeError, "arg_mbs must be a list"),
        (dict(arg_mbs=xs[:3], target_mbs=ys), ValueError, f"Expecting {M} arg_mbs but got 3"),
        (dict(arg_mbs=[], target_mbs=ys), ValueError, f"Expecting {M} arg_mbs but got 0"),
        (dict(arg_mbs=[c for (c,) in xs], target_mbs=ys), TypeError, r"arg_mbs\[0\] must be a tuple or list"),
        (dict(arg_mbs=xs, kwarg_mbs=[()] * M, target_mbs=ys), TypeError, r"kwarg_mbs\[0\] must be a dict"),
        (dict(arg_mbs=xs, target_mbs=ys[:1]), ValueError, f"Expecting {M} target_mbs but got 1"),
        (dict(arg_mbs=xs), ValueError, "needs target= \\(or target_mbs=\\)"),
    ]
    for kwargs, error, match in bad:
        world3, mods3, stages3 = _loopback_stages(2)
        with pytest.raises(error, match=match):
            zbpipe.ScheduleInterleaved1F1B(stages3, M, loss_fn=F.mse_loss).step(**kwargs)


def test_csv_runtime_class_loads_the_schedule(tmp_path):
    """torchtitan's pipeline_parallel_schedule_csv: _PipelineScheduleRuntime, then _load_csv."""
    x, y = _xy()
    path = tmp_path / "schedule.csv"
    zbpipe.compile("interleaved_1f1b", 1, M, 2).compute_only().to_csv(str(path))
    world, mods, stages = _loopback_stages(2)
    sched = _PipelineScheduleRuntime(stages, n_microbatches=M, loss_fn=F.mse_loss, scale_grads=False,
                                     backward_requires_autograd=True)
    with pytest.raises(RuntimeError, match="call _load_csv"):
        sched.step(x, target=y)
    with pytest.raises(ValueError, match="n_microbatches=2"):
        _PipelineScheduleRuntime(_loopback_stages(2)[2], n_microbatches=2, loss_fn=F.mse_loss)._load_csv(str(path))
    sched._load_csv(str(path))
    assert sched.program.compute_actions(0) == zbpipe.compile("interleaved_1f1b", 1, M, 2).compute_actions(0)
    sched.step(x, target=y)
    assert_grads_close(mods, _reference_grads(mods, x, y, 1.0), msg="CSV runtime")
