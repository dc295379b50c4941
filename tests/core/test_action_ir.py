"""The action IR: canonical strings parse back exactly, bad strings fail with a clear error."""

import pytest

import zbpipe
from zbpipe import Action, Kind, ScheduleError

CANONICAL = [
    ("2F0", 2, Kind.F, 0),
    ("1I3", 1, Kind.I, 3),
    ("0W3", 0, Kind.W, 3),
    ("0B12", 0, Kind.B, 12),
    ("3SEND_F1", 3, Kind.SEND_F, 1),
    ("1RECV_B0", 1, Kind.RECV_B, 0),
    ("10SEND_B7", 10, Kind.SEND_B, 7),
    ("4RECV_F15", 4, Kind.RECV_F, 15),
    ("1S0", 1, Kind.S, 0),
    ("3T12", 3, Kind.T, 12),
    ("0BCAST_F2", 0, Kind.BCAST_F, 2),
    ("2ALLREDUCE_S7", 2, Kind.ALLREDUCE_S, 7),
    ("1REDUCE_B0", 1, Kind.REDUCE_B, 0),
]


@pytest.mark.parametrize("text,stage,kind,mb", CANONICAL)
def test_parse_fields_and_round_trip(text, stage, kind, mb):
    a = Action.parse(text)
    assert (a.stage, a.kind, a.microbatch) == (stage, kind, mb)
    assert str(a) == text
    assert Action.parse(str(a)) == a


def test_overlap_round_trip():
    a = Action.parse("(1F1;2B0)OVERLAP_F_B")
    assert a.kind == Kind.OVERLAP_F_B
    assert [str(s) for s in a.sub_actions] == ["1F1", "2B0"]
    assert str(a) == "(1F1;2B0)OVERLAP_F_B"
    assert a.is_compute


def test_whitespace_is_trimmed():
    assert str(Action.parse("  2F0 ")) == "2F0"


@pytest.mark.parametrize(
    "text,why",
    [
        ("", "empty"),
        ("F0", "missing stage"),
        ("2X0", "unknown action kind"),
        ("2F", "missing microbatch"),
        ("2Fx", "bad microbatch"),
        ("(1F1;2B0", "unbalanced"),
        ("(1F1;2B0)F", "must end in OVERLAP_F_B"),
        ("(1SEND_F1)OVERLAP_F_B", "only group"),
        ("(1S1;0F0)OVERLAP_F_B", "only group"),
        ("()OVERLAP_F_B", "needs sub-actions"),
    ],
)
def test_bad_strings_raise_schedule_error(text, why):
    with pytest.raises(ScheduleError, match=why):
        Action.parse(text)


@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_every_compiled_action_round_trips(vocab_parallel):
    for name in zbpipe.schedule_names():
        try:
            prog = zbpipe.compile(name, pp=4, microbatches=8, vocab_parallel=vocab_parallel)
        except ScheduleError:
            continue  # schedules that do not take (4, 8) are covered by the grid tests
        for rank in range(prog.pp):
            for text in prog.actions(rank):
                assert str(Action.parse(text)) == text
