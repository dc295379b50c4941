"""Vocabulary parallelism in the program (csrc/include/zbpipe/vocab.h): compile(...,
vocab_parallel=True) places every rank's S and T passes and their collectives into every
schedule's program; validate checks them; simulate costs them; their strings parse back."""

from __future__ import annotations

import pytest
from helpers.program_checker import check_vocab
from helpers.program_edits import assert_vocab_edit_refused, edited, rows_of

import zbpipe
from zbpipe import Action, Kind, Program, ScheduleError, _C

TRAINING = [n for n in zbpipe.schedule_names() if n != "inference"]
VOCAB_KINDS = {Kind.S, Kind.T, Kind.BCAST_F, Kind.ALLREDUCE_S, Kind.REDUCE_B}


def _microbatches(name: str, pp: int) -> int:
    return 2 * pp if name == "dualpipev" else max(2 * pp, 4)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("name", TRAINING)
def test_every_training_schedule_places_the_vocabulary_passes(name, pp):
    m = _microbatches(name, pp)
    base = zbpipe.compile(name, pp, m)
    prog = zbpipe.compile(name, pp, m, vocab_parallel=True)
    check_vocab(prog)  # the independent restatement of the rule (tests/helpers/program_checker.py)
    for r in range(pp):
        # The base program's computes, forwards moved ahead at most (reorder_for_vocab); the rest
        # is the rank's own shard.
        kept = [a for a in prog.compute_actions(r) if Action.parse(a).kind not in VOCAB_KINDS]
        assert sorted(kept) == sorted(base.compute_actions(r))
        backwards = [a for a in kept if Action.parse(a).kind != Kind.F]
        assert backwards == [a for a in base.compute_actions(r) if Action.parse(a).kind != Kind.F]
        assert {Action.parse(a).stage for a in prog.actions(r) if Action.parse(a).kind in VOCAB_KINDS} == {r}
    assert all(not any(Action.parse(a).kind in VOCAB_KINDS for a in base.actions(r)) for r in range(pp))


def test_inference_gets_the_forward_half_only():
    prog = zbpipe.compile("inference", 3, 4, vocab_parallel=True)
    check_vocab(prog, forward_only=True)
    kinds = {Action.parse(a).kind for r in range(3) for a in prog.actions(r)}
    assert {Kind.S, Kind.BCAST_F, Kind.ALLREDUCE_S} <= kinds and not kinds & {Kind.T, Kind.REDUCE_B}


def test_the_root_is_the_last_stages_rank_and_feeds_its_backward():
    prog = zbpipe.compile("zbv", 2, 4, vocab_parallel=True)
    root = prog.stage_to_rank[-1]
    assert root == 0  # a V: the last stage comes back to rank 0
    acts = prog.actions(root)
    last = prog.num_stages - 1
    for mb in range(4):
        assert acts.index(f"{last}F{mb}") < acts.index(f"{root}BCAST_F{mb}")
        assert acts.index(f"{root}REDUCE_B{mb}") < acts.index(f"{last}I{mb}")


# ---- validate: the rule, each violation named ------------------------------------------------

@pytest.fixture
def program():
    return zbpipe.compile("1f1b", 2, 4, vocab_parallel=True)


def test_an_edited_copy_that_keeps_the_rule_validates(program):
    edited(rows_of(program), program)  # no error: the baseline of the cases below


def _swap(row, a, b):
    i, j = row.index(a), row.index(b)
    row[i], row[j] = row[j], row[i]


@pytest.mark.parametrize("edit,why", [
    (lambda rows: _swap(rows[1], "1ALLREDUCE_S0", "1REDUCE_B0"), "'1REDUCE_B0' before '1ALLREDUCE_S0'"),
    (lambda rows: _swap(rows[0], "0BCAST_F0", "0S0"), "'0S0' before '0BCAST_F0'"),
    (lambda rows: rows[0].remove("0T2"), "rank 0 never runs '0T2'"),
    (lambda rows: rows[0].__setitem__(rows[0].index("0S1"), "1S1"), "names vocabulary shard 1"),
    (lambda rows: _swap(rows[1], "1F1", "1BCAST_F1"), "'1BCAST_F1' broadcasts the output of '1F1'"),
    (lambda rows: _swap(rows[1], "1REDUCE_B3", "1B3"), "starts from the gradient '1REDUCE_B3' reduces"),
    (lambda rows: _swap(rows[0], "0REDUCE_B1", "0BCAST_F2"),
     "collective #5 of rank 1 is '1REDUCE_B1' but rank 0's is '0BCAST_F2'"),
])
def test_validate_names_each_violation(program, edit, why):
    rows = rows_of(program)
    edit(rows)
    assert_vocab_edit_refused(rows, program, why)


def test_a_collective_awaited_before_every_rank_can_post_it_deadlocks(program):
    rows = rows_of(program)
    # Rank 0 waits for microbatch 1's broadcast before its own forward of microbatch 1, which
    # rank 1 (the root) needs before it can broadcast it.
    row = rows[0]
    moved = ["0S0", "0ALLREDUCE_S0", "0REDUCE_B0", "0BCAST_F1", "0S1"]  # the collective order kept
    for a in moved:
        row.remove(a)
    at = row.index("0F1")
    row[at:at] = moved
    with pytest.raises(ScheduleError, match="deadlock"):
        edited(rows, program)


def test_csv_round_trip_keeps_the_vocabulary_actions(program, tmp_path):
    again = Program.from_csv_text(program.to_csv_text())
    assert rows_of(again) == rows_of(program)


def test_vocabulary_actions_are_placed_after_lowering_only():
    prog = zbpipe.compile("1f1b", 2, 2, vocab_parallel=True)
    with pytest.raises(ScheduleError, match="lowers programs without vocabulary actions"):
        _C.lower(prog.compute_only())
    with pytest.raises(ScheduleError, match="already has vocabulary actions"):
        _C.insert_vocab(prog)


# ---- the strings ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,kind", [("1S0", Kind.S), ("3T12", Kind.T), ("0BCAST_F2", Kind.BCAST_F),
                                       ("2ALLREDUCE_S7", Kind.ALLREDUCE_S), ("1REDUCE_B0", Kind.REDUCE_B)])
def test_vocabulary_strings_parse_back(text, kind):
    a = Action.parse(text)
    assert a.kind == kind and str(a) == text and Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["(0S0;1F1)OVERLAP_F_B", "S0", "0BCAST_F", "0BCAST0"])
def test_bad_vocabulary_strings_raise(text):
    with pytest.raises(ScheduleError):
        Action.parse(text)


# ---- compile options -----------------------------------------------------------------------

def test_vocabulary_options_need_vocab_parallel():
    with pytest.raises(ScheduleError, match="option 's' is the vocabulary head's"):
        zbpipe.compile("1f1b", 2, 4, s=2.0)
    # With vocab_parallel, every schedule takes the stage costs: they time the placement.
    zbpipe.compile("1f1b", 2, 4, vocab_parallel=True, f=1, b=2, w=1, comm=0.1, s=3, t=[1, 2], collective=0.2)
    with pytest.raises(ScheduleError, match="memory_cap"):
        zbpipe.compile("1f1b", 2, 4, vocab_parallel=True, memory_cap=3)
    with pytest.raises(ScheduleError, match="vocabulary 't' needs 1 value or one per rank"):
        zbpipe.compile("1f1b", 2, 4, vocab_parallel=True, t=[1, 2, 3])
    with pytest.raises(ScheduleError, match="'backlog' must be >= 1"):
        zbpipe.compile("1f1b", 2, 4, vocab_parallel=True, backlog=0)


def test_refine_and_the_bound_refuse_vocabulary_programs():
    prog = zbpipe.compile("zb_h1", 2, 4, vocab_parallel=True)
    with pytest.raises(ScheduleError, match="vocabulary-parallel"):
        zbpipe.refine(prog)
    with pytest.raises(ScheduleError, match="vocabulary-parallel"):
        zbpipe.lower_bound(prog)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_vocabulary_program_completes_under_nccls_rules(pp):
    # The rendezvous model with the collectives on a communicator of their own and the head's
    # passes on a stream of their own (validate_rendezvous.cpp), the design a stream-ordered
    # runtime needs: on the messages' communicator every one of these programs deadlocks (a
    # rank's early broadcast post holds back the sends its root waits for), and with the passes
    # on the stages' stream 25 of 152 do (a T waiting for its statistics holds back a receive).
    checked = 0
    for name in zbpipe.schedule_names():
        for m in (pp, 2 * pp, 3 * pp):
            try:
                prog = zbpipe.compile(name, pp, m, vocab_parallel=True)
            except ScheduleError:
                continue
            _C.validate(prog, rendezvous=True)
            checked += 1
    assert checked >= 20, checked


# ---- simulate -------------------------------------------------------------------------------

def test_one_rank_one_microbatch_by_hand():
    """pp=1, one microbatch, f=b=w=1, s=2, t=1, collective c=0.5: F [0,1]; its broadcast
    completes at 1.5; S [1.5, 3.5]; ALLREDUCE_S completes at 4; REDUCE_B posted at 4 completes
    at 4.5; T fills [4, 5]; B [5, 7] (b + w). An S holds mem_s=0.25 until its T ends."""
    prog = zbpipe.compile("1f1b", 1, 1, vocab_parallel=True, s=2, t=1, collective=0.5)
    assert prog.actions(0) == ["0F0", "0BCAST_F0", "0S0", "0ALLREDUCE_S0", "0REDUCE_B0", "0T0", "0B0"]
    res = zbpipe.simulate(prog, s=2, t=1, collective=0.5, mem_s=0.25)
    assert res.makespan == 7.0
    assert [(str(e.action), e.start, e.end) for e in res.timeline] == [
        ("0F0", 0, 1), ("0S0", 1.5, 3.5), ("0T0", 4, 5), ("0B0", 5, 7)]
    assert [(str(e.action), e.start, e.end) for e in res.collectives] == [
        ("0BCAST_F0", 1, 1.5), ("0ALLREDUCE_S0", 3.5, 4), ("0REDUCE_B0", 4, 4.5)]
    assert res.peak_memory == [1.25]


@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved_zb", "dualpipev"])
def test_each_rank_does_its_own_s_and_t_work(name):
    pp, m = 4, 8
    s, t = [1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 1.0, 1.5]
    base = zbpipe.simulate(zbpipe.compile(name, pp, m))
    res = zbpipe.simulate(zbpipe.compile(name, pp, m, vocab_parallel=True, s=s, t=t), s=s, t=t)
    assert res.busy == pytest.approx([b + m * (s[r] + t[r]) for r, b in enumerate(base.busy)])
    assert res.makespan >= max(res.busy)


def test_the_collective_latency_lengthens_the_step():
    prog = zbpipe.compile("1f1b", 4, 8, vocab_parallel=True)
    fast, slow = zbpipe.simulate(prog, collective=0.0), zbpipe.simulate(prog, collective=0.5)
    assert slow.makespan > fast.makespan
    # Every collective completes at the same time on every rank: its last post plus the latency.
    done = {}
    for e in slow.collectives:
        done.setdefault((e.action.kind, e.action.microbatch), set()).add(e.end)
    assert all(len(v) == 1 for v in done.values()) and len(done) == 3 * 8


def test_memory_of_the_vocabulary_passes_is_spread_over_the_ranks():
    """At a large vocabulary the head on one rank dominates its memory; split, every rank holds
    its shard's S until its T."""
    base = zbpipe.simulate(zbpipe.compile("1f1b", 4, 8), mem_f=1.0)
    for lookahead in (0, 2):  # each forward run ahead holds one more microbatch
        prog = zbpipe.compile("1f1b", 4, 8, vocab_parallel=True, backlog=1, lookahead=lookahead)
        res = zbpipe.simulate(prog, mem_f=1.0, mem_s=0.5)
        for r in range(4):
            assert base.peak_memory[r] + 0.5 <= res.peak_memory[r] <= base.peak_memory[r] + lookahead + 0.5 + 1e-9


@pytest.mark.parametrize("name,pp", [("1f1b", 4), ("zb_h1", 4), ("gpipe", 4), ("zbv", 2)])
def test_the_placement_keeps_the_best_policy_it_tries(name, pp):
    """compile() tries a few placements (vocab.h place_vocab) and keeps the fastest under the
    costs: never slower than the default policy alone; for 1F1B (the last stage's backward right
    after its forward) letting a reduction lag a broadcast is faster."""
    m, costs = 4 * pp, dict(f=2.0, b=2.0, w=2.0, comm=0.05)
    head = dict(s=1.2, t=0.6, collective=0.1)
    grid = zbpipe.simulate(zbpipe.compile(name, pp, m, vocab_parallel=True, **costs, **head), **costs, **head)
    one = _C.insert_vocab(zbpipe.compile(name, pp, m), f=[2.0], b=[2.0], w=[2.0], comm=0.05, s=[1.2], t=[0.6],
                          collective=0.1)
    single = zbpipe.simulate(one, **costs, **head)
    assert grid.makespan <= single.makespan
    if name == "1f1b":
        assert grid.makespan < 0.95 * single.makespan


def test_the_drawings_show_the_passes_and_the_collectives(tmp_path, capsys):
    from zbpipe import plot
    from zbpipe.cli import main
    from zbpipe.timeline_text import slot_grid

    prog = zbpipe.compile("1f1b", 2, 2, vocab_parallel=True)
    res = zbpipe.simulate(prog, collective=0.5)
    grid = slot_grid(prog, res)
    assert "S0" in grid and "T1" in grid
    boxes, arrows = plot.program_boxes(prog, res, 0.0)
    assert {b.kind for b in boxes} >= {"S", "T", "COMM"}
    root = prog.stage_to_rank[-1]
    assert any(a.src_rank == root and a.dst_rank != root for a in arrows)  # a broadcast
    assert any(a.dst_rank == root and a.src_rank != root and a.end - a.start >= 0.5 for a in arrows)  # a reduction
    assert main(["plan", "1f1b", "--pp", "2", "-m", "2", "--vocab-parallel"]) == 0
    assert "S0" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    out = tmp_path / "vocab.png"
    assert main(["draw", "zbv", "--pp", "2", "-m", "4", "--vocab-parallel", "--s", "0.5", "--collective", "0.1",
                 "-o", str(out)]) == 0
    assert out.stat().st_size > 1000
