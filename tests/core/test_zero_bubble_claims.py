"""The zero-bubble schedules keep their papers' promises in the simulator: ZB-H2 and ZB-V have no
idle time inside any rank's span at equal F/I/W costs once microbatches >= 2*pp - 1, within the
stated memory; below that size they stay valid but idle (so the condition is the real one)."""

import pytest

import zbpipe


def idle_per_rank(prog, **costs):
    res = zbpipe.simulate(prog, **costs)
    return [span - busy for span, busy in zip(res.span, res.busy)], res


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 7, 8])
def test_zb_h2_bubble_free_from_2p_minus_1(pp):
    for m in (2 * pp - 1, 2 * pp, 3 * pp + 1):
        idle, res = idle_per_rank(zbpipe.compile("zb_h2", pp, m))
        assert idle == [0.0] * pp, (pp, m, idle)
        assert res.span == [3.0 * m] * pp  # F + I + W per microbatch, nothing else
        assert res.bubble_rate == 0.0
        assert max(res.peak_activations) == 2 * pp - 1  # the paper's 2p-1 microbatches


@pytest.mark.parametrize("pp", [2, 4, 6])
def test_zb_h2_below_the_condition_idles(pp):
    # m = 2p-1-k leaves k units of idle on the busiest rank: the condition is tight.
    for k in range(1, 2 * pp - 1):
        idle, res = idle_per_rank(zbpipe.compile("zb_h2", pp, 2 * pp - 1 - k))
        assert max(idle) == k, (pp, k, idle)
        assert max(res.peak_activations) <= 2 * pp - 1


def test_zb_h2_beats_zb_h1_and_1f1b():
    rates = {n: zbpipe.simulate(zbpipe.compile(n, 4, 16)).bubble_rate for n in ("1f1b", "zb_h1", "zb_h2")}
    assert rates["zb_h2"] < rates["zb_h1"] < rates["1f1b"]


@pytest.mark.parametrize("pp", [1, 2, 4, 6])
def test_zbv_bubble_free_from_2p_minus_1(pp):
    for m in (2 * pp - 1, 4 * pp):
        idle, res = idle_per_rank(zbpipe.compile("zbv", pp, m))
        assert idle == [0.0] * pp, (pp, m, idle)
        # 2p (stage, microbatch) activations per rank, each half a 1F1B microbatch: 1F1B's memory.
        assert res.peak_activations == [2 * pp] * pp


@pytest.mark.parametrize("pp,m,v", [(4, 8, 2), (4, 16, 3), (5, 12, 2), (4, 3, 2), (8, 32, 2)])
def test_interleaved_zb_memory_and_bubble_against_interleaved_1f1b(pp, m, v):
    # ZB1P: w_r + 1 forwards in flight plus r pending W's gives the same peak on every rank,
    # min((v-1)*per_round + p, v*m); interleaved 1F1B's rank r holds min(w_r + 1, v*m).
    per_round = m // max(1, m // pp)
    zb = zbpipe.simulate(zbpipe.compile("interleaved_zb", pp, m, v))
    ref = zbpipe.simulate(zbpipe.compile("interleaved_1f1b", pp, m, v))
    assert zb.peak_activations == [min((v - 1) * per_round + pp, v * m)] * pp
    assert ref.peak_activations == [min((v - 1) * per_round + 2 * (pp - 1 - r) + 1, v * m) for r in range(pp)]
    assert zb.bubble_rate < ref.bubble_rate
