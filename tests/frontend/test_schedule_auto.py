"""ScheduleAuto (zbpipe/schedule_auto.py) at pp=2 over Gloo: gradients exact across the switch
from the measuring step to the chosen program (steps 1-4 against one process) for the three
placements, every rank on the same program, the budget deciding the choice, the tuning's
fields and table, and its errors (a budget nothing fits, a placement of no family, ranks whose
measurements disagree)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.asserts import assert_close
from helpers.model_registry import build, call_chain, data

import zbpipe
from zbpipe.schedule_auto import FAMILIES, placement_of

PP, M, STEPS = 2, 4, 4
LAYOUTS = {"one": [0, 1], "v": [0, 1, 1, 0], "looped": [0, 1, 0, 1]}  # stage -> rank


def _auto(rank, pp, placement, **kwargs):
    stage_to_rank = LAYOUTS[placement]
    mods = build("mlp", len(stage_to_rank))
    stages = [zbpipe.PipelineStage(mods[s], s, len(stage_to_rank), "cpu")
              for s, r in enumerate(stage_to_rank) if r == rank]
    return zbpipe.ScheduleAuto(stages, M, loss_fn=F.mse_loss, timeout=60, **kwargs), stages, mods


def _step(sched, stages, k):
    x, y = data("mlp", 2 * M, seed=k + 1)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    return sched.step(*((x,) if first else ()), target=y if last else None)


def _tune(sched, stages):
    """The tuning's two steps: memory (step 1), then times (step 2); the choice runs from step 3."""
    _step(sched, stages, 0)
    _step(sched, stages, 1)


def _train(rank, pp, placement):
    sched, stages, _ = _auto(rank, pp, placement)
    programs = []
    for k in range(STEPS):
        programs.append(sched.program.to_csv_text())  # the program step k runs
        _step(sched, stages, k)
    grads = {(s.stage_index, n): p.grad.clone() for s in stages for n, p in s.submod.named_parameters()}
    t = sched.tuning
    return dict(grads=grads, programs=programs, choice=sched.choice, table=t.table(), costs=t.costs,
                deltas=t.deltas, candidates=[(c.name, c.predicted_s, c.peak_bytes, c.fits) for c in t.candidates],
                measured=t.measured_step_s, predicted=t.predicted_s, safe=FAMILIES[sched.placement][0],
                overhead=t.overhead_s, comm=t.comm_s, judged=t.predict(sched.program))


@pytest.mark.parametrize("placement", sorted(LAYOUTS))
def test_exact_gradients_and_one_program_across_the_switch(spawn_world, placement):
    results = spawn_world(PP).run(_train, placement, timeout_s=240)
    mods = build("mlp", len(LAYOUTS[placement]))
    for k in range(STEPS):
        x, y = data("mlp", 2 * M, seed=k + 1)
        F.mse_loss(call_chain(mods, x), y).backward()
    for res in results:
        for (stage, name), g in res["grads"].items():
            assert_close(g, dict(mods[stage].named_parameters())[name].grad, msg=f"{placement} {stage}.{name}")
    assert results[0]["programs"] == results[1]["programs"], "the ranks ran different programs"
    assert results[0]["choice"] == results[1]["choice"]
    safe = zbpipe.compile(results[0]["safe"], PP, M, len(LAYOUTS[placement]) // PP).to_csv_text()
    chosen = results[0]["programs"][2]
    assert results[0]["programs"][:2] == [safe] * 2 and results[0]["programs"][2:] == [chosen] * (STEPS - 2)
    # The tuning's fields: costs and deltas of every stage, every candidate of the family.
    res = results[0]
    assert sorted(res["costs"]) == list(range(len(LAYOUTS[placement])))
    assert all(c["f"] > 0 and c["i"] > 0 and c["w"] > 0 for c in res["costs"].values()), res["costs"]
    assert all(d["mem_f"] > 0 and 0 < d["mem_w"] <= d["mem_f"] for d in res["deltas"].values()), res["deltas"]
    names = [c[0] for c in res["candidates"]]
    assert names == list(FAMILIES[placement][1])
    assert res["measured"] is not None and res["measured"] > 0 and res["predicted"] > 0
    for name in names:
        assert name in res["table"]
    assert f"choice: {res['choice']}" in res["table"] and "<- chosen" in res["table"], res["table"]
    # A prediction is the simulated makespan under the measured costs plus the unmodelled time
    # (the timing step's wall time less its own simulation), the same for every candidate.
    from zbpipe.stage_costs import compile_costs
    sim = compile_costs(res["costs"], len(LAYOUTS[placement]))
    safe_sim = zbpipe.simulate(zbpipe.compile(res["safe"], PP, M, len(LAYOUTS[placement]) // PP),
                               f=sim["f"], b=sim["b"], w=sim["w"], comm=res["comm"]).makespan
    predicted = dict((c[0], c[1]) for c in res["candidates"])
    assert predicted[res["safe"]] == pytest.approx(safe_sim + res["overhead"], rel=1e-9), (predicted, safe_sim)
    assert "unmodelled" in res["table"]
    # Tuning.predict judges any program as the candidates were judged: the running program
    # gets exactly the choice's prediction and peak, and fits.
    chosen_cand = next(c for c in res["candidates"] if c[0] == res["choice"])
    judged = res["judged"]
    assert (judged.predicted_s, judged.peak_bytes, judged.fits) == chosen_cand[1:], (judged, chosen_cand)


def _budgets(rank, pp):
    """One stage per rank: the free choice (budget None: what zb_h1 held) and the choice under
    a budget of 0.7x zb_h1's peak, which only zb_auto, planned under it, can meet."""
    sched, stages, _ = _auto(rank, pp, "one")
    _tune(sched, stages)
    free = {c.name: c for c in sched.tuning.candidates}
    tight = 0.7 * max(free["zb_h1"].peak_bytes)
    tight_sched, tight_stages, _ = _auto(rank, pp, "one", activation_budget=tight)
    _tune(tight_sched, tight_stages)
    cands = {c.name: c for c in tight_sched.tuning.candidates}
    return dict(tight=tight, choice=tight_sched.choice, peak=max(cands[tight_sched.choice].peak_bytes),
                fits={n: c.fits for n, c in cands.items()}, safe_peaks=free["zb_h1"].peak_bytes,
                free_peaks=free[sched.choice].peak_bytes, table=tight_sched.tuning.table())


def test_the_budget_decides_the_candidate(spawn_world):
    a, b = spawn_world(PP).run(_budgets, timeout_s=240)
    assert a["choice"] == b["choice"]
    assert not a["fits"]["zb_h1"] and a["choice"] in ("zb_auto", "1f1b"), a
    assert a["peak"] <= a["tight"], a
    assert all(p <= s for p, s in zip(a["free_peaks"], a["safe_peaks"])), a  # None: what zb_h1 held


def _too_small(rank, pp):
    sched, stages, _ = _auto(rank, pp, "one", activation_budget=1)
    try:
        _tune(sched, stages)
    except zbpipe.ScheduleError as e:
        return str(e)
    return "no error"


def _need(rank, pp):
    sched, stages, _ = _auto(rank, pp, "one")
    _tune(sched, stages)
    return min(max(c.peak_bytes) for c in sched.tuning.candidates if c.peak_bytes)


def test_a_budget_nothing_fits_names_the_smallest_need(spawn_world):
    need = spawn_world(PP).run(_need, timeout_s=120)[0]
    for msg in spawn_world(PP).run(_too_small, timeout_s=120):
        assert "below what every candidate needs" in msg and f"smallest need is {need:.0f} bytes" in msg, msg


def _disagree(rank, pp):
    sched, stages, _ = _auto(rank, pp, "one")
    if rank == 1:
        real = sched._measurements
        sched._measurements = lambda *a: {**real(*a), "num_stages": 3}
    try:
        _tune(sched, stages)
    except zbpipe.ScheduleError as e:
        return str(e)
    return "no error"


def test_measurements_that_disagree_fail_every_rank(spawn_world):
    for msg in spawn_world(PP).run(_disagree, timeout_s=120):
        assert "rank 1 measured num_stages=3" in msg, msg


def test_a_placement_of_no_family_is_refused():
    assert placement_of([1], 1, 2, 2) == "one"
    assert placement_of([1, 2], 1, 2, 4) == "v"
    assert placement_of([1, 3], 1, 2, 4) == "looped"
    with pytest.raises(zbpipe.ScheduleError, match=r"holds stages \[0, 2, 3\] of 6 over pp=2, which matches no"):
        placement_of([0, 2, 3], 0, 2, 6)


def _traces(rank, pp, folder):
    sched, stages, _ = _auto(rank, pp, "one")
    _tune(sched, stages)  # the measuring steps: the trace carries the first's memory counters
    measuring = sched._schedules["zb_h1"]
    path = f"{folder}/rank{rank}.json"
    measuring.export_chrome_trace(path)
    return path, zbpipe.profile_from_trace(measuring.trace()), sched.tuning.deltas


def test_plan_from_saved_traces(spawn_world, tmp_path, capsys):
    from zbpipe.cli import main

    results = spawn_world(PP).run(_traces, str(tmp_path), timeout_s=120)
    paths = ",".join(r[0] for r in results)
    profile = zbpipe.profile_from_trace(paths)
    for path, records, deltas in results:  # the Chrome files say what the records say
        for s, costs in records.items():
            for k in "fiw":
                assert abs(profile[s][k] - costs[k]) < 1e-8, (s, k, profile[s][k], costs[k])
            assert profile[s]["mem_f"] == deltas[s]["mem_f"] and profile[s]["mem_w"] == deltas[s]["mem_w"]
    assert main(["plan", "zb_auto", "--pp", "2", "-m", "4", "--from-trace", paths]) == 0
    out = capsys.readouterr().out
    assert "simulated step:" in out and f"mem_f {profile[1]['mem_f']} B" in out and "bytes" in out, out


def _unequal_tuning(rank, placement):
    """The last stage saving about 30x a light stage's bytes per microbatch, so the safe
    default's peak (the budget when none is given) differs per rank; the tuning of its two steps."""
    torch.manual_seed(0)
    width = data("mlp", 1)[0].shape[-1]
    layout = LAYOUTS[placement]
    mods = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in layout[1:]]
    mods.append(torch.nn.Sequential(torch.nn.Linear(width, 512), torch.nn.Tanh(), torch.nn.Linear(512, width)))
    stages = [zbpipe.PipelineStage(mods[s], s, len(layout), "cpu") for s, r in enumerate(layout) if r == rank]
    sched = zbpipe.ScheduleAuto(stages, M, loss_fn=F.mse_loss, timeout=60)
    _tune(sched, stages)
    return sched.tuning


def _unequal(rank, pp):
    """One stage per rank: the heavy stage alone on rank 1."""
    t = _unequal_tuning(rank, "one")
    return t.budget, {c.name: (c.predicted_s, c.fits) for c in t.candidates}


def test_zb_auto_plans_under_unequal_per_rank_budgets(spawn_world):
    # zb_auto takes one cap for every rank: under the safe default's per-rank peaks it must be
    # built under a cap the heavy rank can hold (the smallest budget alone holds no microbatch
    # of the heavy stage) and still fit every rank's own budget.
    results = spawn_world(PP).run(_unequal, timeout_s=120)
    budget, candidates = results[0]
    assert budget[1] > 4 * budget[0], budget
    predicted, fits = candidates["zb_auto"]
    assert predicted is not None and fits, candidates
    assert results[1][1]["zb_auto"] == candidates["zb_auto"]


def _retune(rank, pp):
    """retune_every=3 over 8 steps: tunings over steps 1-2, 4-5 and 7-8."""
    sched, stages, _ = _auto(rank, pp, "one", retune_every=3)
    runs = []  # per step: the program it ran and the schedule object that ran it
    for k in range(8):
        before = sched.program.to_csv_text()
        _step(sched, stages, k)
        runs.append((before, id(sched._current), sched.choice))
    grads = {(s.stage_index, n): p.grad.clone() for s in stages for n, p in s.submod.named_parameters()}
    return dict(grads=grads, runs=runs, steps=[t.step for t in sched.history],
                choices=[t.choice for t in sched.history], clocks=[t.clock for t in sched.history],
                comm=[t.comm_s for t in sched.history], measured=[t.measured_step_s for t in sched.history])


def test_retune_every_measures_again_and_keeps_a_program_it_picks_again(spawn_world):
    results = spawn_world(PP).run(_retune, timeout_s=240)
    mods = build("mlp", PP)
    for k in range(8):
        x, y = data("mlp", 2 * M, seed=k + 1)
        F.mse_loss(call_chain(mods, x), y).backward()
    for res in results:
        for (stage, name), g in res["grads"].items():
            assert_close(g, dict(mods[stage].named_parameters())[name].grad, msg=f"retune {stage}.{name}")
    a, b = results
    assert a["steps"] == [2, 5, 8] and a["choices"] == b["choices"], (a["steps"], a["choices"], b["choices"])
    assert [r[0] for r in a["runs"]] == [r[0] for r in b["runs"]], "the ranks ran different programs"
    assert a["clocks"] == ["host"] * 3 and all(0 < c < 0.1 for c in a["comm"]), (a["clocks"], a["comm"])
    # Every tuning but the last saw steps run after its switch.
    assert all(m is not None and m > 0 for m in a["measured"][:2]), a["measured"]
    # A re-tune that picks the program already running keeps its schedule (and executor): step 3
    # runs the first tuning's choice, step 6 the second's.
    (prog3, sched3, _), (prog6, sched6, _) = a["runs"][2], a["runs"][5]
    if prog6 == prog3:
        assert sched6 == sched3, a["runs"]


def _shape_change(rank, pp, tuned_steps):
    """The first `tuned_steps` steps at one shape, the next at another (during the timing step,
    or with a trial during the trial), then steps of the new shape until a tuning ends."""
    sched, stages, _ = _auto(rank, pp, "one", trial_steps=1, trial_margin=10.0)
    for k in range(tuned_steps):
        _step(sched, stages, k)
    x, y = data("mlp", 4 * M, seed=2)  # twice the rows: another shape, mid-tuning
    new_shape = lambda: sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)  # noqa: E731
    try:
        new_shape()
    except zbpipe.ScheduleError as e:
        msg = str(e)
    else:
        return "no error", None
    while not sched.tuned:  # a fresh tuning at the new shape, its trial included
        new_shape()
        assert sched._steps < 30
    return msg, [t.step for t in sched.history]


@pytest.mark.parametrize("tuned_steps, refused_at, steps", [(1, 2, [4]), (2, 3, [2, 5])])
def test_a_shape_change_during_a_tuning_fails_every_rank_before_the_step(spawn_world, tuned_steps, refused_at,
                                                                         steps):
    for msg, after in spawn_world(PP).run(_shape_change, tuned_steps, timeout_s=120):
        assert "shapes changed during a tuning (on rank(s) [0, 1]" in msg and "step 1" in msg, msg
        assert f"(step {refused_at})" in msg, msg
        # The refused step ran nothing: the next two steps, of the new shape, tune afresh (step 1
        # refused during the timing step, step 3 during the trial).
        assert after == steps, after


def test_retune_every_below_two_is_refused():
    with pytest.raises(ValueError, match="retune_every must be >= 2"):
        zbpipe.ScheduleAuto([], M, loss_fn=F.mse_loss, retune_every=1)


def test_timing_steps_is_checked_against_itself_and_retune_every():
    with pytest.raises(ValueError, match="timing_steps must be >= 1"):
        zbpipe.ScheduleAuto([], M, loss_fn=F.mse_loss, timing_steps=0)
    with pytest.raises(ValueError, match="retune_every must be >= 4"):
        zbpipe.ScheduleAuto([], M, loss_fn=F.mse_loss, timing_steps=3, retune_every=3)


def _trial(rank, pp, placement):
    # A margin that takes in every fitting candidate, so the trial always runs.
    sched, stages, _ = _auto(rank, pp, placement, trial_steps=2, trial_margin=10.0)
    programs, tuned = [], []
    while tuned.count(True) < 2:  # until the choice has run two steps
        programs.append(sched.program.to_csv_text())  # the program this step runs
        _step(sched, stages, len(programs) - 1)
        tuned.append(sched.tuned)
        assert len(programs) < 40
    t = sched.tuning
    grads = {(s.stage_index, n): p.grad.clone() for s in stages for n, p in s.submod.named_parameters()}
    return dict(programs=programs, tuned=tuned, grads=grads, trial=t.trial, planned=t.planned, choice=t.choice,
                running=sched.choice, walls={c.name: c.trial_s for c in t.candidates}, table=t.table(),
                fits=[c.name for c in t.candidates if c.fits], safe=FAMILIES[placement][0])


@pytest.mark.parametrize("placement", ["one", "v"])
def test_a_trial_runs_the_near_candidates_in_real_steps_and_keeps_the_fastest(spawn_world, placement):
    results = spawn_world(PP).run(_trial, placement, timeout_s=240)
    a, b = results
    steps = len(a["programs"])
    mods = build("mlp", len(LAYOUTS[placement]))
    for k in range(steps):
        x, y = data("mlp", 2 * M, seed=k + 1)
        F.mse_loss(call_chain(mods, x), y).backward()
    for res in results:  # exact across the measuring steps, every trial step and the choice
        for (stage, name), g in res["grads"].items():
            assert_close(g, dict(mods[stage].named_parameters())[name].grad, msg=f"trial {stage}.{name}")
    assert a["programs"] == b["programs"] and a["choice"] == b["choice"], "the ranks diverged"
    near = a["trial"]
    # Every fitting candidate, in candidate order, but one per distinct program.
    fitting = [n for n in FAMILIES[placement][1] if n in a["fits"]]
    assert len(near) >= 2 and near == [n for n in fitting if n in near], (near, fitting)
    # Steps 3.. run first one uncounted step of each near candidate not run yet (the safe
    # default has run), then the near candidates round-robin, the predicted best first, two
    # rounds; the tuning ends with the last of them and the choice runs after.
    order = sorted(near, key=lambda n: n != a["planned"]) * 2
    warm = a["tuned"].index(True) - 1 - len(order)
    assert warm == len(near) - (a["safe"] in near), (warm, near)
    trial_programs = a["programs"][2 + warm:2 + warm + len(order)]
    assert len(set(trial_programs)) == len(near), "each near candidate ran its own program"
    assert trial_programs[:len(near)] == trial_programs[len(near):], "two rounds in the same order"
    assert set(a["programs"][2:2 + warm]) <= set(trial_programs), "the uncounted steps run near candidates"
    # Every rank keeps the candidate with the least median of its (slowest-rank) trial steps.
    import statistics
    walls = {n: w for n, w in a["walls"].items() if w}
    assert sorted(walls) == sorted(near) and all(len(w) == 2 for w in walls.values()), walls
    best = min(near, key=lambda n: (statistics.median(walls[n]), near.index(n)))
    assert a["choice"] == best == a["running"], (a["choice"], walls)
    assert a["programs"][2 + warm + len(order):] == [trial_programs[order.index(best)]] * (steps - 2 - warm - len(order))
    assert "trial, median of 2 steps each" in a["table"] and f"by prediction alone: {a['planned']}" in a["table"]


def test_trial_arguments_are_checked():
    with pytest.raises(ValueError, match="trial_steps and trial_margin must be >= 0"):
        zbpipe.ScheduleAuto([], M, loss_fn=F.mse_loss, trial_steps=-1)


def _pooled(rank, pp):
    from zbpipe.stage_costs import profile_from_trace

    sched, stages, _ = _auto(rank, pp, "one", timing_steps=3)
    safe = sched._schedules[FAMILIES["one"][0]]  # the timing steps run the safe default, zb_h1
    per_step, tuned = [], []
    for k in range(5):
        _step(sched, stages, k)
        tuned.append(sched.tuning is not None)
        if 1 <= k <= 3:
            per_step.append(safe.trace())
    pooled = profile_from_trace([r for step in per_step for r in step], clock="host")
    last = profile_from_trace(per_step[-1], clock="host")
    t = sched.tuning
    return dict(tuned=tuned, mine=[s.stage_index for s in stages], pooled=pooled, last=last,
                costs=t.costs, steps=t.timing_steps, at=t.step, table=t.table())


def test_timing_steps_pool_the_action_times_of_every_timing_step(spawn_world):
    for res in spawn_world(PP).run(_pooled, timeout_s=240):
        # Step 1 measures memory, steps 2-4 time the actions; the tuning ends with step 4.
        assert res["tuned"] == [False, False, False, True, True], res["tuned"]
        assert res["at"] == 4 and res["steps"] == 3 and "(host times) over 3 timing steps" in res["table"], res["table"]
        for s in res["mine"]:
            for kind in "fiw":
                # The median over every microbatch of the three steps, not the last step's.
                assert res["costs"][s][kind] == pytest.approx(res["pooled"][s][kind], rel=1e-12), (s, kind)
        assert any(res["costs"][s][k] != res["last"][s][k] for s in res["mine"] for k in "fiw"), res


def test_profile_from_trace_takes_device_times_where_the_trace_has_them(tmp_path):
    import json

    rec = {"action": "0F0", "host_start_ns": 0, "host_end_ns": 5_000_000, "wait_ns": 1_000_000,
           "device_start_us": 10.0, "device_end_us": 1010.0}
    untimed = {**rec, "action": "0I0", "device_start_us": -1.0, "device_end_us": -1.0}
    prof = zbpipe.profile_from_trace([rec, untimed])
    assert prof[0]["f"] == pytest.approx(1e-3) and prof[0]["i"] == pytest.approx(4e-3), prof
    assert zbpipe.profile_from_trace([rec], clock="host")[0]["f"] == pytest.approx(4e-3)
    with pytest.raises(ValueError, match="0I0 has no device time"):
        zbpipe.profile_from_trace([rec, untimed], clock="device")
    # The same from a Chrome trace: the device lane (tid 1) twin of a host event, by entry.
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "pid": 0, "tid": 0, "name": "0F0", "ts": 0.0, "dur": 5000.0, "args": {"wait_us": 1000.0, "entry": 0}},
        {"ph": "X", "pid": 0, "tid": 1, "name": "0F0", "ts": 10.0, "dur": 1000.0, "args": {"wait_us": 0.0, "entry": 0}},
    ]}))
    assert zbpipe.profile_from_trace(str(path))[0]["f"] == pytest.approx(1e-3)
    assert zbpipe.profile_from_trace(str(path), clock="host")[0]["f"] == pytest.approx(4e-3)


def _unequal_v(rank, pp):
    """V placement, the heavy stage on rank 0 beside stage 0: the paper's V caps, counted in
    microbatches of both stages, sit above zbv's peak in bytes."""
    t = _unequal_tuning(rank, "v")
    return t.budget, {c.name: (c.predicted_s, c.peak_bytes, c.fits) for c in t.candidates}


def test_v_candidates_plan_under_the_budget_in_bytes(spawn_world):
    # v_half and v_min are planned under the budget (zbv's peak per rank), not at the paper's
    # cap in microbatches, so they fit it whatever the stages' bytes.
    (budget, cands), (_, other) = spawn_world(PP).run(_unequal_v, timeout_s=120)
    assert cands == other
    for name in ("v_half", "v_min"):
        predicted, peak, fits = cands[name]
        assert fits and all(p <= b * (1 + 1e-9) for p, b in zip(peak, budget)), (name, cands, budget)
        assert predicted <= cands["zbv"][0] * (1 + 1e-9), (name, cands)  # never behind zbv here

