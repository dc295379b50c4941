"""Every long loop of the core polls for cancellation (zbpipe/cancel.h): a Python signal handler
that raises stops a core call at its next poll, as Ctrl-C does (the binding runs the handlers
from the poll, tests/frontend/test_interrupt.py sends the real SIGINT). Here SIGALRM's handler
raises in this process, inside calls that ran seconds without a poll before (issue 35): the span
lower bound's rank pairs, the refinement's gap search. The bound on the delay is generous: the
polls come every 50 ms or so, a loaded machine adds some."""

from __future__ import annotations

import signal
import time

import pytest

import zbpipe

GENEROUS_S = 5.0


class Alarm(Exception):
    pass


def interrupt_delay(call, after_s: float) -> float:
    """Raises Alarm from a SIGALRM handler `after_s` seconds into call() and returns the seconds
    from the signal to the exception out of call(). Fails if call() returns first."""
    start = time.monotonic()

    def handler(signum, frame):
        raise Alarm

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, after_s)
        with pytest.raises(Alarm):
            call()
        raised = time.monotonic()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # The handler runs only at a poll, and the call unwinds after it.
    return raised - (start + after_s)


def test_span_lower_bound_polls():
    # pp = 2048: pp^2 rank pairs with a chain of O(pp) each, about 20 s of CPU without a poll.
    shape = zbpipe.compile("1f1b", 2048, 1)
    assert interrupt_delay(lambda: zbpipe.lower_bound(shape), 0.5) < GENEROUS_S


def test_refine_polls():
    # The gap search of one rank of 4096 microbatches: tens of seconds without a poll.
    prog = zbpipe.compile("zb_h1", 8, 4096)
    call = lambda: zbpipe.refine(prog, f=1.0, b=[1.0, 3.0, 1.0, 2.0] * 2, w=0.5, comm=0.3,
                                 budget=10**9)
    assert interrupt_delay(call, 1.0) < GENEROUS_S


def test_the_core_is_usable_after_an_interrupt():
    shape = zbpipe.compile("1f1b", 1024, 1)
    interrupt_delay(lambda: zbpipe.lower_bound(shape), 0.2)
    assert zbpipe.lower_bound(zbpipe.compile("1f1b", 4, 8)).max_span > 0
