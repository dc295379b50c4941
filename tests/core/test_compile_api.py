"""The public compile() contract: fields, errors, and compute/comm views."""

import pytest

import zbpipe
from zbpipe import ScheduleError


def test_program_fields():
    prog = zbpipe.compile("1f1b", pp=4, microbatches=6)
    assert (prog.pp, prog.num_stages, prog.microbatches) == (4, 4, 6)
    assert prog.stage_to_rank == [0, 1, 2, 3]
    assert prog.compute_actions(0)[:4] == ["0F0", "0F1", "0F2", "0F3"]
    assert all("SEND" not in a and "RECV" not in a for a in prog.compute_actions(2))
    assert len(prog.actions(1)) > len(prog.compute_actions(1))


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(ScheduleError) as err:
        zbpipe.compile("zb_h9", pp=2, microbatches=2)
    for name in zbpipe.schedule_names():
        assert name in str(err.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pp=0, microbatches=4), "pp must be >= 1, got pp=0"),
        (dict(pp=2, microbatches=0), "microbatches must be >= 1, got microbatches=0"),
        (dict(pp=2, microbatches=4, stages_per_rank=2), "fixes stages_per_rank=1, got stages_per_rank=2"),
    ],
)
def test_constraint_errors_name_values(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        zbpipe.compile("1f1b", **kwargs)


def test_bad_rank_query():
    prog = zbpipe.compile("gpipe", pp=2, microbatches=2)
    with pytest.raises(ScheduleError, match="rank must be in"):
        prog.actions(2)
