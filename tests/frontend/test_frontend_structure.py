"""The Python front end's structure, as behaviour: schedule classes are class statements that
help() and inspect show; from_program builds through the class's own __init__; a step's data
travels through the executor's call (the stages hold nothing of a step afterwards, and no step
data outlives it); a user error in a stage's forward is reported once; the executor takes its
options as keywords only; Program's names (strings vs values, path vs text). One in-process
loopback rank (zbpipe._C._LoopbackWorld), so every case is fast. Also the executor's options
declared once (their keywords, defaults and docs on every schedule), the stage interface the
runtime calls (StageInterface), and Program equality."""

from __future__ import annotations

import gc
import inspect
import pydoc
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zbpipe
from zbpipe import _C
from zbpipe.schedules import _class_for
from zbpipe.stage import StepData
from zbpipe.stage_interface import StageInterface

SCHEDULE_CLASSES = [
    zbpipe.ScheduleGPipe, zbpipe.Schedule1F1B, zbpipe.ScheduleLoopedBFS, zbpipe.ScheduleInterleaved1F1B,
    zbpipe.ScheduleInterleavedZeroBubble, zbpipe.ScheduleZBVZeroBubble, zbpipe.ScheduleDualPipeV,
    zbpipe.ScheduleZBH1, zbpipe.ScheduleZBH2, zbpipe.ScheduleZBAuto, zbpipe.ScheduleVHalf,
    zbpipe.ScheduleVMin, zbpipe.ScheduleInference,
]


def _stages(num_stages: int, **stage_kwargs):
    """Every stage on the one rank of a loopback world (kept alive by the stages' group)."""
    torch.manual_seed(0)
    world = _C._LoopbackWorld(1)
    mods = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(num_stages)]
    stages = [zbpipe.PipelineStage(m, s, num_stages, "cpu", group=world.group(0), **stage_kwargs)
              for s, m in enumerate(mods)]
    return world, stages


# ---- classes -------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", SCHEDULE_CLASSES, ids=lambda c: c.__name__)
def test_schedule_classes_are_class_statements_help_shows(cls):
    source = inspect.getsource(cls)  # OSError for a class made by type()
    base = cls.__mro__[1]
    assert source.startswith(f"class {cls.__name__}({base.__name__}, schedule=\"{cls.schedule}\""), source
    assert inspect.getsourcefile(cls).endswith("zbpipe/schedules.py")
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert f"class {cls.__name__}({base.__name__})" in text, text[:400]
    assert cls.__doc__ and cls.__doc__ in text


def test_help_of_zbh1_shows_class_base_and_doc():
    text = pydoc.render_doc(zbpipe.ScheduleZBH1, renderer=pydoc.plaintext)
    assert "class ScheduleZBH1(PipelineScheduleSingle)" in text
    assert "Zero bubble H1 (1F1B memory)." in text
    assert "from_program(stages, program" in text  # a classmethod, inherited from the base


def test_a_compile_name_without_a_class_gets_a_real_subclass():
    cls = _class_for("zbv")
    assert issubclass(cls, zbpipe.PipelineSchedule) and cls.schedule == "zbv"
    assert cls.__name__ == "Schedule_zbv" and cls.__doc__ == "zbpipe 'zbv' schedule."
    assert zbpipe.PipelineSchedule.schedule == ""  # the base keeps no name


def test_from_program_runs_the_subclass_init():
    class Tagged(zbpipe.ScheduleGPipe):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tag = "init ran"

    _world, stages = _stages(2)
    prog = zbpipe.compile("looped_bfs", 1, 2, 2)
    sched = Tagged.from_program(stages, prog, loss_fn=F.mse_loss)
    assert sched.tag == "init ran" and sched.schedule == "looped_bfs" and sched.program is prog
    assert isinstance(inspect.getattr_static(zbpipe.PipelineSchedule, "from_program"), classmethod)


# ---- data through the call --------------------------------------------------------------

def _snapshot(stage) -> dict:
    return {k: (v, dict(v) if isinstance(v, dict) else None) for k, v in vars(stage).items()}


def _same(a: dict, b: dict) -> list[str]:
    diff = [k for k in a.keys() | b.keys() if k not in a or k not in b]
    diff += [k for k in a.keys() & b.keys() if a[k][0] is not b[k][0] or a[k][1] != b[k][1]]
    return sorted(diff)


@pytest.mark.parametrize("stage_kwargs", [{}, {"deferred_linear": True}], ids=["split", "deferred_linear"])
@pytest.mark.parametrize("name", ["zbv", "1f1b"])
def test_a_step_leaves_no_state_on_the_stages(name, stage_kwargs):
    prog = zbpipe.compile(name, 1, 4)
    world, stages = _stages(prog.num_stages, **stage_kwargs)
    sched = zbpipe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], 4,
                                              loss_fn=F.mse_loss, timeout=20)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    losses: list = []
    sched.step(x, target=y, losses=losses)  # negotiates the shapes (the stages' shape cache)
    before = [_snapshot(s) for s in stages]
    out = sched.step(x * 2, target=y, losses=losses)
    assert [_same(b, _snapshot(s)) for b, s in zip(before, stages)] == [[]] * len(stages)
    gc.collect()
    assert [o for o in gc.get_objects() if type(o) is StepData] == []
    assert out.shape == (8, 8) and len(losses) == 4 and all(p.grad is not None for s in stages
                                                            for p in s.submod.parameters())


def test_run_returns_outputs_and_losses_of_the_step_it_was_given():
    prog = zbpipe.compile("gpipe", 1, 2)
    world, stages = _stages(1)
    ex = _C.Executor(prog, world.group(0), {0: stages[0]}, torch.device("cpu"), timeout_s=20)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    step = StepData(train=True, args=[(c,) for c in x.chunk(2)], targets=list(y.chunk(2)), loss_fn=F.mse_loss)
    outputs, losses = ex.run(step, zbpipe.stage.input_signature(step), 0.5)
    want = stages[0].submod(x).detach()
    torch.testing.assert_close(torch.cat(outputs), want)
    torch.testing.assert_close(torch.stack(losses), torch.stack([F.mse_loss(o, t) for o, t in
                                                                 zip(want.chunk(2), y.chunk(2))]))
    step = StepData(train=False, args=step.args, keep_outputs=False)  # no loss, nothing kept
    assert ex.run(step, zbpipe.stage.input_signature(step)) == ([None, None], [None, None])


# ---- a user error is reported once ----------------------------------------------------------

CODE = "7f3a"  # the message's marker, not spelled in the raising line (the traceback shows it)


class _Failing(nn.Module):
    def __init__(self, error):
        super().__init__()
        self.lin, self.error = nn.Linear(8, 8), error

    def forward(self, x):
        raise self.error(f"user error {CODE} in the stage")


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_a_user_error_in_the_forward_appears_once(error):
    world = _C._LoopbackWorld(1)
    stage = zbpipe.PipelineStage(_Failing(error), 0, 1, "cpu", group=world.group(0))
    sched = zbpipe.ScheduleGPipe(stage, 2, loss_fn=F.mse_loss, timeout=20)
    with pytest.raises(zbpipe.PipelineError) as info:
        sched.step(torch.randn(4, 8), target=torch.randn(4, 8))
    text = str(info.value)
    assert text.count("user error 7f3a") == 1, text
    assert f"{error.__name__}: user error 7f3a" in text


class _NoMeta(nn.Module):
    """Runs only on real data (.item()), so shape inference falls back to a real forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * (1.0 if x.abs().sum().item() >= 0 else 0.0)


def test_a_module_meta_tensors_cannot_run_infers_its_shapes_for_real():
    world = _C._LoopbackWorld(1)
    torch.manual_seed(0)
    mod = _NoMeta()
    stage = zbpipe.PipelineStage(mod, 0, 1, "cpu", group=world.group(0))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out = zbpipe.ScheduleGPipe(stage, 2, loss_fn=F.mse_loss, timeout=20).step(x, target=y)
    torch.testing.assert_close(out, mod(x).detach())


# ---- interfaces ----------------------------------------------------------------------------

def test_executor_options_are_keyword_only():
    prog = zbpipe.compile("gpipe", 1, 2)
    world, stages = _stages(1)
    args = (prog, world.group(0), {0: stages[0]}, torch.device("cpu"))
    with pytest.raises(TypeError):
        _C.Executor(*args, 20.0)
    assert _C.Executor(*args, timeout_s=20.0, static_shapes=True).rank == 0


def test_executor_options_are_declared_once_and_passed_whole():
    """Every field of _C.ExecutorOptions is a keyword of every schedule class with the C++
    default (timeout_s as timeout) and its doc; a schedule gathers them into one ExecutorOptions
    that its runner passes whole to each executor."""
    defaults = _C.ExecutorOptions()
    assert defaults.timeout_s == 300.0 and defaults.prepost_receives is None and defaults.overlap_f_b is True
    for cls in SCHEDULE_CLASSES:
        params = inspect.signature(cls).parameters
        for field in _C.ExecutorOptions.fields:
            name = "timeout" if field == "timeout_s" else field
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (cls, name)
            assert params[name].default == getattr(defaults, field), (cls, name)
            assert f"{name}: {getattr(_C.ExecutorOptions, field).__doc__.split()[0]}" in zbpipe.PipelineSchedule.__doc__
    world, stages = _stages(1)
    sched = zbpipe.ScheduleGPipe(stages[0], 2, loss_fn=F.mse_loss, timeout=20, static_shapes=True, defer_pp_recv=True)
    assert repr(sched._runner.options) == repr(_C.ExecutorOptions(timeout_s=20.0, static_shapes=True,
                                                                  prepost_receives=False))
    for wrong in ("timeout_s", "no_such_option"):
        with pytest.raises(TypeError, match=f"^ScheduleGPipe\\(\\) got an unexpected keyword argument '{wrong}'$"):
            zbpipe.ScheduleGPipe(stages[0], 2, loss_fn=F.mse_loss, **{wrong: 1})
    with pytest.raises(TypeError, match="^ExecutorOptions: timeout_s must be a number of seconds, got str 'x'$"):
        _C.ExecutorOptions(timeout_s="x")


def test_the_stage_interface_lists_what_the_runtime_calls():
    """StageInterface's members are exactly the names PyStage looks up on a stage
    (csrc/python/py_stage.cpp), and a PipelineStage has them all."""
    source = (Path(__file__).resolve().parents[2] / "csrc" / "python" / "py_stage.cpp").read_text()
    called = set(re.findall(r'"(_zb_\w+)"', source))
    declared = {name for name in vars(StageInterface) if name.startswith("_zb_")}
    assert called and called == declared, (sorted(called), sorted(declared))
    world, stages = _stages(1)
    assert isinstance(stages[0], StageInterface) and not isinstance(nn.Linear(2, 2), StageInterface)


def test_programs_are_equal_by_what_they_do():
    """Program equality and hash follow the fingerprint (topology, microbatches, actions), not the
    name: a program rebuilt equals it, another schedule's does not, a renamed copy does."""
    prog = zbpipe.compile("zb_h1", 2, 4)
    same = zbpipe.Program.from_csv_text(prog.to_csv_text())
    assert same.schedule != prog.schedule and same == prog and hash(same) == hash(prog)
    assert same.fingerprint == prog.fingerprint and prog.fingerprint.startswith("pp=2 stages=2 microbatches=4 ")
    other = zbpipe.compile("1f1b", 2, 4)
    assert other != prog and other.fingerprint != prog.fingerprint and prog != "zb_h1"
    assert {prog: 1, same: 2, other: 3} == {prog: 2, other: 3}


def test_program_names_strings_values_paths_text(tmp_path):
    prog = zbpipe.compile("zbv", 2, 4)
    for r in range(prog.pp):
        assert [str(a) for a in prog.action_values(r)] == prog.actions(r)
        assert prog.compute_actions(r) == [str(a) for a in prog.action_values(r) if a.is_compute]
    path = str(tmp_path / "zbv.csv")
    prog.to_csv(path)
    with open(path, newline="") as f:
        assert f.read() == prog.to_csv_text()
    for back in (zbpipe.Program.from_csv(path), zbpipe.Program.from_csv_text(prog.to_csv_text())):
        assert [back.actions(r) for r in range(2)] == [prog.actions(r) for r in range(2)]
    for old in ("rank_actions", "csv"):
        assert not hasattr(prog, old)


# ---- the package's layout ------------------------------------------------------------------

def test_the_tuning_modules_old_paths_are_the_same_modules():
    import importlib

    from zbpipe import tuning

    for name in tuning.MODULES:
        old, new = importlib.import_module(f"zbpipe.{name}"), importlib.import_module(f"zbpipe.tuning.{name}")
        assert old is new and getattr(zbpipe, name) is new, name
        assert Path(new.__file__).parent.name == "tuning" and not (Path(zbpipe.__file__).parent / f"{name}.py").exists()
    from zbpipe.schedule_auto import ScheduleAuto
    from zbpipe.stage_costs import profile_from_trace

    assert ScheduleAuto is zbpipe.ScheduleAuto and profile_from_trace is zbpipe.profile_from_trace


def _private_imports(path: Path) -> list[str]:
    """`from .x import _y` and `x._y` on a zbpipe module x, in one file (package-private
    modules such as _C and _tree are modules, not a module's private names)."""
    import ast

    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("zbpipe")):
            base = Path(path).parent.joinpath(*[".."] * (node.level - 1), *(node.module or "").split("."))
            for alias in node.names:
                is_module = any(base.glob(f"{alias.name}.*")) or (base / alias.name).is_dir()  # _C: a .so
                if is_module:
                    modules.add(alias.asname or alias.name)
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.value.id != "_C" and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_of_zbpipe_uses_another_ones_private_names():
    root = Path(zbpipe.__file__).parent
    assert [f for p in sorted(root.rglob("*.py")) for f in _private_imports(p)] == []
