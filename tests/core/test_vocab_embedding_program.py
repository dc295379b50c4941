"""The vocabulary-parallel input embedding in the program (csrc/include/zbpipe/vocab.h):
compile(..., vocab_embedding=True) places every rank's E and EW passes and their collectives
(REDUCE_E, BCAST_E) into every schedule's program, alone or beside the head's; validate checks
them; simulate costs them; their strings parse back."""

from __future__ import annotations

import pytest
from helpers.program_checker import ProgramError, check_vocab, check_vocab_program
from helpers.program_edits import assert_vocab_edit_refused, edited, rows_of

import zbpipe
from zbpipe import Action, Kind, Program, ScheduleError, _C

TRAINING = [n for n in zbpipe.schedule_names() if n != "inference"]
EMBEDDING_KINDS = {Kind.E, Kind.EW, Kind.REDUCE_E, Kind.BCAST_E}


def _microbatches(name: str, pp: int) -> int:
    return 2 * pp if name == "dualpipev" else max(2 * pp, 4)


def _kinds(prog):
    return [[Action.parse(a).kind for a in prog.actions(r)] for r in range(prog.pp)]


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("name", TRAINING)
def test_every_training_schedule_places_the_embedding_passes(name, pp, head):
    m = _microbatches(name, pp)
    base = zbpipe.compile(name, pp, m, vocab_parallel=head)
    prog = zbpipe.compile(name, pp, m, vocab_parallel=head, vocab_embedding=True)
    check_vocab(prog)  # the independent restatement of the rule (tests/helpers/program_checker.py)
    for r in range(pp):
        # The program without the embedding's actions is the one without the option, unchanged
        # (the head's posts may only move later, after an embedding broadcast they wait for).
        kept = [a for a in prog.actions(r) if Action.parse(a).kind not in EMBEDDING_KINDS]
        assert sorted(kept) == sorted(base.actions(r))
        computes = [a for a in kept if Action.parse(a).is_compute]
        assert computes == [a for a in base.actions(r) if Action.parse(a).is_compute]
        assert {Action.parse(a).stage for a in prog.actions(r) if Action.parse(a).kind in EMBEDDING_KINDS} == {r}


def test_inference_gets_the_lookup_and_reduction_only():
    prog = zbpipe.compile("inference", 3, 4, vocab_embedding=True)
    check_vocab(prog, forward_only=True)
    kinds = {k for row in _kinds(prog) for k in row}
    assert {Kind.E, Kind.REDUCE_E} <= kinds and not kinds & {Kind.EW, Kind.BCAST_E}
    with pytest.raises(ScheduleError, match="already has embedding actions"):
        _C.insert_embedding(prog)


def test_the_root_is_stage_0s_rank_reduced_before_its_forward_and_broadcast_after_its_backward():
    prog = zbpipe.compile("1f1b", 4, 8, vocab_embedding=True)
    acts = prog.actions(prog.stage_to_rank[0])
    for mb in range(8):
        assert acts.index(f"0E{mb}") < acts.index(f"0REDUCE_E{mb}") < acts.index(f"0F{mb}")
        assert acts.index(f"0B{mb}") < acts.index(f"0BCAST_E{mb}") < acts.index(f"0EW{mb}")
    # The reduction goes out two forwards ahead of its need: microbatch 2's before 0F0 ends.
    assert acts.index("0REDUCE_E2") < acts.index("0F0")


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zbv", "interleaved_zb"])
def test_weight_passes_fill_the_step_not_its_end(name):
    """EW m goes where the timed run finds BCAST_E m complete: on every rank the first EW runs
    before the rank's last compute of the base program (a program with every EW at its end
    would be valid too, and slower)."""
    pp, m = 4, 8
    prog = zbpipe.compile(name, pp, m, vocab_embedding=True)
    for r in range(pp):
        acts = prog.actions(r)
        last_base = max(i for i, a in enumerate(acts) if Action.parse(a).kind in (Kind.F, Kind.B, Kind.I, Kind.W))
        assert acts.index(f"{r}EW0") < last_base


@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved_1f1b", "dualpipev", "zb_h1"])
def test_each_rank_does_its_own_embedding_work_and_little_else(name):
    pp, m = 4, 8
    e, ew = [0.1, 0.2, 0.3, 0.4], [0.05, 0.1, 0.15, 0.2]
    base = zbpipe.simulate(zbpipe.compile(name, pp, m))
    prog = zbpipe.compile(name, pp, m, vocab_embedding=True, e=e, ew=ew)
    res = zbpipe.simulate(prog, e=e, ew=ew)
    assert res.busy == pytest.approx([b + m * (e[r] + ew[r]) for r, b in enumerate(base.busy)])
    # The step grows by about the embedding work of one rank (3 at the largest), not more.
    assert res.makespan <= base.makespan + m * (e[-1] + ew[-1]) + 1.0


# ---- validate: the rule, each violation named ------------------------------------------------

@pytest.fixture
def program():
    return zbpipe.compile("1f1b", 2, 4, vocab_embedding=True)


def _move_before(row, a, b):
    row.remove(a)
    row.insert(row.index(b), a)


def _move_after(row, a, b):
    row.remove(a)
    row.insert(row.index(b) + 1, a)


def test_an_edited_copy_that_keeps_the_rule_validates(program):
    edited(rows_of(program), program)  # no error: the baseline of the cases below


@pytest.mark.parametrize("edit,why", [
    (lambda rows: _move_after(rows[1], "1E3", "1REDUCE_E3"), "'1REDUCE_E3' before '1E3'"),
    (lambda rows: _move_before(rows[1], "1EW0", "1BCAST_E0"), "'1EW0' before '1BCAST_E0'"),
    (lambda rows: rows[0].remove("0EW2"), "rank 0 never runs '0EW2'"),
    (lambda rows: rows[0].__setitem__(rows[0].index("0E1"), "1E1"), "names vocabulary shard 1"),
    (lambda rows: _move_after(rows[0], "0REDUCE_E1", "0F1"), "'0F1' takes the embedding output '0REDUCE_E1'"),
    (lambda rows: _move_before(rows[0], "0BCAST_E3", "0B3"), "'0BCAST_E3' broadcasts the input gradient of stage 0"),
    (lambda rows: _move_after(rows[1], "1REDUCE_E0", "1REDUCE_E1"), "collective #0 of rank 1 is '1REDUCE_E1'"),
])
def test_validate_names_each_violation(program, edit, why):
    rows = rows_of(program)
    edit(rows)
    assert_vocab_edit_refused(rows, program, why)


def test_a_weight_pass_awaited_before_its_broadcast_can_complete_deadlocks(program):
    rows = rows_of(program)
    # Rank 1 waits for microbatch 0's broadcast before its own backward of microbatch 0, which
    # stage 0's backward (whose gradient it broadcasts) needs first.
    row = rows[1]
    row.remove("1EW0")
    row.insert(row.index("1B0"), "1EW0")
    with pytest.raises(ScheduleError, match="deadlock"):
        edited(rows, program)
    with pytest.raises(ProgramError, match="deadlock"):
        check_vocab_program(rows, list(program.stage_to_rank), program.microbatches)


def test_forward_only_program_refuses_the_backward_half():
    prog = zbpipe.compile("inference", 2, 2, vocab_embedding=True)
    rows = rows_of(prog)
    rows[1].append("1EW0")
    with pytest.raises(ScheduleError, match="'1EW0' in a program without backward"):
        edited(rows, prog)


def test_csv_round_trip_keeps_the_embedding_actions(program):
    again = Program.from_csv_text(program.to_csv_text())
    assert rows_of(again) == rows_of(program)


# ---- options, strings, refusals ---------------------------------------------------------------

def test_embedding_options_need_vocab_embedding():
    with pytest.raises(ScheduleError, match="'e' is the vocabulary-parallel embedding's"):
        zbpipe.compile("1f1b", 2, 4, e=0.5)
    with pytest.raises(ScheduleError, match="'s' is the vocabulary head's"):
        zbpipe.compile("1f1b", 2, 4, vocab_embedding=True, s=0.5)
    # The placement's costs and the collective latency come with it, on any schedule.
    zbpipe.compile("gpipe", 2, 4, vocab_embedding=True, f=2.0, b=1.0, w=1.0, comm=0.1, collective=0.2, e=0.3, ew=0.1)
    with pytest.raises(ScheduleError, match="expects a lowered program"):
        _C.insert_embedding(zbpipe.compile("1f1b", 2, 4).compute_only())


@pytest.mark.parametrize("text,kind", [("2E1", Kind.E), ("0EW3", Kind.EW), ("1REDUCE_E0", Kind.REDUCE_E),
                                       ("3BCAST_E12", Kind.BCAST_E)])
def test_embedding_strings_parse_back(text, kind):
    a = Action.parse(text)
    assert a.kind == kind and str(a) == text and Action.parse(str(a)) == a


def test_refine_and_the_bound_refuse_embedding_programs():
    prog = zbpipe.compile("zb_h1", 2, 4, vocab_embedding=True)
    with pytest.raises(ScheduleError, match="vocabulary-parallel"):
        zbpipe.refine(prog)
    with pytest.raises(ScheduleError, match="vocabulary-parallel"):
        zbpipe.lower_bound(prog)


# ---- simulate -------------------------------------------------------------------------------

def test_one_rank_one_microbatch_by_hand():
    """pp=1, one microbatch, f=b=w=1, e=0.5, ew=0.25, collective c=0.1: E [0, 0.5]; its
    reduction completes at 0.6; F [0.6, 1.6]; B [1.6, 3.6] (b + w); the broadcast posted at 3.6
    completes at 3.7; EW [3.7, 3.95]."""
    prog = zbpipe.compile("1f1b", 1, 1, vocab_embedding=True, e=0.5, ew=0.25, collective=0.1)
    assert prog.actions(0) == ["0E0", "0REDUCE_E0", "0F0", "0B0", "0BCAST_E0", "0EW0"]
    res = zbpipe.simulate(prog, e=0.5, ew=0.25, collective=0.1)
    assert res.makespan == pytest.approx(3.95)
    assert [(str(e.action), e.start, e.end) for e in res.timeline] == pytest.approx([
        ("0E0", 0, 0.5), ("0F0", 0.6, 1.6), ("0B0", 1.6, 3.6), ("0EW0", 3.7, 3.95)])
    assert [(str(e.action), e.start, e.end) for e in res.collectives] == pytest.approx([
        ("0REDUCE_E0", 0.5, 0.6), ("0BCAST_E0", 3.6, 3.7)])


def test_the_drawings_show_the_embedding(capsys):
    from zbpipe import plot
    from zbpipe.timeline_text import slot_grid

    prog = zbpipe.compile("1f1b", 2, 2, vocab_embedding=True, vocab_parallel=True, e=1.0, ew=1.0)
    res = zbpipe.simulate(prog, collective=0.5, e=1.0, ew=1.0)
    grid = slot_grid(prog, res)
    assert "E0" in grid and "EW1" in grid and "S0" in grid
    boxes, arrows = plot.program_boxes(prog, res, 0.0)
    assert {b.kind for b in boxes} >= {"E", "EW", "S", "T"}
    assert any(a.dst_rank == 0 and a.src_rank == 1 for a in arrows)  # a reduction onto stage 0's rank
