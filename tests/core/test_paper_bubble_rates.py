"""The simulator reproduces the Zero Bubble paper's published bubble rates.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), Table 6 (profiled T_F, T_B, T_W,
T_comm measured in ZB-2p runs) and Table 5 (bubble rates computed from them). The paper defines
bubble rate as (cost - m(T_F+T_B+T_W)) / cost with cost the largest execution time of all
stages, which is SimResult.bubble_rate. Published values are rounded to 4 decimals.

ZB-1p and ZB-2p are the paper's automatic schedules at memory limits p and 2p microbatches: its
heuristic plus an ILP refinement. zbpipe's zb_auto is the heuristic's search alone; at limit p
it matches ZB-1p on every row, at 2p it beats ZB-H2 but misses ZB-2p (README, "zb_auto against
the paper").
"""

import pytest

import zbpipe

# (model, p, m, T_F, T_B, T_W, T_comm, 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p)
TABLE = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.2347, 0.1323, 0.0698, 0.1323, 0.0029),
    ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577, 0.1898, 0.1045, 0.0559, 0.1045, 0.0022),
    ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535, 0.1091, 0.0554, 0.0294, 0.0554, 0.0010),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1397, 0.0672, 0.1397, 0.0066),
    ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379, 0.2082, 0.1088, 0.0516, 0.1088, 0.0054),
    ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378, 0.1251, 0.0576, 0.0266, 0.0576, 0.0028),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.2646, 0.1421, 0.0641, 0.1421, 0.0038),
    ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 0.2168, 0.1106, 0.0490, 0.1106, 0.0029),
    ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460, 0.1352, 0.0594, 0.0257, 0.0594, 0.0018),
]
IDS = [f"{r[0]}-m{r[2]}" for r in TABLE]


@pytest.mark.parametrize("row", TABLE, ids=IDS)
@pytest.mark.parametrize("schedule,column", [("1f1b", 7), ("zb_h1", 8), ("zb_h2", 9)])
def test_published_bubble_rate(row, schedule, column):
    _, p, m, f, b, w, c = row[:7]
    res = zbpipe.simulate(zbpipe.compile(schedule, pp=p, microbatches=m), f=f, b=b, w=w, comm=c)
    assert res.bubble_rate == pytest.approx(row[column], abs=5e-5)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 24), (16, 64)])
def test_closed_form_bubble_sizes_without_comm(p, m):
    # The paper's Table 2: bubble time (p-1)(F+B+W), (p-1)(F+B-W), (p-1)(F+B-2W) for
    # 1F1B, ZB-H1, ZB-H2 (the last needs T_W small enough that the formula stays >= 0).
    f, b, w = 3.0, 3.5, 1.25
    for schedule, bubble in [("1f1b", f + b + w), ("zb_h1", f + b - w), ("zb_h2", f + b - 2 * w)]:
        res = zbpipe.simulate(zbpipe.compile(schedule, pp=p, microbatches=m), f=f, b=b, w=w)
        assert max(res.span) - m * (f + b + w) == pytest.approx((p - 1) * bubble), schedule


def zb_auto_at(row, cap_in_p):
    _, p, m, f, b, w, c = row[:7]
    costs = dict(f=f, b=b, w=w, comm=c)
    res = zbpipe.simulate(zbpipe.compile("zb_auto", p, m, memory_cap=cap_in_p * p, **costs), **costs)
    assert max(res.peak_activations) <= cap_in_p * p
    return res.bubble_rate


@pytest.mark.parametrize("row", TABLE, ids=IDS)
def test_zb_1p_published_bubble_rate(row):
    # The paper's search at 1F1B's memory finds no better than ZB-H1 either (its column equals
    # ZB-H1's on every row, "the memory limit becomes the dominate factor").
    assert zb_auto_at(row, 1) == pytest.approx(row[10], abs=5e-5)


@pytest.mark.parametrize("row", TABLE, ids=IDS)
def test_zb_2p_beats_zb_h2_but_misses_the_published_rate(row):
    # The paper: "ZB-H2 consistently performs worse than ZB-2p"; zb_auto at 2p beats ZB-H2 by
    # 4-13% of its bubble, while the published ZB-2p (< 1% on most rows) comes with the ILP,
    # which zb_auto does not run. If the lower bound fails, zb_auto got better: update the
    # README table.
    got = zb_auto_at(row, 2)
    assert got < 0.97 * row[9]
    assert got > 0.85 * row[9]
    assert got > row[11]
