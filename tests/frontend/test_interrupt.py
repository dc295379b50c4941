"""Ctrl-C inside the schedule core: a long compile or search stops at the core's next poll
(zbpipe/cancel.h; the binding runs Python's signal handlers at most every 50 ms) and raises
KeyboardInterrupt, and the process goes on working. Each case runs in a child process that gets
a real SIGINT while the call, which would take far longer uninterrupted, is running."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.subprocess_env import NEUTRAL_CWD, child_env

CHILD = textwrap.dedent("""
    import signal, sys, time
    # A test run started in the background of a shell without job control inherits SIGINT
    # ignored; a user's terminal does not: Python's own handler, as at an interactive start.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import zbpipe
    from zbpipe import _C
    SETUP
    print("ready", flush=True)
    try:
        CALL
        print("finished", flush=True)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic(), flush=True)
    # The core is usable afterwards: the interrupt left no state behind.
    assert zbpipe.compile("1f1b", 2, 2).actions(0)[0] == "0F0"
    print("usable", flush=True)
""")

# Calls that run for minutes on this machine if left alone (the interrupt must come from
# inside them, or the child prints "finished").
LONG_CALLS = {  # (setup, call)
    # The list search, its grid shared between two threads: both must stop.
    "search": ("", "zbpipe.compile('zb_auto', 512, 2048, search_threads=2)"),
    # A fixed schedule at the size limit: builder, lowering and validation.
    "passes": ("", "zbpipe.compile('zbv', 2048, 1024)"),
    # CSV import of 2M (stage, microbatch) pairs: parse, lowering, validation and the rendezvous check.
    "csv": ("text = _C.build('1f1b', 2048, 1024).to_csv_text()",
            "zbpipe.Program.from_csv_text(text, rendezvous=True)"),
}


@pytest.mark.parametrize("case", sorted(LONG_CALLS))
def test_sigint_interrupts_a_long_core_call(case):
    setup, call = LONG_CALLS[case]
    code = CHILD.replace("SETUP", setup).replace("CALL", call)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), cwd=NEUTRAL_CWD)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(1.0)  # well inside the call by now
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    words = out.split()
    assert words[0] == "interrupted" and words[2] == "usable", (out, err[-2000:])
    # Generous: the poll comes within 50 ms of the signal, a loaded machine adds a little.
    assert float(words[1]) - sent < 10.0, out
