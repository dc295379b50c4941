"""PyTorch's own pipelining tests, rewritten on zbpipe's classes (Gloo, CPU, small sizes), and
two regression tests of what zbpipe already does where torch does not.

Sources (read, not copied; models and schedules rewritten here):
- pytorch test/distributed/pipelining/test_schedule_multiproc.py: ScheduleTest (world 4, its 12
  test functions, 30 cases) and CustomSchedulesTest (world 2, 4 cases), with the models of
  model_registry.py and the custom schedules of schedule_registry.py (as zbpipe programs through
  PipelineSchedule.from_program);
- test_schedule.py ScheduleTest: get_schedule_class, single-stage schedules, eval then train
  (world 1, 11 cases);
- test_pipe.py: the tracer's model split (in process, 3 cases);
- DeepSeek DualPipe examples/example_dualpipev.py: DualPipeV with a custom autograd Linear
  that adds its weight gradient inside backward and returns None for the weight (world 2);
- d9d test/d9d_test/pipelining/test_e2e.py: dict inputs/outputs, a frozen weight, gradient
  hooks, 8 schedule configurations x 6 microbatch counts x 2 (world 4).

Each source case is one pytest case; the cases of one world size share one spawned world.
Every comparison uses the suite's one tolerance (helpers/asserts.py), not the sources' own.
Not ported: torch's check_leaked_tensors (its test utilities need expecttest; zbpipe's memory
tests cover what a step holds), torch.compile refusal for zero-bubble schedules (zbpipe does not
refuse), and torch's _PipelineScheduleRuntime/CSV round trip (tests/core/test_csv_interop.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.asserts import assert_close as close
from helpers.asserts import assert_grads_close
from helpers.model_registry import DualPipeLinearFunc
from helpers.schedule_registry import rank_schedule
from torch import nn

import zbpipe

D_HID, BATCH = 32, 32


# ---- models (after model_registry.py) ----------------------------------------------------------

class MLPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class StackedMLP(nn.Module):
    """MultiMLP: `layers.i` blocks, split before each block after the first."""

    def __init__(self, d, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(d) for _ in range(n_layers))
        self.split_spec = {f"layers.{i}": zbpipe.SplitPoint.BEGINNING for i in range(1, n_layers)}

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class KwargBlock(MLPBlock):
    def forward(self, x, unused_kwarg=None):
        return super().forward(x)


class StackedMLPKwargs(StackedMLP):
    """MultiMLPKwargs: every block takes an unused keyword argument."""

    def __init__(self, d, n_layers=2):
        super().__init__(d, n_layers)
        self.layers = nn.ModuleList(KwargBlock(d) for _ in range(n_layers))

    def forward(self, x, unused_kwarg=None):
        for layer in self.layers:
            x = layer(x, unused_kwarg=unused_kwarg)
        return x


class KwargsModel(nn.Module):
    """ModelWithKwargs: a keyword input used by the first stage, pipe_split() in forward."""

    def __init__(self, d, splits=2):
        super().__init__()
        self.splits = splits
        self.p0 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.p1 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(splits + 1))

    def forward(self, x, y=None):
        x = torch.relu(self.lins[0](x @ self.p0 + y))
        zbpipe.pipe_split()
        x = torch.relu(self.lins[1](x @ self.p1))
        for i in range(2, self.splits):
            zbpipe.pipe_split()
            x = torch.relu(self.lins[i](x))
        return x


class _LinearNoWeightGrad(torch.autograd.Function):
    """CustomLinearDx: input gradient only; grad_output and input are kept for compute_dW."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner, name):
        ctx.save_for_backward(x, weight)
        ctx.owner, ctx.name = owner, name
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        ctx.owner.cache[ctx.name].append((g.clone(), x.clone()))
        return g @ weight, None, None, None, None


class SelfDwBlock(nn.Module):
    """MLPModuleWithDw: after toggle(), its backward leaves the weights to compute_dW()."""

    def __init__(self, d):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.empty(d, d)), nn.Parameter(torch.empty(d, d))
        self.b1, self.b2 = nn.Parameter(torch.empty(d)), nn.Parameter(torch.empty(d))
        for p in self.parameters():
            nn.init.uniform_(p, -0.001, 0.001)
        self.cache = {"fc1": [], "fc2": []}
        self.custom = False

    def forward(self, x):
        if not self.custom:
            return F.linear(torch.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)
        h = torch.relu(_LinearNoWeightGrad.apply(x, self.w1, self.b1, self, "fc1"))
        return _LinearNoWeightGrad.apply(h, self.w2, self.b2, self, "fc2")

    def compute_dW(self):
        for name, w, b in (("fc1", self.w1, self.b1), ("fc2", self.w2, self.b2)):
            g, x = self.cache[name].pop(0)
            for p, grad in ((w, g.t() @ x), (b, g.sum(0))):
                p.grad = grad if p.grad is None else p.grad + grad


class StackedSelfDw(StackedMLP):
    def __init__(self, d, n_layers=2):
        super().__init__(d, n_layers)
        self.layers = nn.ModuleList(SelfDwBlock(d) for _ in range(n_layers))

    def toggle(self):
        for layer in self.layers:
            layer.custom = not layer.custom


# ---- helpers (after test_schedule_multiproc.py's) ---------------------------------------------

def setup(world, n_layers=None, model_cls=StackedMLP, seed=0):
    torch.manual_seed(seed)
    mod = model_cls(D_HID, n_layers or world)
    ref = copy.deepcopy(mod)
    x = torch.randn(BATCH, D_HID)
    with torch.no_grad():
        target = ref(x) + torch.randn(BATCH, D_HID)
    return mod, ref, x, target, nn.MSELoss(reduction="sum")


def single_stage(rank, world, mod, x, chunks, tracer=True):
    if tracer:
        pipe = zbpipe.pipeline(mod, mb_args=(x.chunk(chunks)[0],), split_spec=mod.split_spec)
        return pipe.build_stage(rank, "cpu"), pipe.get_stage_module(rank)
    sub = mod.get_submodule(f"layers.{rank}")
    return zbpipe.PipelineStage(sub, rank, world, "cpu"), sub


def multi_stage(rank, world, mod, n_stages, indices=None, **stage_kw):
    indices = indices or [rank + i * world for i in range(n_stages // world)]
    names = [f"layers.{i}" for i in indices]
    subs = [mod.get_submodule(n) for n in names]
    return [zbpipe.PipelineStage(m, i, n_stages, "cpu", **stage_kw) for m, i in zip(subs, indices)], subs, names


def reference(ref, x, target, loss_fn, iters=2, **kwargs):
    for _ in range(iters):
        ref.zero_grad()
        out = ref(x, **kwargs)
        loss = loss_fn(out, target)
        loss.backward()
    return out.detach(), loss.detach()


def check_grads(ref, subs, names=None):
    """Traced stages keep the root model's parameter names; manual ones are `layers.i`."""
    for i, sub in enumerate(subs):
        theirs = ref if names is None else ref.get_submodule(names[i])
        mine = dict(sub.named_parameters())
        assert_grads_close(mine, {n: theirs.get_parameter(n) for n in mine}, msg=names[i] if names else "")


def zero(subs):
    for s in subs:
        s.zero_grad()


def run_steps(sched, rank, world, x, target, iters=2, subs=(), **kw):
    out, losses = None, []
    for _ in range(iters):
        zero(subs)
        if rank == 0:
            sched.step(x, **kw)
        elif rank == world - 1:
            out = sched.step(target=target, losses=losses)
        else:
            sched.step()
    return out, losses


MULTI = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble")
FIVE = ("ScheduleGPipe", "Schedule1F1B") + MULTI


def _cls(name):
    return getattr(zbpipe, name)


# ---- ScheduleTest (world 4) ---------------------------------------------------------------------

def t_forward_only(rank, world):
    mod, ref, x, _, _ = setup(world)
    x = x.clone()
    x_ref = x.clone()
    stage, _ = single_stage(rank, world, mod, x, 2 * world)
    sched = zbpipe.ScheduleInference(stage, 2 * world, scale_grads=False)
    out = None
    for _ in range(20):
        if rank == 0:
            sched.step(x)
            dist.recv(x, src=world - 1)
        elif rank == world - 1:
            out = sched.step()
            dist.send(out, dst=0)
        else:
            sched.step()
    if rank == world - 1:
        with torch.no_grad():
            for _ in range(20):
                x_ref = ref(x_ref)
        close(x_ref, out)


def _single_or_multi(rank, world, name, n_mb):
    if name in MULTI:
        mod, ref, x, target, loss_fn = setup(world, 2 * world)
        stages, subs, names = multi_stage(rank, world, mod, 2 * world)
        return _cls(name)(stages, n_mb, loss_fn=loss_fn, scale_grads=False), subs, x, target
    mod, ref, x, target, loss_fn = setup(world)
    stage, sub = single_stage(rank, world, mod, x, n_mb)
    return _cls(name)(stage, n_mb, loss_fn=loss_fn, scale_grads=False), [sub], x, target


def t_eval_inference_mode(rank, world, name):
    sched, subs, x, target = _single_or_multi(rank, world, name, 4)
    zero(subs)
    losses = []
    if rank == 0:
        with torch.no_grad():  # with and without no_grad
            sched.eval(x)
    elif rank == world - 1:
        sched.eval(target=target, losses=losses)
    else:
        sched.eval()
    assert not any(p.grad is not None for s in subs for p in s.parameters()), "eval() computed gradients"
    if rank == world - 1:
        assert len(losses) > 0, "eval() computed no losses"


def t_return_output(rank, world, name):
    sched, _, x, target = _single_or_multi(rank, world, name, 4)
    if rank == world - 1:
        out = sched.step(target=target, losses=[], return_outputs=False)
        assert out is None, "output should be None"
    else:
        sched.step(x)


def t_multi_iter(rank, world, name):
    mod, _, x, target, loss_fn = setup(world)
    stage, _ = single_stage(rank, world, mod, x, 4)
    sched = _cls(name)(stage, 4, loss_fn=loss_fn, scale_grads=False)
    run_steps(sched, rank, world, x, target, iters=20)
    dist.barrier()


def t_kwargs_with_tracer(rank, world, name):
    torch.manual_seed(1)
    mod = KwargsModel(D_HID, splits=world)
    x, y, target = (torch.randn(BATCH, D_HID) for _ in range(3))
    loss_fn = nn.MSELoss(reduction="sum")
    pipe = zbpipe.pipeline(mod, mb_args=(x.chunk(4)[0],), mb_kwargs={"y": y.chunk(4)[0]})
    sched = _cls(name)(pipe.build_stage(rank, "cpu"), 4, loss_fn=loss_fn, scale_grads=False)
    out, losses = run_steps(sched, rank, world, x, target, iters=1, y=y)
    dist.barrier()
    if rank == world - 1:
        ref_out = mod(x, y=y)
        close(out, ref_out)
        close(sum(losses), loss_fn(ref_out, target))


def t_grad_with_tracer(rank, world, name):
    mod, ref, x, target, loss_fn = setup(world)
    ref_out, ref_loss = reference(ref, x, target, loss_fn)
    stage, sub = single_stage(rank, world, mod, x, 2 * world)
    sched = _cls(name)(stage, 2 * world, loss_fn=loss_fn, scale_grads=False)
    out, losses = run_steps(sched, rank, world, x, target, subs=[sub])
    if rank == world - 1:
        close(out, ref_out)
        close(sum(losses), ref_loss)
    check_grads(ref, [sub])


def t_grad_with_manual(rank, world, name, shape_inference):
    mod, ref, x, target, loss_fn = setup(world)
    ref_out, ref_loss = reference(ref, x, target, loss_fn)
    chunks = 2 * world
    stage, sub = single_stage(rank, world, mod, x, chunks, tracer=False)
    if not shape_inference:
        inp = (x.chunk(chunks)[0],)
        with torch.no_grad():
            outp = sub(*inp)
        stage = zbpipe.PipelineStage(sub, rank, world, "cpu", input_args=inp, output_args=outp)
    sched = _cls(name)(stage, chunks, loss_fn=loss_fn, scale_grads=False)
    out, losses = run_steps(sched, rank, world, x, target, subs=[sub])
    if rank == world - 1:
        close(out, ref_out)
        close(sum(losses), ref_loss)
    check_grads(ref, [sub], [f"layers.{rank}"])


def t_grad_with_manual_interleaved(rank, world, name):
    n_stages = 2 * world
    mod, ref, x, target, loss_fn = setup(world, n_stages)
    ref_out, ref_loss = reference(ref, x, target, loss_fn)
    stages, subs, names = multi_stage(rank, world, mod, n_stages)
    sched = _cls(name)(stages, 2 * world, loss_fn=loss_fn, scale_grads=False)
    out, losses = run_steps(sched, rank, world, x, target, subs=subs)
    if rank == world - 1:
        close(out, ref_out)
        close(sum(losses), ref_loss)
    check_grads(ref, subs, names)


def t_schedule_with_weight_update_mlp_e2e(rank, world):
    n_stages = 2 * world
    mod, ref, x, target, _ = setup(world, n_stages, StackedSelfDw)
    mod.toggle()
    loss_fn = nn.MSELoss()
    ref_out, ref_loss = reference(ref, x, target, loss_fn)
    indices = [rank + i * world for i in range(2)]
    calls = {i: 0 for i in indices}

    def builder_for(i):
        def dw_builder():
            def dw_runner():
                calls[i] += 1
                mod.get_submodule(f"layers.{i}").compute_dW()
            return dw_runner
        return dw_builder

    subs = [mod.get_submodule(f"layers.{i}") for i in indices]
    stages = [zbpipe.PipelineStage(s, i, n_stages, "cpu", dw_builder=builder_for(i)) for s, i in zip(subs, indices)]
    sched = zbpipe.ScheduleInterleavedZeroBubble(stages, 2, loss_fn=loss_fn)
    out, losses = run_steps(sched, rank, world, x, target, subs=subs)
    if rank == world - 1:
        close(out, ref_out)
        close(sum(losses) / len(losses), ref_loss)
    check_grads(ref, subs, [f"layers.{i}" for i in indices])
    assert all(c == 4 for c in calls.values()), calls  # 2 microbatches x 2 steps


V_STAGES = {0: [0, 7], 1: [1, 6], 2: [2, 5], 3: [3, 4]}


def _v_run(sched, rank, x, target, subs):
    out, losses = None, []
    for _ in range(2):
        zero(subs)
        if rank == 0:
            out = sched.step(x, target=target, losses=losses)
        else:
            sched.step()
    return out, losses


def t_v_shape_schedules(rank, world, name):
    mod, ref, x, target, loss_fn = setup(world, 8)
    ref_out, ref_loss = reference(ref, x, target, loss_fn)
    stages, subs, names = multi_stage(rank, world, mod, 8, V_STAGES[rank])
    sched = _cls(name)(stages, 8, loss_fn=loss_fn, scale_grads=False)
    out, losses = _v_run(sched, rank, x, target, subs)
    if rank == 0:
        close(out, ref_out)
        close(sum(losses), ref_loss)
    check_grads(ref, subs, names)


def t_custom_function_callback(rank, world):
    from torch.distributed.pipelining.schedules import FORWARD, OVERLAP_F_B

    mod, ref, x, target, loss_fn = setup(world, 8)
    ref_out, ref_loss = reference(ref, x, target, loss_fn)
    stages, subs, names = multi_stage(rank, world, mod, 8, V_STAGES[rank])
    sched = zbpipe.ScheduleDualPipeV(stages, 8, loss_fn=loss_fn, scale_grads=False)
    forward_calls, overlap_calls = [], []

    def forward_callback(action, ctx):
        assert ctx.schedule_ref is sched
        forward_calls.append((action.stage_index, action.microbatch_index))
        ctx.run(action)

    def overlap_callback(action, ctx):
        fwd, bwd = action.sub_actions
        forward_callback(fwd, ctx)
        overlap_calls.append((fwd.stage_index, fwd.microbatch_index, bwd.stage_index, bwd.microbatch_index))
        ctx.run(bwd)

    sched.register_custom_function(FORWARD, forward_callback)
    sched.register_custom_function(OVERLAP_F_B, overlap_callback)
    out, losses = _v_run(sched, rank, x, target, subs)
    dist.barrier()
    if rank == 0:
        close(out, ref_out)
        close(sum(losses), ref_loss)
        assert len(overlap_calls) > 0, "OVERLAP_F_B callback never ran"
        assert len(forward_calls) == 8 * 2 * 2, len(forward_calls)  # microbatches x stages x loops
    assert all(s in V_STAGES[rank] for s, _ in forward_calls)
    check_grads(ref, subs, names)


def t_zero_bubble_with_model_kwargs(rank, world, name):
    n_stages = 2 * world
    mod, ref, x, target, loss_fn = setup(world, n_stages, StackedMLPKwargs)
    unused = torch.tensor([1.0])
    ref_out, ref_loss = reference(ref, x, target, loss_fn, unused_kwarg=unused)
    stages, subs, names = multi_stage(rank, world, mod, n_stages)
    n_mb = 2 * world
    sched = _cls(name)(stages, n_mb, loss_fn=loss_fn, scale_grads=False)
    out, losses = run_steps(sched, rank, world, x, target, subs=subs,
                            unused_kwarg=unused.clone().unsqueeze(0).expand(n_mb, -1))
    if rank == world - 1:
        close(out, ref_out)
        close(sum(losses), ref_loss)
    check_grads(ref, subs, names)


class SkipModel(nn.Module):
    """Not from torch: a skip connection across two stage boundaries and a model input used by
    the last stage only, so zbpipe's stages must forward both."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D_HID, D_HID) for _ in range(4))

    def forward(self, x, y):
        h0 = torch.tanh(self.lins[0](x))
        zbpipe.pipe_split()
        h1 = torch.tanh(self.lins[1](h0))
        zbpipe.pipe_split()
        h2 = torch.tanh(self.lins[2](h1)) + h0
        zbpipe.pipe_split()
        return self.lins[3](h2) - y


def t_tracer_forwards_skips_and_inputs(rank, world):
    torch.manual_seed(7)
    mod = SkipModel()
    ref = copy.deepcopy(mod)
    x, y, target = (torch.randn(BATCH, D_HID) for _ in range(3))
    loss_fn = nn.MSELoss(reduction="sum")
    ref_out, ref_loss = reference(ref, x, target, loss_fn, iters=1, y=y)
    pipe = zbpipe.pipeline(mod, mb_args=(x.chunk(4)[0], y.chunk(4)[0]))
    assert pipe.num_stages == world
    sub = pipe.get_stage_module(rank)
    for name in ("Schedule1F1B", "ScheduleZBH1"):  # full backward and the I/W split
        sched = _cls(name)(pipe.build_stage(rank, "cpu"), 4, loss_fn=loss_fn, scale_grads=False)
        out, losses = run_steps(sched, rank, world, x, target, iters=1, subs=[sub], y=y)
        if rank == world - 1:
            close(out, ref_out)
            close(sum(losses), ref_loss)
        check_grads(ref, [sub])


WORLD4 = {"test_forward_only[ScheduleInference]": (t_forward_only, ()),
          "zbpipe_tracer_forwards_skips_and_inputs": (t_tracer_forwards_skips_and_inputs, ())}
for _n in FIVE:
    WORLD4[f"test_eval_inference_mode[{_n}]"] = (t_eval_inference_mode, (_n,))
for _n in FIVE:
    WORLD4[f"test_return_output[{_n}]"] = (t_return_output, (_n,))
for _n in ("ScheduleGPipe", "Schedule1F1B"):
    WORLD4[f"test_multi_iter[{_n}]"] = (t_multi_iter, (_n,))
    WORLD4[f"test_kwargs_with_tracer[{_n}]"] = (t_kwargs_with_tracer, (_n,))
    WORLD4[f"test_grad_with_tracer[{_n}]"] = (t_grad_with_tracer, (_n,))
    for _si in (True, False):
        WORLD4[f"test_grad_with_manual[{_n}-shape_inference={_si}]"] = (t_grad_with_manual, (_n, _si))
for _n in MULTI:
    WORLD4[f"test_grad_with_manual_interleaved[{_n}]"] = (t_grad_with_manual_interleaved, (_n,))
WORLD4["test_schedule_with_weight_update_mlp_e2e[ScheduleInterleavedZeroBubble]"] = (t_schedule_with_weight_update_mlp_e2e, ())
for _n in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
    WORLD4[f"test_v_shape_schedules[{_n}]"] = (t_v_shape_schedules, (_n,))
WORLD4["test_custom_function_callback"] = (t_custom_function_callback, ())
for _n in ("ScheduleInterleavedZeroBubble", "ScheduleInterleaved1F1B"):
    WORLD4[f"test_zero_bubble_with_model_kwargs[{_n}]"] = (t_zero_bubble_with_model_kwargs, (_n,))


# ---- d9d test_e2e (world 4) ---------------------------------------------------------------------

class _Matmul(torch.autograd.Function):
    """d9d's CustomMatmul, both gradients (d9d splits them by a global direction context)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = g @ b.t() if ctx.needs_input_grad[0] else None
        gb = a.t() @ g if ctx.needs_input_grad[1] else None
        return ga, gb


class D9dStage(nn.Module):
    """d9d's PipelineModel: dict out, x passed along, y a keyword input of every stage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(42)
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(8, 8) / 4) for _ in range(3))
        self.act = nn.GELU()

    def forward(self, x, y):
        r = _Matmul.apply(x, self.w1) * 1.05
        r = self.act(r @ self.w2) + y
        return {"x": _Matmul.apply(r, self.w3)}


D9D_CONFIGS = {  # d9d's schedule configuration -> (zbpipe schedule, stages per rank)
    "GPipe": ("gpipe", 1), "LoopedBFS-1": ("looped_bfs", 1), "LoopedBFS-2": ("looped_bfs", 2),
    "1F1B-1": ("1f1b", 1), "1F1B-2": ("interleaved_1f1b", 2), "1F1B-2-zb": ("interleaved_zb", 2),
    "ZeroBubbleV": ("zbv", 2), "DualPipeV": ("dualpipev", 2),
}
D9D_MICROBATCHES = (1, 2, 4, 8, 16, 32)


def _d9d_loss(out, _target):
    return out["x"].sum()


def t_d9d_e2e(rank, world, config, n_mb, freeze_w1):
    name, spr = D9D_CONFIGS[config]
    n_stages = spr * world
    if name == "dualpipev" and n_mb < n_stages:
        return "skip"  # as d9d: DualPipeV needs microbatches >= stages
    torch.manual_seed(4242)
    x, y = torch.randn(128, 8), torch.randn(128, 8)
    mods = [D9dStage() for _ in range(n_stages)]
    for m in mods:
        m.w1.requires_grad_(not freeze_w1)
    h = x
    for m in mods:
        h = m(x=h, y=y)["x"]
    h.sum().backward()
    snapshot = [{k: None if p.grad is None else p.grad.clone() for k, p in m.named_parameters()} for m in mods]
    for m in mods:
        m.zero_grad()
    counts = []
    for m in mods:
        c = {"w1": 0, "w2": 0, "w3": 0}
        for k, p in m.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p, k=k, c=c: c.__setitem__(k, c[k] + 1))
        counts.append(c)
    sched, mine = rank_schedule(name, mods, rank, world, n_mb, stages_per_rank=spr, loss_fn=_d9d_loss,
                                scale_grads=False)
    sched.step(*((x,) if 0 in mine else ()), target=torch.zeros(128) if n_stages - 1 in mine else None, y=y)
    assert x.grad is None and y.grad is None
    for s in range(n_stages):
        m, c = mods[s], counts[s]
        if s in mine:
            close({k: p.grad for k, p in m.named_parameters()}, snapshot[s], msg=f"stage {s}")
            assert c == {"w1": 0 if freeze_w1 else n_mb, "w2": n_mb, "w3": n_mb}, (s, c)
        else:
            assert all(p.grad is None for p in m.parameters()) and c == {"w1": 0, "w2": 0, "w3": 0}


D9D = {f"d9d_test_e2e[{c}-{m}-freeze_w1={f}]": (t_d9d_e2e, (c, m, f))
       for c in D9D_CONFIGS for m in D9D_MICROBATCHES for f in (True, False)}


# ---- CustomSchedulesTest (world 2) and DualPipe's example_dualpipev ---------------------------

CUSTOM = {  # after schedule_registry.py: stage -> rank and each rank's actions
    "ScheduleVShaped": ([0, 1, 1, 0], 1, [["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]]),
    "ScheduleUnbalanced": ([0, 0, 1, 1, 0], 1, [["0F0", "1F0", "4F0", "4B0", "1B0", "0B0"],
                                                ["2F0", "3F0", "3B0", "2B0"]]),
    # With communication written out: both sends after both forwards.
    "ScheduleWithReorderedB": ([0, 1], 2, [["0F0", "0F1", "0SEND_F0", "0SEND_F1", "0RECV_B0", "0RECV_B1", "0B0", "0B1"],
                                           ["1RECV_F0", "1RECV_F1", "1F0", "1F1", "1B0", "1B1", "1SEND_B0", "1SEND_B1"]]),
    "ScheduleWithW": ([0, 1, 0, 1], 2, [["0F0", "0F1", "2F0", "2F1", "2I0", "2W0", "0I0", "2I1", "0W0", "0I1", "2W1", "0W1"],
                                        ["1F0", "1F1", "3F0", "3I0", "3F1", "1I0", "3I1", "3W0", "1I1", "1W0", "3W1", "1W1"]]),
}


def _custom_schedule(rank, name, steps=2, accumulate=False):
    s2r, n_mb, ranks = CUSTOM[name]
    n_stages = len(s2r)
    mod, ref, x, target, loss_fn = setup(2, n_stages)
    prog = zbpipe.Program.from_actions(ranks, s2r, n_mb, name)
    indices = [s for s in range(n_stages) if s2r[s] == rank]
    stages, subs, names = multi_stage(rank, 2, mod, n_stages, indices)
    sched = zbpipe.PipelineScheduleMulti.from_program(stages, prog, loss_fn=loss_fn, scale_grads=False)
    out, losses = None, []
    ref_out = ref_loss = None
    for _ in range(steps):
        if not accumulate:
            ref.zero_grad()
            zero(subs)
        ref_out = ref(x)
        ref_loss = loss_fn(ref_out, target)
        ref_loss.backward()
        args = (x,) if rank == s2r[0] else ()
        if s2r[-1] == rank:
            out = sched.step(*args, target=target, losses=losses)
        else:
            sched.step(*args)
    dist.barrier()
    if s2r[-1] == rank:
        close(out, ref_out.detach())
        close(sum(losses), ref_loss.detach())
    check_grads(ref, subs, names)


def t_non_symmetric_stage_ids(rank, world, name):
    _custom_schedule(rank, name)


def t_pipeline_schedule_runtime_custom_sched(rank, world, name):
    _custom_schedule(rank, name)


def t_schedule_with_native_zero_bubble(rank, world, name):
    _custom_schedule(rank, name, steps=4, accumulate=True)


class _DualPipeLinear(nn.Linear):
    def forward(self, x):
        return DualPipeLinearFunc.apply(x, self.weight)


class DualPipeStage(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.linear1 = _DualPipeLinear(hidden, 4 * hidden, bias=False)
        self.linear2 = _DualPipeLinear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(x)))


def t_example_dualpipev(rank, world):
    """example_dualpipev at pp=2 (the example's 20 chunks of 3, smaller sequence and hidden size):
    losses bitwise equal to the per-microbatch reference, gradients within its 1e-13 cosine
    bound, then an inference pass (eval under no_grad) with bitwise equal losses and outputs."""
    chunks, mb, seq, hidden = 20, 3, 8, 16
    torch.manual_seed(233)
    full = nn.Sequential(*[DualPipeStage(hidden) for _ in range(2 * world)])
    x = torch.randn(chunks * mb, seq, hidden)
    lab = torch.randn(chunks * mb, seq, hidden)

    def criterion(out, target):
        return F.mse_loss(out, target).clone()

    ys, ref_losses = [], []
    for cx, cl in zip(x.chunk(chunks), lab.chunk(chunks)):
        cy = full(cx)
        loss = criterion(cy, cl)
        loss.backward()
        ys.append(cy.detach())
        ref_losses.append(loss.detach())
    ref_out, ref_loss = torch.cat(ys), torch.stack(ref_losses)
    mine = [rank, 2 * world - 1 - rank]
    local = {}
    for s in mine:
        local[s] = DualPipeStage(hidden)
        local[s].load_state_dict(full[s].state_dict())
    stages = [zbpipe.PipelineStage(local[s], s, 2 * world, "cpu") for s in sorted(mine)]
    sched = zbpipe.ScheduleDualPipeV(stages, chunks, loss_fn=criterion, scale_grads=False)
    losses = []
    first = rank == 0
    out = sched.step(*((x,) if first else ()), target=lab if first else None, losses=losses, return_outputs=False)
    assert out is None
    if first:
        assert torch.equal(torch.stack(losses), ref_loss)

    def cal_diff(a, b):
        a, b = a.double(), b.double()
        return 1 - 2 * (a * b).sum().item() / (a * a + b * b).sum().item()

    for s in mine:
        for p, q in zip(local[s].parameters(), full[s].parameters()):
            assert cal_diff(p.grad, q.grad) < 1e-13, (s, cal_diff(p.grad, q.grad))
    for s in mine:
        local[s].zero_grad()
    with torch.no_grad():
        out = sched.eval(*((x,) if first else ()), target=lab if first else None, losses=losses)
    if first:
        assert torch.equal(torch.stack(losses), ref_loss)
        assert torch.equal(out, ref_out)
    else:
        assert out is None


WORLD2 = {}
for _n in ("ScheduleVShaped", "ScheduleUnbalanced"):
    WORLD2[f"test_non_symmetric_stage_ids[{_n}]"] = (t_non_symmetric_stage_ids, (_n,))
WORLD2["test_pipeline_schedule_runtime_custom_sched[ScheduleWithReorderedB]"] = (t_pipeline_schedule_runtime_custom_sched, ("ScheduleWithReorderedB",))
WORLD2["test_schedule_with_native_zero_bubble[ScheduleWithW]"] = (t_schedule_with_native_zero_bubble, ("ScheduleWithW",))
WORLD2["dualpipe_example_dualpipev[pp=2]"] = (t_example_dualpipev, ())


# ---- test_schedule.py ScheduleTest (world 1) ---------------------------------------------------

SINGLE_STAGE = ("Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                "ScheduleLoopedBFS")


def _ce(out, target):
    return F.cross_entropy(out, target)


def _one_stage(name, mod):
    stage = zbpipe.PipelineStage(mod.get_submodule("layers.0"), 0, 1, "cpu")
    cls = _cls(name)
    return cls(stage if issubclass(cls, zbpipe.PipelineScheduleSingle) else [stage], 2, loss_fn=_ce)


def t_schedule_with_single_stage(rank, world, name):
    torch.manual_seed(5)
    mod = StackedMLP(D_HID, 1)
    ref = copy.deepcopy(mod)
    x = torch.randn(BATCH, D_HID)
    with torch.no_grad():
        target = ref(x) + torch.randn(BATCH, D_HID)
    ref_out, ref_loss = reference(ref, x, target, _ce)
    sched = _one_stage(name, mod)
    sub = mod.get_submodule("layers.0")
    for _ in range(2):
        sub.zero_grad()
        losses = []
        out = sched.step(x, target=target, losses=losses)
    close(out, ref_out)
    close(torch.stack(losses).mean(), ref_loss)
    check_grads(ref, [sub], ["layers.0"])


def t_schedule_eval_then_train(rank, world, name):
    torch.manual_seed(6)
    mod = StackedMLP(D_HID, 1)
    x, target = torch.randn(BATCH, D_HID), torch.randn(BATCH, D_HID)
    sched = _one_stage(name, mod)
    for _ in range(2):
        mod.zero_grad()
        sched.eval(x, target=target, losses=[])
    for _ in range(2):
        sched.step(x, target=target, losses=[])


WORLD1 = {}
for _n in SINGLE_STAGE:
    WORLD1[f"test_schedule_with_single_stage[{_n}]"] = (t_schedule_with_single_stage, (_n,))
for _n in SINGLE_STAGE:
    WORLD1[f"test_schedule_eval_then_train[{_n}]"] = (t_schedule_eval_then_train, (_n,))


# ---- running the worlds ---------------------------------------------------------------------

def _case(rank, world, table, case):
    fn, args = globals()[table][case]
    return fn(rank, world, *args)


def _check(world, table, case):
    verdicts = world.run(_case, table, case, timeout_s=300)
    if all(v == "skip" for v in verdicts):
        pytest.skip("the source test skips this configuration")
    assert verdicts == [None] * world.size, verdicts


@pytest.mark.parametrize("case", list(WORLD4))
def test_schedule_multiproc(spawn_world, case):
    _check(spawn_world(4), "WORLD4", case)


@pytest.mark.parametrize("case", list(D9D))
def test_d9d_e2e(spawn_world, case):
    _check(spawn_world(4), "D9D", case)


@pytest.mark.parametrize("case", list(WORLD2))
def test_custom_schedules_and_dualpipev(spawn_world, case):
    _check(spawn_world(2), "WORLD2", case)


@pytest.mark.parametrize("case", list(WORLD1))
def test_schedule_single_process(spawn_world, case):
    _check(spawn_world(1), "WORLD1", case)


def test_get_schedule_class():
    for name in ("1F1B", "1f1b", "Interleaved1F1B", "INTERLEAVED1F1B", "GPipe", "LoopedBFS",
                 "PipelineScheduleSingle", "PipelineScheduleMulti"):
        assert issubclass(zbpipe.get_schedule_class(name), zbpipe.PipelineSchedule), name
    with pytest.raises(ValueError, match="ScheduleThatDoesNotExist"):
        zbpipe.get_schedule_class("ScheduleThatDoesNotExist")


# ---- test_pipe.py (in process) -------------------------------------------------------------

class PipeExample(nn.Module):
    """test_pipe's ExampleCode: a parameter used in two stages and a skip connection that
    crosses two stage boundaries."""

    def __init__(self):
        super().__init__()
        self.p1 = nn.Parameter(torch.randn(D_HID, D_HID) / D_HID ** 0.5)
        self.p2 = nn.Parameter(torch.randn(D_HID, D_HID) / D_HID ** 0.5)
        self.lin1, self.lin2 = nn.Linear(D_HID, D_HID), nn.Linear(D_HID, D_HID)

    def forward(self, x, y):
        x = x @ self.p1
        skip = x
        x = torch.relu(x + y)
        zbpipe.pipe_split()
        x = self.lin1(x @ self.p1)
        zbpipe.pipe_split()
        x = (torch.relu(x) + skip) @ self.p2
        zbpipe.pipe_split()
        return torch.relu(self.lin2(x))


class PipeMLP(nn.Module):
    """test_pipe's MultiMLP: a second model input used only by the last stage."""

    def __init__(self):
        super().__init__()
        self.mlps = nn.ModuleList(MLPBlock(D_HID) for _ in range(4))

    def forward(self, x, y):
        for i, m in enumerate(self.mlps):
            if i:
                zbpipe.pipe_split()
            x = m(x)
        return x - y


class PipeParamAlias(nn.Module):
    """model_registry's ModelWithParamAlias: two attribute names for one parameter / module."""

    def __init__(self):
        super().__init__()
        self.mm_param1 = self.mm_param0 = nn.Parameter(torch.randn(D_HID, D_HID) / D_HID ** 0.5)
        self.lin1 = self.lin0 = nn.Linear(D_HID, D_HID)

    def forward(self, x, y):
        x = torch.relu(self.lin0(x @ self.mm_param0 + y))
        zbpipe.pipe_split()
        return torch.relu(self.lin1(x @ self.mm_param1))


@pytest.mark.parametrize("model,n_stages", [(PipeExample, 4), (PipeMLP, 4), (PipeParamAlias, 2)])
def test_pipe_model_split(model, n_stages):
    torch.manual_seed(0)
    mod = model()
    x, y = torch.randn(BATCH, D_HID), torch.randn(BATCH, D_HID)
    pipe = zbpipe.pipeline(mod, mb_args=(x, y))
    assert pipe.num_stages == n_stages
    close(pipe(x, y)[0], mod(x, y))  # through zbpipe's routing between adjacent stages
    old = set(mod.state_dict())
    for i in range(pipe.num_stages):
        assert set(pipe.get_stage_module(i).state_dict()) <= old
