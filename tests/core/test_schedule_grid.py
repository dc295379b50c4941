"""Every registered schedule over pp = 1..16 and several microbatch counts: legal sizes compile
to programs the independent checker accepts; illegal ones raise ScheduleError naming the rule.

The legal sizes of each schedule live in helpers/schedule_registry.py RULES; a schedule
registered without a rule fails test_every_schedule_has_a_rule (add its rule there when you add
a builder)."""

from __future__ import annotations

import pytest
from helpers.program_checker import check
from helpers.schedule_registry import NAMES, RULES, rule_of, topology

import zbpipe
from zbpipe import ScheduleError


def test_every_schedule_has_a_rule():
    missing = [n for n in NAMES if n not in RULES]
    assert not missing, f"schedules without a rule in RULES: {missing}"


@pytest.mark.parametrize("pp", range(1, 17))
@pytest.mark.parametrize("name", NAMES)
def test_legal_sizes_build_valid_programs(name, pp):
    rule = rule_of(name)
    for spr in rule.spr_values():
        for m in rule.microbatch_counts(pp):
            prog = zbpipe.compile(name, pp, m, spr)
            where = f"{name} pp={pp} microbatches={m} stages_per_rank={spr}"
            n_stages = pp * rule.spr(spr)
            assert (prog.pp, prog.num_stages, prog.microbatches) == (pp, n_stages, m), where
            assert list(prog.stage_to_rank) == topology(rule.topology, pp, n_stages), where
            check(prog, forward_only=rule.forward_only)
            if m != rule.microbatch_counts(pp)[0]:
                continue  # the raw build below doubles the cost of search-based builders
            # Lowering only adds communication: the builder's compute order is kept.
            raw = zbpipe._C.build(name, pp, m, spr or 0)
            assert [prog.compute_actions(r) for r in range(pp)] == [
                [str(a) for a in raw.action_values(r)] for r in range(pp)], where


def test_forward_only_compiles():
    prog = zbpipe.compile("inference", pp=3, microbatches=2)
    assert prog.actions(1) == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1"]
    res = zbpipe.simulate(prog, f=1.0)
    assert res.makespan == pytest.approx(4.0)  # m + p - 1 forwards
    # A forward-only program that drops a forward is still rejected.
    with pytest.raises(zbpipe.ScheduleError, match="never runs F"):
        zbpipe.Program.from_actions([["0F0", "0SEND_F0"], ["1RECV_F0", "1F0", "1F1"]], [0, 1], 2)


def illegal_cases(name, rule):
    cases = [(dict(pp=0, microbatches=4), "pp must be >= 1, got pp=0"),
             (dict(pp=-3, microbatches=4), "pp must be >= 1, got pp=-3"),
             (dict(pp=2, microbatches=0), "microbatches must be >= 1, got microbatches=0"),
             (dict(pp=2, microbatches=-1), "microbatches must be >= 1, got microbatches=-1"),
             (dict(pp=2, microbatches=8, stages_per_rank=-1), "stages_per_rank must be >= 1")]
    if rule.fixed_spr:
        bad = rule.fixed_spr + 1
        cases.append((dict(pp=2, microbatches=8, stages_per_rank=bad),
                      f"fixes stages_per_rank={rule.fixed_spr}, got stages_per_rank={bad}"))
    elif rule.min_spr > 1:
        cases.append((dict(pp=2, microbatches=8, stages_per_rank=rule.min_spr - 1),
                      f"needs stages_per_rank >= {rule.min_spr}, got stages_per_rank={rule.min_spr - 1}"))
    if rule.rounds:  # pp=2, m=5: 2 rounds of 2.5 microbatches
        cases.append((dict(pp=2, microbatches=5), "multiple of the rounds .* = 2, got microbatches=5"))
    if rule.min_mb_per_pp:
        k = rule.min_mb_per_pp
        cases.append((dict(pp=3, microbatches=3 * k - 1),
                      f"microbatches >= {k} \\* pp = {3 * k}, got microbatches={3 * k - 1}"))
    return cases + list(rule.extra_illegal)


@pytest.mark.parametrize("name", NAMES)
def test_illegal_sizes_name_the_constraint(name):
    rule = rule_of(name)
    for kwargs, message in illegal_cases(name, rule):
        with pytest.raises(ScheduleError, match=message) as err:
            zbpipe.compile(name, **kwargs)
        assert name in str(err.value), (kwargs, str(err.value))
        if set(kwargs) - {"pp", "microbatches", "stages_per_rank"}:
            continue  # _C.build takes sizes only
        with pytest.raises(ScheduleError, match=message):  # the builder itself checks, up front
            zbpipe._C.build(name, kwargs["pp"], kwargs["microbatches"], kwargs.get("stages_per_rank", 0))


def test_rule_table_matches_the_builders_at_the_edges():
    # Sizes the table calls illegal are rejected, and the first legal ones compile: the table
    # cannot drift from the builders unnoticed.
    for name in NAMES:
        rule = rule_of(name)
        if rule.forward_only:
            continue
        for pp in (1, 2, 3, 5):
            for m in range(1, 4 * pp + 2):
                if rule.legal_mb(pp, m):
                    zbpipe.compile(name, pp, m)
                else:
                    with pytest.raises(ScheduleError):
                        zbpipe.compile(name, pp, m)
