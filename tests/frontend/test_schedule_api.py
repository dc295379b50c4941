"""torch.distributed.pipelining's schedule API with torch's semantics, on zbpipe's classes:
loss_kwargs reach the loss only, step(return_outputs=False), losses cleared and refilled,
step under no_grad raising, eval() (forward only, outputs on the last stage, no gradients, then
training again), PipelineStage(dw_builder=), register_custom_function (torch's callback
arguments, F and OVERLAP_F_B, bad callbacks), the stages' group check, uneven stage layouts
through from_program, interleaved schedules with one stage per rank, torch's base-class names.

Every multi-process case is a test in the module's one spawned Gloo world of 2 ranks.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from helpers.asserts import assert_close, assert_grads_close
from helpers.model_registry import build, call_chain, data

import zbpipe


def _grads_match(mods, ref, mine, msg="") -> None:
    assert_grads_close([mods[s] for s in mine], [ref[s] for s in mine], msg=msg)


def _ref(model, num_stages, x, y, loss=F.mse_loss, **kwargs):
    mods = build(model, num_stages)
    ref = copy.deepcopy(mods)
    out = call_chain(ref, x, **kwargs)
    l = loss(out, y)
    l.backward()
    return mods, ref, out.detach()


def _run(sched, rank, pp, x, y, num_stages, mine, **kw):
    args = (x,) if 0 in mine else ()
    return sched.step(*args, target=y if num_stages - 1 in mine else None, **kw)


# ---- cases: each runs on every rank; an AssertionError fails the test ---------------------------

def case_loss_kwargs(rank, pp):
    x, y = data("mlp", 8)
    mods, ref, _ = _ref("mlp", pp, x, y, loss=lambda o, t: 3.0 * F.mse_loss(o, t))

    def loss_fn(out, target, weight=1.0):
        return weight * F.mse_loss(out, target)

    sched = zbpipe.Schedule1F1B(zbpipe.PipelineStage(mods[rank], rank, pp, "cpu"), 4, loss_fn=loss_fn, timeout=20)
    losses = []
    _run(sched, rank, pp, x, y, pp, [rank], losses=losses, loss_kwargs={"weight": 3.0})
    if rank == pp - 1:
        want = [3.0 * F.mse_loss(o, t) for o, t in zip(call_chain(build("mlp", pp), x).chunk(4), y.chunk(4))]
        assert_close(losses, [w.detach() for w in want])
    _grads_match(mods, ref, [rank])


def case_return_outputs_false(rank, pp):
    x, y = data("mlp", 8)
    mods, ref, _ = _ref("mlp", pp, x, y)
    stage = zbpipe.PipelineStage(mods[rank], rank, pp, "cpu")
    kept = []
    detach = zbpipe.stage._detach

    def counting_detach(out):  # how the last stage keeps an output for step's return
        kept.append(out)
        return detach(out)

    sched = zbpipe.ScheduleZBH1(stage, 4, loss_fn=F.mse_loss, timeout=20)
    losses = []
    zbpipe.stage._detach = counting_detach
    try:
        out = _run(sched, rank, pp, x, y, pp, [rank], losses=losses, return_outputs=False)
    finally:
        zbpipe.stage._detach = detach
    assert out is None, f"step(return_outputs=False) returned {type(out).__name__}"
    if rank == pp - 1:
        assert len(losses) == 4 and not kept, f"{len(losses)} losses; {len(kept)} outputs kept"
    _grads_match(mods, ref, [rank])


def case_losses_cleared_and_refilled(rank, pp):
    x, y = data("mlp", 8)
    mods = build("mlp", pp)
    sched = zbpipe.Schedule1F1B(zbpipe.PipelineStage(mods[rank], rank, pp, "cpu"), 4, loss_fn=F.mse_loss, timeout=20)
    losses = [torch.tensor(123.0)]
    first = None
    for _ in range(2):
        _run(sched, rank, pp, x, y, pp, [rank], losses=losses)
        first = first or list(losses)
    if rank == pp - 1:
        assert len(losses) == 4 and not any(float(l) == 123.0 for l in losses), \
            f"after two steps losses has {len(losses)} entries: {losses}"
    else:
        assert len(losses) == 1, "a rank without the last stage touched losses"


def case_no_grad_step_raises(rank, pp):
    x, y = data("mlp", 8)
    mods, ref, _ = _ref("mlp", pp, x, y)
    sched = zbpipe.Schedule1F1B(zbpipe.PipelineStage(mods[rank], rank, pp, "cpu"), 4, loss_fn=F.mse_loss, timeout=20)
    with pytest.raises(RuntimeError, match=r"eval\(\)"), torch.no_grad():
        _run(sched, rank, pp, x, y, pp, [rank])
    # Nothing ran: the schedule is still usable and its gradients are exact.
    _run(sched, rank, pp, x, y, pp, [rank])
    _grads_match(mods, ref, [rank])


def case_eval_then_train(rank, pp):
    """eval() on training schedules (full B, I/W split, several stages per rank, V): forward
    only, outputs on the last stage, losses when a target is given, no gradient anywhere; then a
    training step is exact."""
    for name in ("1f1b", "zb_h1", "interleaved_zb", "zbv"):
        prog = zbpipe.compile(name, pp, 4)
        n_st, s2r = prog.num_stages, list(prog.stage_to_rank)
        mine = [s for s in range(n_st) if s2r[s] == rank]
        x, y = data("mlp", 8)
        mods, ref, ref_out = _ref("mlp", n_st, x, y)
        stages = [zbpipe.PipelineStage(mods[s], s, n_st, "cpu") for s in mine]
        sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], 4,
                                                loss_fn=F.mse_loss, timeout=20)
        losses = []
        args = (x,) if 0 in mine else ()
        tgt = y if n_st - 1 in mine else None
        with torch.no_grad() if rank == 0 else torch.enable_grad():  # with and without no_grad
            out = sched.eval(*args, target=tgt, losses=losses)
        assert not any(p.grad is not None for s in mine for p in mods[s].parameters()), \
            f"{name}: eval() computed gradients"
        if n_st - 1 in mine:
            assert_close(out, ref_out, msg=f"{name}: eval() output differs from the forward")
            want = [F.mse_loss(o, t) for o, t in zip(ref_out.chunk(4), y.chunk(4))]
            assert_close(losses, want, msg=f"{name}: eval() losses")
            assert sched.eval(*args, return_outputs=False) is None, f"{name}: eval(return_outputs=False) returned an output"
        else:
            assert out is None, f"{name}: eval() returned an output off the last stage"
            sched.eval(*args, return_outputs=False)
        _run(sched, rank, pp, x, y, n_st, mine)
        _grads_match(mods, ref, mine, msg=f"{name} after eval")


class _SelfGradLinear(torch.autograd.Function):
    """x @ w.T whose backward returns no weight gradient: it queues grad_output and x on the
    module, and the module's compute_dw() (run by the dw_builder's runner) adds it."""

    @staticmethod
    def forward(ctx, x, w, owner):
        ctx.save_for_backward(x, w)
        ctx.owner = owner
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.owner.pending.append((g.clone(), x))
        ctx.owner.log.append("backward")
        return g @ w, None, None


class _SelfGradStage(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)
        self.pending, self.log = [], log

    def forward(self, x, plain=False):
        if plain:
            return torch.tanh(x @ self.w.t())
        return torch.tanh(_SelfGradLinear.apply(x, self.w, self))

    def compute_dw(self):
        g, x = self.pending.pop(0)
        dw = g.t() @ x
        self.w.grad = dw if self.w.grad is None else self.w.grad + dw


def case_dw_builder(rank, pp):
    """torch's dw_builder: the full backward at B / I, dw_builder() right after it, its runner
    at W (at once after a B). Gradients exact for a split (zb_h1) and a full-B (1f1b) schedule."""
    for name in ("zb_h1", "1f1b"):
        torch.manual_seed(3)
        log: list[str] = []
        mods = [_SelfGradStage(log) for _ in range(pp)]
        ref = copy.deepcopy(mods)
        x, y = data("mlp", 8)
        h = x
        for m in ref:
            h = m(h, plain=True)
        F.mse_loss(h, y).backward()

        def builder(mod=mods[rank]):
            log.append("build")

            def runner():
                log.append("W")
                mod.compute_dw()
            return runner

        stage = zbpipe.PipelineStage(mods[rank], rank, pp, "cpu", dw_builder=builder)
        sched = zbpipe.get_schedule_class(name)(stage, 4, loss_fn=F.mse_loss, timeout=20)
        _run(sched, rank, pp, x, y, pp, [rank])
        # The log follows the program: I -> backward, build; B -> backward, build, W; W -> W.
        want = []
        for act in sched.program.action_values(rank):
            want += {zbpipe.Kind.I: ["backward", "build"], zbpipe.Kind.B: ["backward", "build", "W"],
                     zbpipe.Kind.W: ["W"]}.get(act.kind, [])
        assert log == want and log.count("W") == 4, f"{name}: events {log}, program order wants {want}"
        _grads_match(mods, ref, [rank], msg=name)
    with pytest.raises(ValueError):  # dw_builder with deferred_linear
        zbpipe.PipelineStage(mods[rank], rank, pp, "cpu", dw_builder=builder, deferred_linear=True)


def case_custom_function(rank, pp):
    """register_custom_function with torch's kinds and callback arguments on DualPipeV: the F
    and OVERLAP_F_B callbacks run every such action of this rank, through ctx.run, and the
    gradients stay exact."""
    from torch.distributed.pipelining.schedules import FORWARD, OVERLAP_F_B

    prog = zbpipe.compile("dualpipev", pp, 2 * pp)
    n_st, s2r, m = prog.num_stages, list(prog.stage_to_rank), 2 * pp
    mine = [s for s in range(n_st) if s2r[s] == rank]
    x, y = data("mlp", 2 * m)
    mods, ref, ref_out = _ref("mlp", n_st, x, y)
    sched = zbpipe.ScheduleDualPipeV([zbpipe.PipelineStage(mods[s], s, n_st, "cpu") for s in mine], m,
                                     loss_fn=F.mse_loss, timeout=20)
    fwd, overlap, seen_ctx = [], [], []

    def on_forward(action, ctx):
        fwd.append((action.stage_index, action.microbatch_index))
        seen_ctx.append(ctx.schedule_ref is sched and (ctx.arg_mbs is not None) == (0 in mine)
                        and (ctx.target_mbs is not None) == (n_st - 1 in mine))
        ctx.run(action)

    def on_overlap(action, ctx):
        f, b = action.sub_actions
        overlap.append(str(action))
        ctx.run(b)  # any order: the parts are independent
        ctx.run(f)

    sched.register_custom_function(FORWARD, on_forward)
    sched.register_custom_function(OVERLAP_F_B, on_overlap)
    out = sched.step(*((x,) if 0 in mine else ()), target=y if n_st - 1 in mine else None)
    acts = [a for a in prog.action_values(rank) if a.is_compute]
    want_f = [(a.stage, a.microbatch) for a in acts if a.kind == zbpipe.Kind.F]
    want_o = [str(a) for a in acts if a.kind == zbpipe.Kind.OVERLAP_F_B]
    assert fwd == want_f and overlap == want_o and want_o, \
        f"callbacks saw F {fwd} (want {want_f}), OVERLAP_F_B {overlap} (want {want_o})"
    assert all(seen_ctx), "ctx fields differ from torch's _PipelineContext"
    if n_st - 1 in mine:
        assert_close(out, ref_out)
    _grads_match(mods, ref, mine)


def case_custom_function_errors(rank, pp, own_group):
    """A callback that skips its part, one that raises, and a part run outside a callback fail
    clearly (on a one-rank pipeline per rank, so no peer waits)."""
    problems = []

    def attempt(fn, want):
        mod = build("mlp", 1)[0]
        sched = zbpipe.ScheduleGPipe(zbpipe.PipelineStage(mod, 0, 1, "cpu", group=own_group), 2,
                                     loss_fn=F.mse_loss, timeout=10)
        sched.register_custom_function(zbpipe.Kind.F, fn)
        x, y = data("mlp", 4)
        try:
            sched.step(x, target=y)
            problems.append(f"no error (want {want!r})")
        except zbpipe.PipelineError as e:
            if want not in str(e):
                problems.append(f"message lacks {want!r}: {str(e)[:300]}")

    attempt(lambda a, ctx: None, "returned without running its part '0F0'")

    def boom(a, ctx):
        raise ValueError("boom from the callback")
    attempt(boom, "boom from the callback")
    attempt(lambda a, ctx: ctx.run(zbpipe.Action.parse("0F1") if a.microbatch == 0 else a),
            "'0F1' is not a part of the action '0F0'")
    mod = build("mlp", 1)[0]
    sched = zbpipe.ScheduleGPipe(zbpipe.PipelineStage(mod, 0, 1, "cpu", group=own_group), 2,
                                 loss_fn=F.mse_loss, timeout=10)
    # The executor keeps the callback: it must not keep the schedule alive.
    sched.register_custom_function(zbpipe.Kind.F, lambda a, ctx: ctx.run(a))
    x, y = data("mlp", 4)
    sched.step(x, target=y)
    alive = weakref.ref(sched)
    del sched
    gc.collect()
    if alive() is not None:
        problems.append("a schedule with a custom function is never freed")
    sched = zbpipe.ScheduleGPipe(zbpipe.PipelineStage(mod, 0, 1, "cpu", group=own_group), 2,
                                 loss_fn=F.mse_loss, timeout=10)
    for bad in ("SEND_F", "UNSHARD"):
        try:
            sched.register_custom_function(bad, lambda a, c: None)
            problems.append(f"kind {bad} accepted")
        except ValueError:
            pass
    assert not problems, "; ".join(problems)


def case_group_check(rank, pp, other_group):
    """Stages on different process groups of the same size are refused."""
    mods = build("mlp", 2 * pp)
    a = zbpipe.PipelineStage(mods[rank], rank, 2 * pp, "cpu")
    b = zbpipe.PipelineStage(mods[rank + pp], rank + pp, 2 * pp, "cpu", group=other_group)
    with pytest.raises(ValueError, match="share one process group"):
        zbpipe.ScheduleInterleaved1F1B([a, b], 4, loss_fn=F.mse_loss)


def case_uneven_from_program(rank, pp):
    """5 stages on 2 ranks (stage -> rank 0, 0, 1, 1, 0), as torch's ScheduleUnbalanced, with
    two microbatches and a compute-only program lowered by from_actions."""
    s2r = [0, 0, 1, 1, 0]
    ranks = [["0F0", "1F0", "0F1", "1F1", "4F0", "4B0", "4F1", "4B1", "1B0", "0B0", "1B1", "0B1"],
             ["2F0", "3F0", "2F1", "3F1", "3B0", "2B0", "3B1", "2B1"]]
    prog = zbpipe.Program.from_actions(ranks, s2r, 2, "unbalanced")
    mine = [s for s in range(5) if s2r[s] == rank]
    x, y = data("mlp", 4)
    mods, ref, ref_out = _ref("mlp", 5, x, y)
    sched = zbpipe.PipelineScheduleMulti.from_program(
        [zbpipe.PipelineStage(mods[s], s, 5, "cpu") for s in mine], prog, loss_fn=F.mse_loss, timeout=20)
    out = sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
    if rank == 0:
        assert_close(out, ref_out)
    _grads_match(mods, ref, mine)


def case_interleaved_one_stage_per_rank(rank, pp):
    for cls in (zbpipe.ScheduleInterleaved1F1B, zbpipe.ScheduleInterleavedZeroBubble, zbpipe.ScheduleLoopedBFS):
        x, y = data("mlp", 8)
        mods, ref, _ = _ref("mlp", pp, x, y)
        sched = cls([zbpipe.PipelineStage(mods[rank], rank, pp, "cpu")], 4, loss_fn=F.mse_loss, timeout=20)
        _run(sched, rank, pp, x, y, pp, [rank])
        _grads_match(mods, ref, [rank], msg=cls.__name__)


def case_owner_accessors(rank, pp):
    """What an owner of several schedules (ScheduleAuto) reads and sets through public names:
    has_run, output_specs (the agreed boundary shapes), set_call_counts (the step a failure names)."""
    x, y = data("mlp", 8)
    mods, _, _ = _ref("mlp", pp, x, y)
    sched = zbpipe.Schedule1F1B(zbpipe.PipelineStage(mods[rank], rank, pp, "cpu"), 4, loss_fn=F.mse_loss, timeout=20)
    assert not sched.has_run
    with pytest.raises(RuntimeError, match="no step"):
        sched.output_specs(rank)
    _run(sched, rank, pp, x, y, pp, [rank])
    # A rank's step may end before its peer's (a Gloo send completes once handed over): rank 1's
    # failure below must not reach rank 0 while rank 0 still receives this step.
    torch.distributed.barrier()
    assert sched.has_run
    if rank == 0:  # stage 0 sends one (2, hidden) activation per microbatch
        out = mods[0](x.chunk(4)[0])
        assert sched.output_specs(0) == [(tuple(out.shape), out.dtype)]
    sched.set_call_counts(step=41)
    if rank == 1:  # the last stage's rank forgets the target: its peer learns which step failed
        with pytest.raises(ValueError, match="needs target"):
            sched.step()
    else:
        with pytest.raises(zbpipe.PipelineError, match="step 42"):
            _run(sched, rank, pp, x, y, pp, [rank])


CASES = [case_loss_kwargs, case_return_outputs_false, case_losses_cleared_and_refilled, case_no_grad_step_raises,
         case_eval_then_train, case_dw_builder, case_custom_function, case_group_check, case_uneven_from_program,
         case_interleaved_one_stage_per_rank, case_custom_function_errors, case_owner_accessors]


def _case(rank, pp, name):
    """Runs the case on this rank, with the groups it needs (every rank creates every group,
    in the same order: c10d's rule)."""
    import torch.distributed as dist

    fn = globals()[name]
    if name == "case_group_check":
        fn(rank, pp, dist.new_group(list(range(pp))))
    elif name == "case_custom_function_errors":
        fn(rank, pp, [dist.new_group([r]) for r in range(pp)][rank])
    else:
        fn(rank, pp)
    return name


@pytest.mark.parametrize("case", [c.__name__ for c in CASES], ids=lambda n: n.removeprefix("case_"))
def test_case(spawn_world, case):
    assert spawn_world(2).run(_case, case, timeout_s=240) == [case, case]


def test_base_class_names_resolve_as_torchs():
    assert zbpipe.get_schedule_class("PipelineScheduleSingle") is zbpipe.PipelineScheduleSingle
    assert zbpipe.get_schedule_class("PipelineScheduleMulti") is zbpipe.PipelineScheduleMulti
    for cls in (zbpipe.ScheduleGPipe, zbpipe.Schedule1F1B, zbpipe.ScheduleZBH1, zbpipe.ScheduleInference):
        assert issubclass(cls, zbpipe.PipelineScheduleSingle)
    for cls in (zbpipe.ScheduleLoopedBFS, zbpipe.ScheduleInterleaved1F1B, zbpipe.ScheduleZBVZeroBubble,
                zbpipe.ScheduleDualPipeV, zbpipe.ScheduleVMin):
        assert issubclass(cls, zbpipe.PipelineScheduleMulti)
    with pytest.raises(TypeError, match="base class"):
        zbpipe.PipelineScheduleMulti([], 4)


def test_actions_carry_torchs_attribute_names():
    a = zbpipe.Action.parse("(1F1;2B0)OVERLAP_F_B")
    assert (a.stage_index, a.microbatch_index, a.computation_type) == (a.stage, a.microbatch, a.kind)
    assert [str(s) for s in a.sub_actions] == ["1F1", "2B0"]
