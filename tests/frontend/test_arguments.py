"""Numbers and types checked at the door: non-finite costs are a ScheduleError in compile and
simulate; strings, dicts and other non-numbers are a one-line TypeError naming the parameter and
what it takes (not pybind11's dump of every signature, nor a string read as digits)."""

from __future__ import annotations

import collections
import math
import subprocess
import sys

import pytest

import zbpipe
from zbpipe import Action, Program, ScheduleError

from helpers.subprocess_env import NEUTRAL_CWD, child_env

PROG = zbpipe.compile("1f1b", pp=2, microbatches=2)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 10**400])
@pytest.mark.parametrize("option", ["f", "b", "w", "comm"])
def test_non_finite_costs_are_refused_by_the_cost_driven_compile(option, bad):
    with pytest.raises(ScheduleError, match=f"cost '{option}' must be finite and non-negative"):
        zbpipe.compile("zb_auto", 4, 8, **{option: bad})


@pytest.mark.parametrize("name", ["v_half", "v_min"])
def test_non_finite_costs_are_refused_by_the_v_schedules(name):
    with pytest.raises(ScheduleError, match="cost 'w' must be finite"):
        zbpipe.compile(name, 4, 8, w=[1.0] * 7 + [math.nan])


@pytest.mark.parametrize("bad", [math.inf, math.nan, [1.0, math.inf]])
@pytest.mark.parametrize("option", ["f", "b", "w", "b_full", "comm"])
def test_non_finite_costs_are_refused_by_simulate(option, bad):
    if option == "comm" and isinstance(bad, list):
        bad = bad[-1]
    with pytest.raises(ScheduleError, match=f"cost '{option}' must be finite and non-negative"):
        zbpipe.simulate(PROG, **{option: bad})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(f="12"), "simulate: f must be a number or a sequence of numbers (one per stage), got str '12'"),
        (dict(f={0: 5}), "simulate: f must be a number or a sequence of numbers (one per stage), got dict {0: 5}"),
        (dict(b={1.0}), "simulate: b must be a number or a sequence of numbers (one per stage), got set {1.0}"),
        (dict(w=b"12"), "simulate: w must be a number or a sequence of numbers (one per stage), got bytes b'12'"),
        (dict(f=[1.0, "2"]), "simulate: f[1] must be a number, got str '2'"),
        (dict(f=[1.0, None]), "simulate: f[1] must be a number, got NoneType None"),
        (dict(f=True), "simulate: f must be a number or a sequence of numbers (one per stage), got bool True"),
        (dict(comm="0.5"), "simulate: comm must be a number, got str '0.5'"),
        (dict(comm=[0.5]), "simulate: comm must be a number, got list [0.5]"),
        (dict(b_full=iter([1.0])), "simulate: b_full must be a number or a sequence of numbers"),
    ],
)
def test_simulate_names_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError) as err:
        zbpipe.simulate(PROG, **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_simulate_takes_a_program():
    with pytest.raises(TypeError, match="^simulate: program must be a zbpipe.Program, got str 'prog'$"):
        zbpipe.simulate("prog")


def test_numbers_of_other_types_are_costs():
    # Anything with __float__ (numpy scalars, tuples of ints) is a number, as before.
    ref = zbpipe.simulate(PROG, f=2.0, b=[1.0, 3.0]).makespan
    assert zbpipe.simulate(PROG, f=2, b=(1, 3)).makespan == ref


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        (("1f1b", "x", 4), {}, "compile: pp must be an int, got str 'x'"),
        (("1f1b", 2, 4.0), {}, "compile: microbatches must be an int, got float 4.0"),
        (("1f1b", 2, None), {}, "compile: microbatches must be an int, got NoneType None"),
        (("interleaved_1f1b", 2, 4, "2"), {}, "compile: stages_per_rank must be an int, got str '2'"),
        ((1, 2, 4), {}, "compile: schedule must be a str, got int 1"),
        (("zb_auto", 2, 4), dict(f="1"), "compile: f must be a number or a sequence of numbers"),
        (("zb_auto", 2, 4), dict(comm="0"), "compile: comm must be a number, got str '0'"),
        (("zb_auto", 2, 4), dict(memory_cap="2"), "compile: memory_cap must be a number, got str '2'"),
        (("zb_auto", 2, 4), dict(search_threads="2"), "compile: search_threads must be an int, got str '2'"),
    ],
)
def test_compile_names_the_wrong_type(args, kwargs, message):
    with pytest.raises(TypeError) as err:
        zbpipe.compile(*args, **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: Program.from_actions(5, [0], 1),
         "Program.from_actions: ranks must be a list of lists of action strings (one list per rank), got int 5"),
        (lambda: Program.from_actions(["0F0"], [0], 1),
         "Program.from_actions: ranks must be a list of lists of action strings"),
        (lambda: Program.from_actions([["0F0", 1]], [0], 1),
         "Program.from_actions: ranks must be a list of lists of action strings"),
        (lambda: Program.from_actions([["0F0", "0B0"]], "0", 1),
         "Program.from_actions: stage_to_rank must be a list of ints (the rank of each stage), got str '0'"),
        (lambda: Program.from_actions([["0F0", "0B0"]], [0], 1.0),
         "Program.from_actions: microbatches must be an int, got float 1.0"),
        (lambda: Program.from_actions([["0F0", "0B0"]], [0], 1, name=3),
         "Program.from_actions: name must be a str, got int 3"),
        (lambda: Program.from_csv_text(b"0F0,0B0"), "Program.from_csv_text: text must be a str, got bytes"),
        (lambda: Program.from_csv_text(["0F0"]), "Program.from_csv_text: text must be a str, got list"),
        (lambda: Program.from_csv(3), "Program.from_csv: path must be a path"),
        (lambda: Action.parse(5), "Action.parse: text must be an action string such as '2F0', got int 5"),
    ],
)
def test_core_entry_points_name_the_wrong_type(call, message):
    with pytest.raises(TypeError) as err:
        call()
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_right_types_still_work():
    prog = Program.from_actions([["0F0", "0B0"]], [0], 1, name="one", rendezvous=True)
    assert prog.schedule == "one" and prog.actions(0) == ["0F0", "0B0"]
    assert Program.from_csv_text("0F0,0B0").actions(0) == ["0F0", "0B0"]
    assert str(Action.parse("(1F1;2B0)OVERLAP_F_B")) == "(1F1;2B0)OVERLAP_F_B"


def test_a_stage_mapped_outside_the_ranks_is_refused_before_lowering():
    # The lowering pass indexed the rank lists with stage_to_rank before validate() checked it:
    # a stage on rank 5 of 1 wrote past them (a crash at exit). In a child, so a crash shows.
    code = (
        "import zbpipe\n"
        "try:\n"
        "    zbpipe.Program.from_actions([['0F0', '1F0', '1B0', '0B0']], [0, 5], 1)\n"
        "except zbpipe.ScheduleError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(), cwd=NEUTRAL_CWD, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stage 1 maps to rank 5 outside [0, 1)" in proc.stdout


# One door (csrc/python/arguments.cpp) writes every wrong-type message, for the Python checks
# (zbpipe/_door.py: compile, simulate, refine) and the bindings alike: the type's __name__,
# and the repr cut to 57 characters (code points, not UTF-8 bytes) plus "..." when over 60.
DOORS = [
    (lambda value: zbpipe.simulate(value), "program must be a zbpipe.Program"),
    (lambda value: Program.from_actions(value, [0], 1),
     "ranks must be a list of lists of action strings (one list per rank)"),
]


@pytest.mark.parametrize("door", DOORS, ids=["python", "binding"])
@pytest.mark.parametrize(
    "value,shown",
    [
        ("é" * 70, "'" + "é" * 56 + "..."),                   # 2-byte characters across the cut
        ("a" * 50 + "€" * 20, "'" + "a" * 50 + "€" * 6 + "..."),  # 3-byte, the cut among them
        ("𝄞" * 58, "'" + "𝄞" * 58 + "'"),                   # 60 characters (240 bytes): whole
        ("x" * 55 + "𝄞" * 4, "'" + "x" * 55 + "𝄞" + "..."),  # 4-byte, 61 characters
    ],
    ids=["2-byte", "3-byte", "60-chars", "4-byte"],
)
def test_a_long_repr_is_cut_by_characters(door, value, shown):
    call, says = door
    with pytest.raises(TypeError) as err:
        call(value)
    assert str(err.value).endswith(f"{says}, got str {shown}"), str(err.value)


@pytest.mark.parametrize("door", DOORS, ids=["python", "binding"])
def test_the_type_is_named_by_its_name(door):
    call, _ = door
    with pytest.raises(TypeError) as err:
        call(collections.OrderedDict())
    assert str(err.value).endswith(", got OrderedDict OrderedDict()"), str(err.value)


@pytest.mark.parametrize("door", [lambda v: zbpipe.compile(v, 2, 2),
                                  lambda v: Program.from_actions([["0F0", "0B0"]], [0], 1, name=v)],
                         ids=["python", "binding"])
def test_a_lone_surrogate_is_not_text(door):
    with pytest.raises(ScheduleError) as err:
        door("1f1b\ud800")
    assert str(err.value).endswith(
        " is not valid text (it holds a lone surrogate, which UTF-8 cannot encode)"), str(err.value)
