"""The independent checker accepts compiled programs and rejects broken ones (so it can fail),
and on random single mutations it agrees with zbpipe.validate."""

import random

import pytest
from helpers.program_checker import ProgramError, check, check_program

import zbpipe

CASES = [("1f1b", 3, 5), ("interleaved_zb", 3, 6), ("zbv", 3, 6), ("dualpipev", 2, 5)]


def rows(prog):
    return [prog.actions(r) for r in range(prog.pp)]


def first(row, pred):
    return next(i for i, a in enumerate(row) if pred(a))


@pytest.mark.parametrize("name,pp,m", CASES)
def test_accepts_compiled_programs(name, pp, m):
    check(zbpipe.compile(name, pp, m))


def mutations(prog):
    """(description, rows) pairs, each breaking one rule."""
    r0 = rows(prog)

    def edit(fn):
        new = [list(row) for row in r0]
        fn(new)
        return new

    def drop_compute(n):
        del n[1][first(n[1], lambda a: "W" in a or "B" in a and "SEND" not in a and "RECV" not in a)]

    def drop_recv(n):
        del n[1][first(n[1], lambda a: "RECV" in a)]

    def send_before_compute(n):  # swap a forward with the SEND that must follow it
        i = first(n[0], lambda a: "SEND_F" in a)
        n[0][i - 1], n[0][i] = n[0][i], n[0][i - 1]

    def swap_sends(n):  # two sends to the same peer in the other order
        idx = [i for i, a in enumerate(n[0]) if "SEND_F" in a]
        n[0][idx[0]], n[0][idx[1]] = n[0][idx[1]], n[0][idx[0]]

    def duplicate(n):
        n[0].append(n[0][0])

    def wrong_rank(n):
        n[1].insert(0, n[0].pop(first(n[0], lambda a: a.endswith("F0") and "SEND" not in a)))

    def recv_late(n):  # a RECV moved after the compute that needs it
        i = first(n[1], lambda a: "RECV_F" in a)
        recv = n[1].pop(i)
        n[1].insert(first(n[1], lambda a: a == recv.replace("RECV_F", "F")) + 1, recv)

    return [(f.__name__, edit(f)) for f in
            (drop_compute, drop_recv, send_before_compute, swap_sends, duplicate, wrong_rank, recv_late)]


@pytest.mark.parametrize("name,pp,m", CASES[:3])
def test_rejects_each_mutation(name, pp, m):
    prog = zbpipe.compile(name, pp, m)
    for what, broken in mutations(prog):
        with pytest.raises(ProgramError):
            check_program(broken, list(prog.stage_to_rank), prog.microbatches)
        assert broken != rows(prog), what


def test_rejects_dependent_overlap_parts():
    # The two halves of an OVERLAP_F_B run together, so one may not need the other.
    with pytest.raises(ProgramError, match="deadlock"):
        check_program([["(0F0;0B0)OVERLAP_F_B"]], [0], 1)
    check_program([["0F0", "(0F1;0B0)OVERLAP_F_B", "0B1"]], [0], 2)


def random_mutation(rng, r0):
    new = [list(row) for row in r0]
    r = rng.randrange(len(new))
    row = new[r]
    op = rng.choice(["drop", "swap", "dup", "move"])
    i = rng.randrange(len(row))
    if op == "drop":
        del row[i]
    elif op == "swap":
        j = min(len(row) - 1, i + rng.randint(1, 3))
        row[i], row[j] = row[j], row[i]
    elif op == "dup":
        row.insert(rng.randrange(len(row) + 1), row[i])
    else:
        row.insert(rng.randrange(len(row) + 1), row.pop(i))
    return new


@pytest.mark.parametrize("name,pp,m", CASES)
def test_agrees_with_validate_on_random_mutations(name, pp, m):
    prog = zbpipe.compile(name, pp, m)
    rng = random.Random(1234)
    rejected = 0
    for _ in range(60):
        broken = random_mutation(rng, rows(prog))
        try:
            check_program(broken, list(prog.stage_to_rank), prog.microbatches)
            ours = True
        except ProgramError:
            ours = False
        try:
            zbpipe.Program.from_actions(broken, list(prog.stage_to_rank), prog.microbatches)
            theirs = True
        except zbpipe.ScheduleError:
            theirs = False
        assert ours == theirs, (broken, ours, theirs)
        rejected += not ours
    assert rejected > 30  # most mutations break something: the comparison is not vacuous
