"""What zbpipe posts on NCCL deadlocks under none of NCCL's rules, proven without a GPU.

The executor runs real steps on an in-process loopback world (helpers/loopback.py) with
NCCL's posting discipline; the world records every post, wait and poll per rank, and
helpers/nccl_model.py replays the records under NCCL's rules (communicator choice, one stream per
communicator, rendezvous sends, issue-order matching). Every schedule, pp in {2, 3, 4, 8}, a
microbatch grid and one- and multi-tensor boundaries must finish with every message matched in
peer and size, with and without eager communicator init (and, for pp <= 3, with gradients
equal to one process's). The model itself must fail on the
batching zbpipe used before (lone ops uncoalesced), and on hand-written deadlocks; the core's
rendezvous validator (zbpipe._C.validate(..., rendezvous=True)) must agree with it.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from helpers.loopback import record
from helpers.nccl_model import check

import zbpipe
from zbpipe import _C

HANDSHAKE_TAG = 1 << 30  # wire tags at or above: the one-time signature handshake


def _microbatch_grid(name: str, pp: int) -> list[int]:
    grid = []
    for m in (pp, 2 * pp, 3 * pp):
        try:
            zbpipe.compile(name, pp, m)
        except zbpipe.ScheduleError:
            continue
        grid.append(m)
    return grid


def _coalesce_all(logs):
    return {r: [(t, w, t == "post" or c, ops) for t, w, c, ops in log] for r, log in logs.items()}


def _data_messages(prog, boundary: str) -> int:
    """Messages a step carries: one op per tensor (3 forward, 2 gradient with "multi")."""
    fwd, grad = (1, 1) if boundary == "one" else (3, 2)
    trains = prog.schedule != "inference"
    n = 0
    for r in range(prog.pp):
        for a in prog.actions(r):
            if "SEND_F" in a:
                n += fwd
            elif "SEND_B" in a and trains:
                n += grad
    return n


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_schedule_posts_deadlock_free_under_nccl_rules(pp):
    torch.set_num_threads(1)
    failures, checked = [], 0
    for name in zbpipe.schedule_names():
        for m in _microbatch_grid(name, pp):
            prog = zbpipe.compile(name, pp, m)
            _C.validate(prog, rendezvous=True)  # the core's check agrees
            for boundary in ("one", "multi"):
                # The steps are real: gradients exact against one process (smaller worlds).
                logs = record(name, pp, m, boundary, exact=pp <= 3 and name != "inference")
                tag = f"{name} pp={pp} m={m} {boundary}"
                lone = [e for log in logs.values() for e in log if e[0] == "post" and not e[2]]
                if lone:
                    failures.append(f"{tag}: {len(lone)} posts not coalesced, e.g. {lone[0]}")
                for eager in (False, True):
                    v = check(logs, eager=eager)
                    if not v.ok:
                        failures.append(f"{tag} eager={eager}: {v}")
                    if any(c != {"world"} for c in v.comms.values()):
                        failures.append(f"{tag}: communicators {v.comms}")
                data = sum(1 for log in logs.values() for e in log if e[0] == "post"
                           for op in e[3] if op[0] == "send" and op[2] < HANDSHAKE_TAG)
                if data != _data_messages(prog, boundary):
                    failures.append(f"{tag}: {data} data sends posted, the program has {_data_messages(prog, boundary)}")
                checked += 1
    assert checked > 0
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name,pp,m,differ,of", [("zbv", 2, 4, 12, 16), ("1f1b", 2, 8, 14, 16)])
def test_the_batching_zbpipe_used_before_fails_under_the_model(name, pp, m, differ, of):
    """Regression of the model: receives at their RECV action and only multi-op batches
    coalesced (the old NCCL path, still what a tag-matched group posts) split messages across
    communicators and deadlock or mismatch; with a device_id (one communicator) it passes."""
    logs = record(name, pp, m, "one", stream_ordered=False, prepost_receives=False)
    ends = defaultdict(dict)  # (sender, receiver, tag) -> grouped with others at each end
    for r, log in logs.items():
        for t, _, _, ops in log:
            for direction, peer, wtag, _ in ops if t == "post" else ():
                if wtag < HANDSHAKE_TAG:
                    key = (r, peer, wtag) if direction == "send" else (peer, r, wtag)
                    ends[key][direction] = len(ops) > 1
    assert (sum(v["send"] != v["recv"] for v in ends.values()), len(ends)) == (differ, of)
    verdict = check(logs)
    assert not verdict.ok and verdict.deadlock and verdict.mismatches, verdict
    assert any(len(c) > 1 for c in verdict.comms.values()), verdict.comms
    assert check(logs, eager=True).ok
    assert check(_coalesce_all(logs)).ok  # the fix, applied to the same posts


# A valid program (it passes validate(), whose sends are buffered) that deadlocks with
# rendezvous sends: rank 0's 0SEND_F1 waits for 1RECV_F1, which rank 1 posts behind
# 1SEND_B0, which waits for 0RECV_B0, which rank 0 posts behind 0SEND_F1.
CROSS = (
    "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0RECV_B0 0B0 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2".split(),
    "1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1 1RECV_F2 1F2 1I2 1SEND_B2 1W2".split(),
)


def test_rendezvous_deadlock_found_by_model_validator_and_executor(tmp_path):
    prog = zbpipe.Program.from_actions(list(CROSS), [0, 1], 3)  # buffered: valid
    with pytest.raises(zbpipe.ScheduleError, match=r"deadlock with rendezvous sends.*'0SEND_F1' waits for rank 1"):
        zbpipe.Program.from_actions(list(CROSS), [0, 1], 3, rendezvous=True)
    prog.to_csv(str(tmp_path / "cross.csv"))
    zbpipe.Program.from_csv(str(tmp_path / "cross.csv"))
    with pytest.raises(zbpipe.ScheduleError, match=r"rank 0 waits at '0B0' for its batch '0RECV_B0'"):
        zbpipe.Program.from_csv(str(tmp_path / "cross.csv"), rendezvous=True)
    with pytest.raises(zbpipe.ScheduleError, match="deadlock with rendezvous sends"):
        _C.validate(prog, rendezvous=True)
    # What the executor posts for it, each batch coalesced: the model finds the same cycle.
    logs = record("custom", 2, 3, program=prog, stream_ordered=False, prepost_receives=False)
    verdict = check(_coalesce_all(logs))
    assert verdict.deadlock and not verdict.mismatches, verdict
    # Stream-ordered, the executor refuses the program before any message.
    with pytest.raises(RuntimeError, match="deadlock with rendezvous sends"):
        record("custom", 2, 3, program=prog)


def _post(work, *ops, coalesced=True):
    return ("post", work, coalesced, list(ops))


def test_model_rules_on_hand_written_logs():
    # Both ranks send, then receive, in separate groups: each send waits for a receive that is
    # queued behind the peer's own send.
    cross = {0: [_post(0, ("send", 1, 1, 8)), _post(1, ("recv", 1, 2, 8)), ("wait", 1, False, [])],
             1: [_post(0, ("send", 0, 2, 8)), _post(1, ("recv", 0, 1, 8)), ("wait", 1, False, [])]}
    v = check(cross)
    assert not v.ok and "waits for rank" in v.deadlock, v
    # The same ops in one group per rank: posted atomically, they meet.
    paired = {0: [_post(0, ("send", 1, 1, 8), ("recv", 1, 2, 8)), ("wait", 0, False, [])],
              1: [_post(0, ("send", 0, 2, 8), ("recv", 0, 1, 8)), ("wait", 0, False, [])]}
    assert check(paired).ok and check(paired).messages == 2
    # Matching is by order, not tag: a swapped pair is a mismatch, a size difference too.
    swapped = {0: [_post(0, ("send", 1, 1, 8), ("send", 1, 2, 8))],
               1: [_post(0, ("recv", 0, 2, 8), ("recv", 0, 1, 8))]}
    assert len(check(swapped).mismatches) == 2
    sized = {0: [_post(0, ("send", 1, 1, 8))], 1: [_post(0, ("recv", 0, 1, 16))]}
    assert "16 B" in check(sized).mismatches[0]
    # A lone op and a coalesced one travel on different communicators: rank 0 creates the
    # pair's, which rank 1 never joins.
    split = {0: [_post(0, ("send", 1, 1, 8), coalesced=False)], 1: [_post(0, ("recv", 0, 1, 8))]}
    v = check(split)
    assert v.deadlock and "creating communicator 0:1" in v.deadlock and v.comms == {0: {"0:1"}, 1: {"world"}}
    assert check(split, eager=True).ok  # with a device_id both use the group's communicator
    # Lazy init: rank 2 never joins the world communicator that ranks 0 and 1 create.
    lazy = {0: [_post(0, ("send", 1, 1, 8))], 1: [_post(0, ("recv", 0, 1, 8))], 2: []}
    v = check(lazy)
    assert v.deadlock and "creating communicator world" in v.deadlock, v
    assert check(lazy, eager=True).ok
    # The compute stream orders a group after what was issued before it: a wait on a receive
    # that follows a send which needs that very receive's data.
    behind = {0: [_post(0, ("recv", 1, 1, 8)), ("wait", 0, False, []), _post(1, ("send", 1, 2, 8))],
              1: [_post(0, ("recv", 0, 2, 8)), ("wait", 0, False, []), _post(1, ("send", 0, 1, 8))]}
    v = check(behind)
    assert v.deadlock and "compute stream waits" in v.deadlock, v
