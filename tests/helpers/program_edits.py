"""Hand-edited copies of a compiled program, for tests of what validate refuses: the program's
rows, a Program built back from edited rows, and the check that validate and the independent
checker (program_checker.py) both refuse an edit."""

from __future__ import annotations

import re

import pytest

from zbpipe import Program, ScheduleError

from .program_checker import ProgramError, check_vocab_program


def rows_of(prog) -> list[list[str]]:
    """Every rank's actions, as editable lists."""
    return [prog.actions(r) for r in range(prog.pp)]


def edited(rows, prog) -> Program:
    """`rows` as a program of `prog`'s placement and microbatches; validate runs on it."""
    return Program.from_actions(rows, list(prog.stage_to_rank), prog.microbatches, name="edited")


def assert_vocab_edit_refused(rows, prog, why: str) -> None:
    """validate refuses `rows` naming `why`; so does the independent checker, except for an
    action naming another rank's shard ("shard" in why), which it does not parse."""
    with pytest.raises(ScheduleError, match=re.escape(why)):
        edited(rows, prog)
    if "shard" not in why:
        with pytest.raises(ProgramError):
            check_vocab_program(rows, list(prog.stage_to_rank), prog.microbatches)
