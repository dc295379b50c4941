"""Program.from_csv reads only what a CSV schedule can be: a regular file of at most the stated
size (size_limits()["csv_bytes"]), UTF-8. A directory, a FIFO or device, a larger file (refused
before any byte is read) and bytes that are not UTF-8 (named by byte offset and line) each give
a one-line zbpipe.ScheduleError."""

from __future__ import annotations

import os

import pytest

import zbpipe
from zbpipe import _C

LIMIT = _C.size_limits()["csv_bytes"]


def _refused(path, *needles) -> str:
    with pytest.raises(zbpipe.ScheduleError) as info:
        zbpipe.Program.from_csv(str(path))
    msg = str(info.value)
    assert "\n" not in msg, msg  # one line
    for n in needles:
        assert n in msg, msg
    return msg


def test_a_directory_is_refused(tmp_path):
    _refused(tmp_path, "it is a directory")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "schedule.csv"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    _refused(fifo, "not a regular file", "FIFO")


def test_a_device_is_refused():
    _refused("/dev/zero", "not a regular file")


def test_a_file_above_the_limit_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.csv"
    with open(big, "wb") as f:
        f.truncate(LIMIT + 1)  # sparse: no disk used, and reading it would take the limit's memory
    _refused(big, f"{LIMIT + 1} bytes is above zbpipe's limit of {LIMIT} bytes")


def test_bytes_that_are_not_utf8_are_named_by_offset_and_line(tmp_path):
    good = zbpipe.compile("1f1b", 2, 2)
    path = tmp_path / "schedule.csv"
    good.to_csv(str(path))
    text = path.read_bytes()
    first_line = text.index(b"\n") + 1
    path.write_bytes(text[:first_line + 3] + b"\xff" + text[first_line + 3:])
    _refused(path, "byte 0xFF", f"byte offset {first_line + 3}", "(line 2)", "not UTF-8")
    path.write_bytes(text[:5] + b"\xc3\x28" + text[5:])  # a lead byte without its continuation
    _refused(path, "byte 0xC3", "byte offset 5", "(line 1)")


def test_a_regular_utf8_file_still_reads(tmp_path):
    prog = zbpipe.compile("zbv", 2, 4)
    path = tmp_path / "schedule.csv"
    prog.to_csv(str(path))
    back = zbpipe.Program.from_csv(str(path))
    assert all(back.actions(r) == prog.actions(r) for r in range(2))
