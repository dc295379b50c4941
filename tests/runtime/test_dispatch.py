"""The executor's dispatch table (csrc/runtime/dispatch.h), built without a process group and
checked against expectations derived here from the program alone: its actions, the stage
placement and the producer rule (F of s reads s-1's output, B/I of s read s+1's gradient)."""

from __future__ import annotations

import pytest

import zbpipe
from zbpipe import _C

ENTRY_FIELDS = ("label", "unit", "index", "stage", "mb", "needs_recv", "handoff", "to_send",
                "comm_begin", "comm_end", "on_worker", "concurrent")

PROGRAMS = [
    ("gpipe", 1, 4, None),
    ("1f1b", 2, 4, None),
    ("interleaved_1f1b", 2, 4, 2),
    ("zb_h1", 3, 6, None),
    ("zbv", 2, 4, None),
    ("zbv", 1, 4, None),
    ("dualpipev", 2, 4, None),
    ("dualpipev", 3, 6, None),
]


def _program(name, pp, m, spr):
    kwargs = {"stages_per_rank": spr} if spr else {}
    return zbpipe.compile(name, pp=pp, microbatches=m, **kwargs)


def _table(prog, rank, overlap):
    entries, comms = _C._dispatch_table(prog, rank, overlap)
    return [dict(zip(ENTRY_FIELDS, e)) for e in entries], comms


def _split(action, overlap):
    """The compute parts of `action` in the order the executor runs them: an OVERLAP_F_B of
    two stages with overlap on starts its backward half (on the worker) before its forward."""
    if action.kind.name != "OVERLAP_F_B":
        return [action], False
    parts = list(action.sub_actions)
    f = [p for p in parts if p.kind.name == "F"]
    b = [p for p in parts if p.kind.name in ("B", "I")]
    if overlap and len(parts) == 2 and f and b and f[0].stage != b[0].stage:
        return [b[0], f[0]], True
    return parts, False


def _route(prog, rank, part):
    """(source stage, destination stage) of a compute's data, -1 where none."""
    n, s, k = prog.num_stages, part.stage, part.kind.name
    if k == "F":
        return (s - 1 if s > 0 else -1), (s + 1 if s + 1 < n else -1)
    if k in ("B", "I"):
        return (s + 1 if s + 1 < n else -1), (s - 1 if s > 0 else -1)
    return -1, -1


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name,pp,m,spr", PROGRAMS)
def test_compute_entries_follow_the_program_and_the_placement(name, pp, m, spr, overlap):
    prog = _program(name, pp, m, spr)
    where = prog.stage_to_rank
    for rank in range(pp):
        entries, _ = _table(prog, rank, overlap)
        compute = [e for e in entries if e["stage"] >= 0]
        expected = []
        for index, action in enumerate(prog.action_values(rank)):
            if not action.is_compute:
                continue
            parts, split = _split(action, overlap)
            unit = str(action) if action.kind.name == "OVERLAP_F_B" else ""
            for j, part in enumerate(parts):
                src, dst = _route(prog, rank, part)
                expected.append({
                    "label": str(part), "unit": unit, "index": index, "stage": part.stage,
                    "mb": part.microbatch,
                    "needs_recv": src >= 0 and where[src] != rank,
                    "handoff": dst if dst >= 0 and where[dst] == rank else -1,
                    "to_send": dst >= 0 and where[dst] != rank,
                    "comm_begin": 0, "comm_end": 0,
                    "on_worker": split and j == 0, "concurrent": split and j == 1,
                })
        assert compute == expected, f"{name} pp={pp} rank {rank} overlap={overlap}"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name,pp,m,spr", PROGRAMS)
def test_comm_entries_are_the_cores_batches(name, pp, m, spr, overlap):
    prog = _program(name, pp, m, spr)
    for rank in range(pp):
        entries, comms = _table(prog, rank, overlap)
        acts = prog.actions(rank)
        batches = [(e["index"], e["index"] + e["comm_end"] - e["comm_begin"], e["concurrent"])
                   for e in entries if e["stage"] < 0]
        assert batches == [tuple(b) for b in _C.comm_batches(prog, rank, overlap)]
        # The batches tile the comm table in program order, one Comm per action.
        spans = [(e["comm_begin"], e["comm_end"]) for e in entries if e["stage"] < 0]
        assert [c for b, e in spans for c in range(b, e)] == list(range(len(comms)))
        assert [c[0] for c in comms] == [a for a in acts if "SEND" in a or "RECV" in a]
        for e in entries:
            if e["stage"] < 0:
                assert e["label"] == "+".join(acts[e["index"]:e["index"] + e["comm_end"] - e["comm_begin"]])


@pytest.mark.parametrize("name,pp,m,spr", [p for p in PROGRAMS if p[1] > 1])
def test_every_send_meets_its_receive_with_the_same_tag(name, pp, m, spr):
    prog = _program(name, pp, m, spr)
    where = prog.stage_to_rank
    sends, recvs = {}, {}
    for rank in range(pp):
        for label, peer, tag in _table(prog, rank, True)[1]:
            a = _C.Action.parse(label)
            kind = a.kind.name
            grad = kind.endswith("_B")
            # The stage at the other end: the next one for SEND_F / RECV_B, the previous else.
            other = a.stage + 1 if kind in ("SEND_F", "RECV_B") else a.stage - 1
            assert peer == where[other] != rank, label
            key = (min(a.stage, other), grad, a.microbatch)
            (sends if kind.startswith("SEND") else recvs)[key] = (rank, peer, tag)
    assert sends.keys() == recvs.keys()
    for key, (rank, peer, tag) in sends.items():
        assert recvs[key] == (peer, rank, tag), key
    pair_tags = [(r, p, t) for r, p, t in sends.values()]
    assert len(set(pair_tags)) == len(pair_tags)  # no two messages of a pair share a tag


def test_a_rank_outside_the_program_is_refused():
    prog = _program("1f1b", 2, 4, None)
    with pytest.raises(Exception, match="outside the program's pp=2"):
        _C._dispatch_table(prog, 2, True)
