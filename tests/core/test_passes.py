"""Lowering and validation passes on hand-written programs: each broken program must be
rejected with a message naming the rule, and the grid marking the offending action."""

import pytest

import zbpipe
from zbpipe import Program, ScheduleError

# Two ranks, one stage each, two microbatches, lowered (what 1F1B at pp=2 m=2 gives).
GOOD = [
    ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
    ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"],
]


def test_good_program_validates():
    prog = Program.from_actions(GOOD, [0, 1], 2)
    assert prog.actions(1) == GOOD[1]
    zbpipe._C.validate(prog)


def test_lowering_matches_the_hand_written_program():
    compute = [[a for a in row if "SEND" not in a and "RECV" not in a] for row in GOOD]
    lowered = Program.from_actions(compute, [0, 1], 2)
    # RECV_B0 lands right after rank 1 finishes B0, i.e. after rank 0's SEND_F1 (same sweep).
    assert lowered.actions(0) == GOOD[0]
    assert lowered.actions(1)[:2] == ["1RECV_F0", "1F0"]
    zbpipe._C.validate(lowered)


def mutate(rank, fn):
    rows = [list(r) for r in GOOD]
    rows[rank] = fn(rows[rank])
    return rows


@pytest.mark.parametrize(
    "rows,match",
    [
        (mutate(0, lambda r: r[:-1]), "stage 0 microbatch 1 needs B"),
        (mutate(0, lambda r: r + ["0F0"]), "appears twice"),
        (mutate(1, lambda r: [a for a in r if a != "1RECV_F1"]), "no RECV_F before it"),
        (mutate(0, lambda r: [a for a in r if a != "0SEND_F1"]), "no SEND_F after it"),
        (mutate(1, lambda r: ["1F0" if a == "1RECV_F0" else "1RECV_F0" if a == "1F0" else a for a in r]),
         "no RECV_F before it"),
        (mutate(1, lambda r: ["1RECV_F1", "1RECV_F0"] + [a for a in r if "RECV_F" not in a]),
         "does not match the send in that order"),
        (mutate(0, lambda r: r + ["1F5"]), "out of range"),
    ],
)
def test_broken_programs_are_rejected(rows, match):
    with pytest.raises(ScheduleError, match=match) as err:
        Program.from_actions(rows, [0, 1], 2)
    assert "rank 0" in str(err.value) and "rank 1" in str(err.value)  # the grid is shown


def test_action_on_wrong_rank():
    rows = [["0F0", "1F0", "1B0", "0B0"], []]
    with pytest.raises(ScheduleError, match="runs on rank 0 but stage 1 lives on rank 1"):
        Program.from_actions(rows, [0, 1], 1)


def test_w_before_i_rejected():
    with pytest.raises(ScheduleError, match="W of stage 0 mb 0 before its I"):
        Program.from_actions([["0F0", "0W0", "0I0"]], [0], 1)


def test_deadlock_is_detected_and_marked():
    # Each rank blocks on a receive whose send comes after the other rank's receive.
    rows = [
        ["0F0", "0RECV_B0", "0SEND_F0", "0B0"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0"],
    ]
    # Rank 0 waits for RECV_B0 before sending F0; rank 1 waits for F0: deadlock.
    with pytest.raises(ScheduleError, match="deadlock") as err:
        Program.from_actions(rows, [0, 1], 1)
    assert ">>0RECV_B0<<" in str(err.value)


def test_compute_only_cycle_cannot_be_lowered():
    # Rank 0 wants stage 0's backward before any forward of stage 1 can run: impossible order.
    rows = [["0F0", "0B0"], ["1F0", "1B0"]]
    rows[0] = ["0B0", "0F0"]
    with pytest.raises(ScheduleError, match="cannot be lowered|before its F"):
        Program.from_actions(rows, [0, 1], 1)


def test_no_comm_between_stages_on_one_rank():
    # Stages 0 and 1 both on rank 0 (V-like placement): the handover is direct.
    rows = [["0F0", "1F0", "1B0", "0B0"]]
    prog = Program.from_actions(rows, [0, 0], 1)
    assert prog.actions(0) == rows[0]
    with pytest.raises(ScheduleError, match="no cross-rank peer"):
        Program.from_actions([["0F0", "0SEND_F0", "1RECV_F0", "1F0", "1B0", "0B0"]], [0, 0], 1)


def test_v_topology_lowering_only_crosses_ranks():
    # pp=2, 4 stages in V: rank 0 holds 0 and 3, rank 1 holds 1 and 2.
    rows = [
        ["0F0", "3F0", "3B0", "0B0"],
        ["1F0", "2F0", "2B0", "1B0"],
    ]
    prog = Program.from_actions(rows, [0, 1, 1, 0], 1)
    comm = [a for r in range(2) for a in prog.actions(r) if "SEND" in a or "RECV" in a]
    assert sorted(comm) == sorted(
        ["0SEND_F0", "1RECV_F0", "2SEND_F0", "3RECV_F0", "3SEND_B0", "2RECV_B0", "1SEND_B0", "0RECV_B0"]
    )


def test_format_marks_the_action():
    prog = zbpipe.compile("1f1b", pp=2, microbatches=2)
    grid = prog.format(1, 0)
    assert ">>1RECV_F0<<" in grid
    assert grid.splitlines()[0].split() == ["step", "rank", "0", "rank", "1"]
