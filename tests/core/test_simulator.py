"""The simulator against closed forms: it is the oracle for every builder, so it is checked
against numbers derived by hand, not against itself."""

import pytest

import zbpipe
from zbpipe import ScheduleError


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 3), (4, 8), (8, 8), (8, 24), (16, 64)])
def test_1f1b_bubble_closed_form(pp, m):
    res = zbpipe.simulate(zbpipe.compile("1f1b", pp=pp, microbatches=m), f=1, b=1, w=1)
    assert res.bubble_rate == pytest.approx((pp - 1) / (m + pp - 1))
    assert res.makespan == pytest.approx((m + pp - 1) * 3)  # B = b + w = 2
    assert res.peak_activations == [min(m, pp - r) for r in range(pp)]
    assert res.busy == pytest.approx([3.0 * m] * pp)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (8, 5)])
def test_gpipe_with_comm_latency(pp, m):
    f, b, w, c = 1.0, 1.5, 0.5, 0.25
    res = zbpipe.simulate(zbpipe.compile("gpipe", pp=pp, microbatches=m), f=f, b=b, w=w, comm=c)
    # Forward wave reaches the last rank after (p-1)(F+c), it runs m F then m B back to back,
    # then the last microbatch's gradient walks back (p-1)(B+c).
    full_b = b + w
    assert res.makespan == pytest.approx((pp - 1) * (f + full_b + 2 * c) + m * (f + full_b))
    assert res.peak_activations == [m] * pp


def test_per_stage_costs_and_full_backward_override():
    prog = zbpipe.compile("gpipe", pp=2, microbatches=1)
    res = zbpipe.simulate(prog, f=[1.0, 2.0], b=[1.0, 1.0], w=[0.0, 0.0], b_full=[3.0, 4.0])
    assert res.makespan == pytest.approx(1 + 2 + 4 + 3)
    assert res.busy == pytest.approx([4.0, 6.0])
    assert [str(e.action) for e in res.timeline] == ["0F0", "0B0", "1F0", "1B0"]
    starts = {str(e.action): (e.start, e.end) for e in res.timeline}
    assert starts["1B0"] == pytest.approx((3.0, 7.0))
    assert starts["0B0"] == pytest.approx((7.0, 10.0))


def test_bubble_rate_is_span_based_and_idle_rate_uses_makespan():
    # gpipe p=2 m=1 at unit costs: rank 1 starts after rank 0's forward. The paper's bubble
    # rate counts rank 0's span; idle_rate counts the whole makespan for every rank.
    res = zbpipe.simulate(zbpipe.compile("gpipe", pp=2, microbatches=1), f=1, b=1, w=1)
    assert res.makespan == pytest.approx(6.0)
    assert res.span == pytest.approx([6.0, 3.0])
    assert res.bubble_rate == pytest.approx(1 - 6.0 / 12.0)
    assert res.idle_rate == pytest.approx(1 - 6.0 / 12.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(f=[1.0, 2.0, 3.0]), "one per stage"),
        (dict(f=-1.0), "non-negative"),
        (dict(comm=-0.5), "non-negative"),
        (dict(b=[]), "at least one value"),
    ],
)
def test_bad_costs_raise(kwargs, match):
    prog = zbpipe.compile("1f1b", pp=2, microbatches=2)
    with pytest.raises(ScheduleError, match=match):
        zbpipe.simulate(prog, **kwargs)


def test_split_backward_costs_count_i_and_w():
    # A hand-written I/W program on one rank: F, I, W per microbatch.
    prog = zbpipe.Program.from_actions([["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"]], [0], 2)
    res = zbpipe.simulate(prog, f=1.0, b=2.0, w=3.0)
    assert res.makespan == pytest.approx(12.0)
    assert res.peak_activations == [1]
    assert res.bubble_rate == pytest.approx(0.0)
