"""compile() options a schedule does not use are refused, not ignored: every cost field, memory
field (mem_f, mem_w) and memory_cap given to a schedule whose builder does not consult it raises
ScheduleError naming the schedules that do (zb_auto, v_half, v_min, also for refine); b_full
steers no builder at all."""

import pytest

import zbpipe
from zbpipe.cli import main
from zbpipe.schedules import _cached_program

SEARCHED = ["zb_auto", "v_half", "v_min"]
# One legal value per option, in zbpipe.compile's spelling; memory_cap 0 = the schedule's own.
VALUES = {"f": 1.5, "b": [1.0], "w": 0.5, "comm": 0.1, "memory_cap": 0, "b_full": 2.0,
          "search_threads": 2, "mem_f": 2.0, "mem_w": [0.5], "refine": False,
          "exhaustive_search": True}
SEARCH_OPTIONS = ["f", "b", "w", "comm", "mem_f", "mem_w", "memory_cap", "exhaustive_search",
                  "search_threads", "refine"]


def test_the_search_builders_take_costs_and_a_cap_and_no_other_does():
    for name in zbpipe.schedule_names():
        expected = SEARCH_OPTIONS if name in SEARCHED else []
        assert zbpipe.schedule_options(name) == expected, name


@pytest.mark.parametrize("name", zbpipe.schedule_names())
@pytest.mark.parametrize("option", sorted(VALUES))
def test_unused_option_is_refused_naming_the_takers(name, option):
    pp, m = 4, 8
    zbpipe.compile(name, pp, m)  # the request itself is fine without the option
    if option in zbpipe.schedule_options(name):
        zbpipe.compile(name, pp, m, **{option: VALUES[option]})
        return
    with pytest.raises(zbpipe.ScheduleError) as err:
        zbpipe.compile(name, pp, m, **{option: VALUES[option]})
    msg = str(err.value)
    assert f"{name} does not use option '{option}'" in msg
    if option == "b_full":
        assert "no schedule builds with it" in msg
    else:
        assert f"only {', '.join(SEARCHED)} take it" in msg


def test_a_given_default_value_is_still_refused():
    # Given is given: the value equals the default, yet 1f1b would ignore it.
    with pytest.raises(zbpipe.ScheduleError, match="'f'"):
        zbpipe.compile("1f1b", 4, 8, f=1.0)
    with pytest.raises(zbpipe.ScheduleError, match="'comm'"):
        zbpipe.compile("zbv", 4, 8, comm=0.0)


def test_schedule_classes_refuse_them_too():
    with pytest.raises(zbpipe.ScheduleError, match="zb_h1 does not use option 'memory_cap'"):
        _cached_program("zb_h1", 4, 8, 1, False, (("memory_cap", 4),))
    prog = _cached_program("zb_auto", 4, 8, 1, False, (("f", 2.0), ("memory_cap", 3)))
    assert max(zbpipe.simulate(prog, 2.0).peak_activations) <= 3


def test_cli_refuses_a_cap_for_a_schedule_without_one(capsys):
    code = main(["simulate", "1f1b", "--pp", "4", "-m", "8", "--memory-cap", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "1f1b does not use option 'memory_cap'" in err


def test_cli_builds_the_v_schedules_under_the_given_costs(capsys):
    # Per-1F1B-stage costs split over the V's two stages, as the simulation uses them.
    costs = dict(f=[18.522 / 2], b=[18.086 / 2], w=[9.337 / 2], comm=0.601)
    code = main(["simulate", "v_half", "--pp", "2", "-m", "16", "--f", "18.522", "--b", "18.086",
                 "--w", "9.337", "--comm", "0.601"])
    out = capsys.readouterr().out
    assert code == 0
    built = zbpipe.simulate(zbpipe.compile("v_half", 2, 16, **costs), costs["f"], costs["b"],
                            costs["w"], costs["comm"])
    unit = zbpipe.simulate(zbpipe.compile("v_half", 2, 16), costs["f"], costs["b"], costs["w"],
                           costs["comm"])
    assert built.makespan < unit.makespan - 1.0  # the costs change the build here
    assert f"makespan: {built.makespan:.4f}" in out
