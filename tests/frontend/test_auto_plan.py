"""zbpipe/tuning/auto_plan.py without processes: plan() on hand-made measurements (pp=2, one stage per
rank) judges every candidate under the measured costs plus the unmodelled time, picks the
fitting one of least prediction, refuses a budget below every need with ScheduleAuto's message,
plans the cost-driven candidate under each rank's own budget, names the near candidates of a
trial, prices a fused B only where every stage measured one; Tuning.after_trial keeps the
fastest tried candidate, as a new value. ScheduleAuto's own runs: test_schedule_auto.py."""

from __future__ import annotations

import dataclasses
import re

import pytest

import zbpipe
from zbpipe.auto_plan import plan
from zbpipe.measurements import Measured
from zbpipe.schedule_auto import FAMILIES

PP, M = 2, 4
NAMES = FAMILIES["one"][1]  # zb_h1, 1f1b, zb_h2, zb_auto
SAFE = zbpipe.compile("zb_h1", PP, M)
UNMODELLED = 0.5  # seconds a timing step took beyond its simulation


def _measured(mem_f=(100.0, 100.0), b=(None, None)) -> Measured:
    """F 1 ms, I 1 ms, W 2 ms on both stages (a W-heavy model: zb_h2's extra warm-up pays off),
    mem_w half of mem_f, one timing step of zb_h1 taking UNMODELLED beyond its simulation."""
    costs = {s: {"f": 1e-3, "i": 1e-3, "w": 2e-3, "b": b[s]} for s in range(PP)}
    deltas = {s: {"mem_f": mem_f[s], "mem_w": mem_f[s] / 2} for s in range(PP)}
    model = dict(f=[1e-3] * PP, b=[1e-3] * PP, w=[2e-3] * PP, comm=1e-4, mem_f=list(mem_f),
                 mem_w=[m / 2 for m in mem_f])
    if all(x is not None for x in b):
        model["b_full"] = list(b)
    wall = zbpipe.simulate(SAFE, **model).makespan + UNMODELLED
    return Measured(costs, deltas, 1e-4, [wall])


def _plan(measured=None, budget=None, **kwargs):
    return plan(measured or _measured(), NAMES, budget, safe=SAFE, ran=[SAFE], **kwargs)


@pytest.mark.parametrize("budget, choice", [(None, "zb_h1"), (1e9, "zb_h2")])
def test_the_choice_is_the_first_fitting_candidate_of_least_prediction(budget, choice):
    t = _plan(budget=budget)
    assert t.overhead_s == pytest.approx(UNMODELLED, rel=1e-9)
    safe_peak = list(zbpipe.simulate(SAFE, **t.model).peak_memory)
    assert t.budget == (safe_peak if budget is None else [budget] * PP), t.budget
    cands = {c.name: c for c in t.candidates}
    assert list(cands) == list(NAMES)
    for name in ("zb_h1", "1f1b", "zb_h2"):  # the fixed ones as compiled, judged under the model
        res = zbpipe.simulate(zbpipe.compile(name, PP, M), **t.model)
        assert cands[name].predicted_s == pytest.approx(res.makespan + UNMODELLED, rel=1e-12), name
        assert cands[name].fits == all(p <= b for p, b in zip(res.peak_memory, t.budget)), name
    # zb_h2 holds one microbatch more than zb_h1: over the default budget, the fastest under a large one.
    assert cands["zb_h2"].fits == (budget is not None)
    fitting = [c for c in t.candidates if c.fits]
    least = min(c.predicted_s for c in fitting)
    first = next(c.name for c in fitting if c.predicted_s <= least * (1 + 1e-9))
    assert t.choice == t.planned == first == choice, t.table()
    assert t.predicted_s == cands[choice].predicted_s and t.programs[choice].schedule == choice
    assert t.predict(t.programs[choice]) == cands[choice]


def test_a_budget_below_every_need_names_the_smallest():
    needs = {n: max(zbpipe.simulate(zbpipe.compile(n, PP, M), **_plan().model).peak_memory)
             for n in ("zb_h1", "1f1b", "zb_h2")}
    with pytest.raises(zbpipe.ScheduleError) as e:
        _plan(budget=1)
    m = re.fullmatch(r"ScheduleAuto: activation_budget 1 bytes per rank is below what every candidate needs; "
                     r"the smallest need is (\d+) bytes \((\w+)\)", str(e.value))
    assert m, str(e.value)
    need, who = min((v, n) for n, v in needs.items())  # zb_auto cannot be built under 1 byte
    assert (int(m[1]), m[2]) == (round(need), who), (m.groups(), needs)


def test_the_cost_driven_candidate_plans_under_each_ranks_own_budget():
    # Stage 1 saves 30x stage 0's bytes: the default budget (zb_h1's peak per rank) is unequal.
    t = _plan(_measured(mem_f=(100.0, 3000.0)))
    assert t.budget[1] > 4 * t.budget[0], t.budget
    auto = next(c for c in t.candidates if c.name == "zb_auto")
    assert auto.fits and all(p <= b * (1 + 1e-9) for p, b in zip(auto.peak_bytes, t.budget)), (auto, t.budget)
    # Planned with the bytes as measured under the largest budget as its one cap, it would
    # overrun the light rank's budget: the scaling is what holds each rank to its own.
    m = t.model
    raw = zbpipe.compile("zb_auto", PP, M, f=m["f"], b=m["b"], w=m["w"], comm=m["comm"], mem_f=m["mem_f"],
                         mem_w=m["mem_w"], memory_cap=max(t.budget))
    assert zbpipe.simulate(raw, **m).peak_memory[0] > t.budget[0]


def test_the_near_candidates_are_named_for_a_trial_only():
    # Under the default budget zb_auto builds zb_h1's very program: tried once, as zb_h1.
    t = _plan(trial_steps=2, trial_margin=10.0)
    assert t.programs["zb_auto"].to_csv_text() == t.programs["zb_h1"].to_csv_text()
    assert t.trial == ["zb_h1", "1f1b"], t.table()  # every fitting one (zb_h2 is over the budget)
    assert _plan(trial_steps=2, trial_margin=0.0).trial == []  # zb_h1 alone (zb_auto ties as its program)
    assert _plan(trial_steps=0, trial_margin=10.0).trial == []  # no trial asked
    # Under a large budget: within 0.1% of the least, all but 1f1b (0.6% behind), in candidate order.
    near = _plan(budget=1e9, trial_steps=1, trial_margin=0.001)
    slow = next(c.predicted_s for c in near.candidates if c.name == "1f1b")
    assert slow > 1.001 * near.predicted_s and near.trial == ["zb_h1", "zb_h2", "zb_auto"], near.table()


def test_a_fused_b_is_priced_as_measured_only_where_every_stage_measured_it():
    t = _plan(_measured(b=(5e-3, 5e-3)))
    assert t.model["b_full"] == [5e-3, 5e-3]
    one = zbpipe.compile("1f1b", PP, M)
    priced = next(c.predicted_s for c in t.candidates if c.name == "1f1b")
    assert priced == pytest.approx(zbpipe.simulate(one, **t.model).makespan + t.overhead_s, rel=1e-12)
    split = {k: v for k, v in t.model.items() if k != "b_full"}
    assert priced != pytest.approx(zbpipe.simulate(one, **split).makespan + t.overhead_s, rel=1e-9)
    assert "b_full" not in _plan(_measured(b=(5e-3, None))).model
    assert "b_full" not in _plan().model


def test_after_trial_keeps_the_least_median_of_the_counted_steps():
    t = _plan(trial_steps=2, trial_margin=10.0)
    a, b = t.trial  # zb_h1, 1f1b
    # An uncounted (warm-up) step of b, then two rounds: a's median 3, b's 2 (its slow warm-up not counted).
    order = [(b, False), (a, True), (b, True), (a, True), (b, True)]
    after = t.after_trial(order, [9.0, 3.0, 2.0, 3.0, 2.0])
    assert (after.choice, after.predicted_s) == (b, next(c.predicted_s for c in t.candidates if c.name == b))
    assert {c.name: c.trial_s for c in after.candidates if c.trial_s} == {a: [3.0, 3.0], b: [2.0, 2.0]}
    # A new value: the plan stays as planned, and cannot be changed in place.
    assert t.choice == t.planned == a and not any(c.trial_s for c in t.candidates)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.choice = b
    tie = t.after_trial([(a, True), (b, True)], [1.0, 1.0])
    assert tie.choice == a  # a tie: the first
    assert "trial, median of 1 steps each" in tie.table()
