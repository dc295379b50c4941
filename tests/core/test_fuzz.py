"""Property-based fuzzing (Hypothesis) of every door into the schedule core: the action-string
parser, CSV import, programs from lists and compile's arguments. Any input gives a valid program
(or action) or a ScheduleError / TypeError: never another exception, a crash, a hang or memory
out of bounds (sizes are either small or far above zbpipe's limits, which are refused before
anything is allocated).

Examples are bounded and derandomized, so the file runs the same cases every time, in seconds
(ZBPIPE_FUZZ_EXAMPLES=N searches N random examples per test instead).
Also here: the lowering pass against a restatement in Python of PyTorch's lock-step placement,
on random reorderings of built programs.
"""

from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import zbpipe
from zbpipe import Action, Program, ScheduleError, _C

# ZBPIPE_FUZZ_EXAMPLES=5000 runs a longer, random (not derandomized) search.
_DEEP = int(os.environ.get("ZBPIPE_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_DEEP or 100, deadline=None, derandomize=not _DEEP, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

KINDS = ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "S", "T", "BCAST_F", "ALLREDUCE_S",
         "REDUCE_B"]

# ---- inputs ---------------------------------------------------------------------------------

small = st.integers(min_value=-2, max_value=6)
# Far above every limit (pp 16384, stages 65536, microbatches 2^20): refused before allocating.
huge = st.integers(min_value=(1 << 20) + 1, max_value=1 << 80)
sizes = st.one_of(small, small, small, huge)


@st.composite
def action_texts(draw, max_index=5):
    """Strings near the action grammar: mostly valid, some mangled."""
    def simple():
        return st.builds(lambda s, k, m: f"{s}{k}{m}",
                         st.integers(0, max_index), st.sampled_from(KINDS), st.integers(0, max_index))
    text = draw(st.one_of(
        simple(),
        simple(),
        st.lists(simple(), min_size=0, max_size=3).map(lambda ps: f"({';'.join(ps)})OVERLAP_F_B"),
        st.text(alphabet="0123456789FBIWSENDRCV_OLAP();, -+x\t\r\n", max_size=24),
        st.text(max_size=12),
    ))
    if draw(st.integers(0, 9)) == 0:  # a digit string far beyond int32
        text = draw(st.integers(10**8, 10**30).map(str)) + text
    return text


def well_formed(prog: Program) -> None:
    """A program the core accepted: it validates, and its CSV reads back to the same actions."""
    _C.validate(prog)
    assert prog.pp >= 1 and prog.num_stages >= 1 and prog.microbatches >= 1
    again = Program.from_csv_text(prog.to_csv_text())
    assert [again.actions(r) for r in range(again.pp)] == [prog.actions(r) for r in range(prog.pp)]


def valid_or_refused(call, type_error_prefix: str | None) -> None:
    """call() gives a well-formed program, a ScheduleError, or (where the door checks types, with
    `type_error_prefix`) a one-line TypeError naming the function; nothing else."""
    try:
        prog = call()
    except ScheduleError:
        event("ScheduleError")
        return
    except TypeError as e:
        if type_error_prefix is None:
            raise
        assert str(e).startswith(type_error_prefix) and "\n" not in str(e), str(e)
        event("TypeError")
        return
    event("program")
    well_formed(prog)


# ---- the parser -----------------------------------------------------------------------------

@FUZZ
@given(st.one_of(action_texts(), st.text(), st.binary().map(lambda b: b.decode("latin-1"))))
def test_action_parse_accepts_the_grammar_or_raises_schedule_error(text):
    try:
        action = Action.parse(text)
    except ScheduleError:
        event("ScheduleError")
        return
    event("parsed")
    canonical = str(action)
    assert Action.parse(canonical) == action and str(Action.parse(canonical)) == canonical
    assert action.sub_actions or (action.stage >= 0 and action.microbatch >= 0)


@FUZZ
@given(st.one_of(st.integers(), st.floats(), st.none(), st.binary(), st.lists(st.text(max_size=3))))
def test_action_parse_takes_only_text(value):
    try:
        Action.parse(value)
    except TypeError as e:
        assert str(e).startswith("Action.parse: text must be") and "\n" not in str(e)
    else:
        raise AssertionError(f"Action.parse({value!r}) was accepted")


# ---- CSV import -----------------------------------------------------------------------------

@st.composite
def built_rows(draw, lowered=None):
    """A built program's rows (compute-only or lowered) with a few cells dropped, duplicated or
    moved, and the program itself."""
    name = draw(st.sampled_from(["1f1b", "gpipe", "zb_h1", "zbv", "interleaved_1f1b", "dualpipev"]))
    pp = draw(st.integers(1, 3))
    mb = draw(st.integers(1, 4)) * (2 * pp if name == "dualpipev" else pp)
    prog = zbpipe.compile(name, pp, mb, vocab_parallel=draw(st.booleans()))
    if lowered is None:
        lowered = draw(st.booleans())
    rows = [prog.actions(r) if lowered else prog.compute_actions(r) for r in range(pp)]
    for _ in range(draw(st.integers(1, 2)) if draw(st.booleans()) else 0):
        r = draw(st.integers(0, pp - 1))
        if not rows[r]:
            continue
        i = draw(st.integers(0, len(rows[r]) - 1))
        op = draw(st.integers(0, 2))
        if op == 0:
            del rows[r][i]
        elif op == 1:
            rows[r].insert(draw(st.integers(0, len(rows[r]))), rows[r][i])
        elif i + 1 < len(rows[r]):
            rows[r][i], rows[r][i + 1] = rows[r][i + 1], rows[r][i]
    return rows, prog


@st.composite
def csv_texts(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:  # arbitrary text
        return draw(st.text(max_size=200))
    if kind == 1:  # rows of action-like cells
        rows = draw(st.lists(st.lists(action_texts(max_index=3), max_size=8), max_size=5))
        return "\n".join(",".join(r) for r in rows)
    rows, _ = draw(built_rows())
    sep = draw(st.sampled_from(["\n", "\r\n"]))
    return sep.join(",".join(r) for r in rows) + draw(st.sampled_from(["", sep, sep * 3]))


@FUZZ
@given(csv_texts(), st.booleans())
def test_csv_import_gives_a_valid_program_or_schedule_error(text, rendezvous):
    valid_or_refused(lambda: Program.from_csv_text(text, rendezvous=rendezvous), None)


# ---- programs from lists --------------------------------------------------------------------

anything = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=5), st.binary(max_size=5),
                     st.dictionaries(st.integers(0, 3), st.integers(0, 3), max_size=2),
                     st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=3))


def with_one_wrong_type(draw, args: list) -> list:
    """In about a fifth of the cases, one argument replaced by a value of any type."""
    if draw(st.integers(0, 4)) == 0:
        args[draw(st.integers(0, len(args) - 1))] = draw(anything)
    return args


@st.composite
def from_actions_args(draw):
    if draw(st.integers(0, 3)):
        rows, prog = draw(built_rows())
        stage_to_rank = list(prog.stage_to_rank)
        mb = prog.microbatches
        if draw(st.integers(0, 4)) == 0:
            stage_to_rank[draw(st.integers(0, len(stage_to_rank) - 1))] = draw(st.integers(-1, 3))
        if draw(st.integers(0, 4)) == 0:
            mb += draw(st.sampled_from([-1, 1]))
    else:
        rows = draw(st.lists(st.lists(action_texts(max_index=3), max_size=6), max_size=4))
        stage_to_rank = draw(st.lists(st.integers(-1, 4), max_size=6))
        mb = draw(sizes)
    return with_one_wrong_type(draw, [rows, stage_to_rank, mb, draw(st.sampled_from(["custom", "x"])),
                                      draw(st.booleans())])


@FUZZ
@given(from_actions_args())
def test_from_actions_gives_a_valid_program_or_schedule_or_type_error(args):
    valid_or_refused(lambda: Program.from_actions(*args), "Program.from_actions: ")


# ---- compile's arguments --------------------------------------------------------------------

cost_values = st.one_of(
    st.floats(min_value=0, max_value=100),
    st.floats(min_value=0, max_value=100),
    st.sampled_from([math.inf, -math.inf, math.nan, -1.0, 0.0, 1e-300, 1e300, 10**400]),
)
costs = st.one_of(cost_values, st.lists(cost_values, min_size=0, max_size=9))


@st.composite
def compile_args(draw):
    def mostly(usual, other):
        return draw(usual if draw(st.integers(0, 4)) else other)

    name = mostly(st.sampled_from(zbpipe.schedule_names()), st.text(max_size=8))
    pp = mostly(st.integers(1, 4), sizes)
    mb = mostly(st.integers(1, 16), sizes)
    spr = mostly(st.none(), st.one_of(st.integers(-1, 3), huge))
    options = {}
    # The search schedules take costs and a cap; any schedule refuses the options it ignores.
    if name in ("zb_auto", "v_half", "v_min") or draw(st.integers(0, 4)) == 0:
        values = {
            "f": costs, "b": costs, "w": costs, "b_full": costs, "comm": cost_values,
            "memory_cap": st.one_of(st.integers(-1, 8), huge), "search_threads": st.integers(-1, 4),
        }
        for key in draw(st.sets(st.sampled_from(sorted(values)), max_size=3)):
            options[key] = draw(values[key])
    args = with_one_wrong_type(draw, [name, pp, mb, spr])
    if options and draw(st.integers(0, 5)) == 0:
        options[next(iter(options))] = draw(anything)
    return args, options


@FUZZ
@given(compile_args())
def test_compile_gives_a_valid_program_or_schedule_or_type_error(args_options):
    args, options = args_options
    valid_or_refused(lambda: zbpipe.compile(*args, **options), "compile: ")


# ---- lowering against PyTorch's placement rule, restated ------------------------------------

def reference_lowering(rows, stage_to_rank, num_stages):
    """_add_send_recv's lock-step placement: sweep the ranks in order, each places its next
    compute if its data is there; placing appends the SEND and the consumer's RECV. Returns the
    lowered rows, or ("stuck", rank, action) when a sweep places nothing."""
    pp = len(rows)
    done, out, nxt = set(), [[] for _ in range(pp)], [0] * pp

    def ready(a):
        if a.kind == zbpipe.Kind.F:
            return a.stage == 0 or (a.stage - 1, "F", a.microbatch) in done
        if a.kind in (zbpipe.Kind.B, zbpipe.Kind.I):
            return a.stage + 1 == num_stages or (a.stage + 1, "B", a.microbatch) in done
        return True

    while any(nxt[r] < len(rows[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            if nxt[r] >= len(rows[r]):
                continue
            a = Action.parse(rows[r][nxt[r]])
            if not ready(a):
                continue
            out[r].append(str(a))
            fwd = a.kind == zbpipe.Kind.F
            if fwd or a.kind in (zbpipe.Kind.B, zbpipe.Kind.I):
                done.add((a.stage, "F" if fwd else "B", a.microbatch))
                to = a.stage + 1 if fwd else a.stage - 1
                if 0 <= to < num_stages and stage_to_rank[to] != r:
                    tag = "F" if fwd else "B"
                    out[r].append(f"{a.stage}SEND_{tag}{a.microbatch}")
                    out[stage_to_rank[to]].append(f"{to}RECV_{tag}{a.microbatch}")
            nxt[r] += 1
            progress = True
        if not progress:
            r = next(r for r in range(pp) if nxt[r] < len(rows[r]))
            return ("stuck", r, rows[r][nxt[r]])
    return out


@FUZZ
@given(
    st.sampled_from(["1f1b", "gpipe", "zb_h1", "zb_h2", "zbv", "interleaved_1f1b", "interleaved_zb",
                     "looped_bfs"]),
    st.integers(1, 4),
    st.integers(1, 3),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200), st.integers(1, 4)), max_size=6),
)
def test_lowering_places_as_pytorch_does(name, pp, rounds, moves):
    prog = zbpipe.compile(name, pp, pp * rounds)
    rows = [prog.compute_actions(r) for r in range(pp)]
    for r, i, step in moves:  # move an action a few places later on its rank
        row = rows[r % pp]
        if len(row) > 1:
            i %= len(row)
            row.insert(min(i + step, len(row) - 1), row.pop(i))
    expected = reference_lowering(rows, prog.stage_to_rank, prog.num_stages)
    try:
        lowered = Program.from_actions(rows, prog.stage_to_rank, prog.microbatches)
    except ScheduleError as e:
        event("ScheduleError")
        if expected[0] == "stuck":
            assert f"no rank can make progress (rank {expected[1]} waits on the input of " \
                   f"'{expected[2]}')" in str(e), str(e)
        else:
            assert "cannot be lowered" not in str(e)  # validation refused a moved action
        return
    event("program")
    assert expected[0] != "stuck"
    assert [lowered.actions(r) for r in range(pp)] == expected
