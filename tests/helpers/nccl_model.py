"""A model of a stream-ordered backend (ProcessGroupNCCL over NCCL, torch 2.13), replaying what
each rank posted and waited for (the log of zbpipe._C._LoopbackWorld) under NCCL's rules:

- Communicator. A coalesced group (startCoalescing/endCoalescing) runs on the group's device
  communicator; a lone send/recv on a two-rank communicator of its own ("low:high"), unless
  the group was created with a device_id (eager init), which puts it on the group's too.
  Without eager init a communicator is created at its first use, a blocking step of the host
  that needs every member to reach its own first use.
- Streams. Each communicator has one stream per rank, running that rank's groups on it in
  issue order; a group starts once the previous one on its stream is complete and the compute
  stream has done everything issued before the post (ProcessGroupNCCL makes the NCCL stream
  wait on the current stream). A wait orders the compute stream after the whole group; a
  host poll (first isCompleted) blocks the host until the group is complete.
- Rendezvous. A send completes only when its receive is posted and running, and vice versa;
  a group completes when all of its ops have (it is posted atomically: all of its ops run
  together, so ops to different peers inside one group cannot block each other).
- Matching. Per communicator and ordered rank pair, the k-th send matches the k-th receive,
  whatever the tags: a different size (or another message, told apart here by its tag) is a
  mismatch, an op left without a partner never completes.

Not modelled: NCCL's buffering of small messages (it can only remove deadlocks, so the model is
the worst case), timing, several devices per rank, collectives.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

WORLD = "world"  # the group's device communicator


@dataclass
class Op:
    group: "Group"
    is_send: bool
    peer: int
    tag: int
    nbytes: int
    partner: "Op | None" = None
    done: bool = False


@dataclass
class Group:
    rank: int
    work: int
    pos: int  # index of its post in the rank's log
    comm: str
    ops: list[Op] = field(default_factory=list)
    started: bool = False
    done: bool = False


@dataclass
class Verdict:
    ok: bool
    deadlock: str | None
    mismatches: list[str]
    messages: int          # matched send/receive pairs
    comms: dict[int, set]  # per rank: the communicators it used

    def __str__(self) -> str:
        if self.ok:
            return f"ok: {self.messages} messages, communicators {sorted(set().union(*self.comms.values()))}"
        parts = ([f"deadlock: {self.deadlock}"] if self.deadlock else []) + self.mismatches[:5]
        return "; ".join(parts)


def as_mixed(logs: dict[int, list]) -> dict[int, list]:
    """The logs as zbpipe posted before every batch was coalesced on stream-ordered backends:
    batches of one op went out alone (P2P::post coalesced only batches of more than one)."""
    return {r: [(t, w, c and len(ops) > 1, ops) for t, w, c, ops in log] for r, log in logs.items()}


def _comm_of(rank: int, coalesced: bool, peer: int, eager: bool) -> str:
    if coalesced or eager:
        return WORLD
    return f"{min(rank, peer)}:{max(rank, peer)}"


def check(logs: dict[int, list], *, eager: bool = False) -> Verdict:
    """Replays `logs` (rank -> recorded events) and says whether every message matches and
    every rank finishes. `eager`: the group was created with a device_id."""
    ranks = sorted(logs)
    groups: dict[tuple[int, int], Group] = {}           # (rank, work) -> group
    at: dict[int, dict[int, Group]] = defaultdict(dict)  # rank -> log index -> group posted there
    streams: dict[tuple[int, str], list[Group]] = defaultdict(list)
    sends: dict[tuple[str, int, int], list[Op]] = defaultdict(list)  # (comm, src, dst)
    recvs: dict[tuple[str, int, int], list[Op]] = defaultdict(list)
    first_use: dict[tuple[int, str], int] = {}          # (rank, comm) -> log index
    comms: dict[int, set] = {r: set() for r in ranks}
    for r in ranks:
        for i, (kind, work, coalesced, ops) in enumerate(logs[r]):
            if kind != "post":
                continue
            peers = {peer for _, peer, _, _ in ops}
            assert coalesced or len(ops) == 1, f"rank {r}: an uncoalesced post of {len(ops)} ops"
            comm = _comm_of(r, coalesced, next(iter(peers)), eager)
            g = Group(r, work, i, comm)
            for direction, peer, tag, nbytes in ops:
                op = Op(g, direction == "send", peer, tag, nbytes)
                g.ops.append(op)
                (sends[(comm, r, peer)] if op.is_send else recvs[(comm, peer, r)]).append(op)
            groups[(r, work)] = g
            at[r][i] = g
            streams[(r, comm)].append(g)
            first_use.setdefault((r, comm), i)
            comms[r].add(comm)

    mismatches, messages = [], 0
    for key in set(sends) | set(recvs):
        comm, src, dst = key
        for k, (s, v) in enumerate(zip(sends[key], recvs[key])):
            if (s.tag, s.nbytes) != (v.tag, v.nbytes):
                mismatches.append(
                    f"communicator {comm}, rank {src} -> {dst}, message #{k}: the send (tag {s.tag}, "
                    f"{s.nbytes} B) meets a receive for tag {v.tag}, {v.nbytes} B")
            s.partner, v.partner = v, s
            messages += 1

    members = {WORLD: set(ranks)}
    for _, comm in first_use:
        if comm != WORLD:
            members[comm] = {int(x) for x in comm.split(":")}
    initialised = {c for c in members if eager}
    prev: dict[int, Group | None] = {}  # group -> the one before it on its stream
    for stream in streams.values():
        for a, b in zip([None] + stream, stream):
            prev[id(b)] = a

    host = {r: 0 for r in ranks}    # events issued by the host
    stream = {r: 0 for r in ranks}  # events the compute stream has passed
    progress = True
    while progress:
        progress = False
        for c in members:
            if c not in initialised and all(
                    (m, c) in first_use and host[m] >= first_use[(m, c)] for m in members[c]):
                initialised.add(c)
                progress = True
        for r in ranks:
            log = logs[r]
            while host[r] < len(log):
                i = host[r]
                kind, work, _, _ = log[i]
                if kind == "post" and at[r][i].comm not in initialised:
                    break  # creating the communicator: every member must get here
                if kind == "sync" and not groups[(r, work)].done:
                    break
                host[r] += 1
                progress = True
            while stream[r] < host[r]:
                kind, work, _, _ = log[stream[r]]
                if kind != "post" and not groups[(r, work)].done:
                    break
                stream[r] += 1
                progress = True
        for g in groups.values():
            if not g.started:
                p = prev[id(g)]
                if stream[g.rank] > g.pos and (p is None or p.done):
                    g.started = progress = True
        for g in groups.values():
            if g.started and not g.done:
                for op in g.ops:
                    if not op.done and op.partner is not None and op.partner.group.started:
                        op.done = op.partner.done = True
                if all(op.done for op in g.ops):
                    g.done = progress = True

    stuck = [r for r in ranks if host[r] < len(logs[r]) or stream[r] < len(logs[r])]
    stuck_groups = [g for g in groups.values() if not g.done]
    deadlock = None
    if stuck or stuck_groups:
        deadlock = _explain(logs, host, stream, groups, at, prev, initialised, stuck, stuck_groups)
    return Verdict(deadlock is None and not mismatches, deadlock, mismatches, messages, comms)


def _explain(logs, host, stream, groups, at, prev, initialised, stuck, stuck_groups) -> str:
    def why_group(g: Group, depth: int = 0) -> str:
        if not g.started:
            p = prev[id(g)]
            if p is not None and not p.done:
                return f"behind work {p.work} on its stream" + (f", {why_group(p, 1)}" if depth == 0 else "")
            return "the compute stream has not reached its post"
        for op in g.ops:
            if not op.done:
                what = f"{'send to' if op.is_send else 'recv from'} rank {op.peer} (tag {op.tag})"
                if op.partner is None:
                    return f"its {what} has no partner on communicator {g.comm}"
                return f"its {what} waits for rank {op.peer}'s work {op.partner.group.work} to start"
        return "?"

    lines = []
    for r in stuck:
        log = logs[r]
        if host[r] < len(log):
            kind, work, _, _ = log[host[r]]
            if kind == "post":
                lines.append(f"rank {r} host blocks creating communicator {at[r][host[r]].comm}")
            else:
                lines.append(f"rank {r} host polls work {work}: {why_group(groups[(r, work)])}")
        if stream[r] < host[r]:
            kind, work, _, _ = log[stream[r]]
            lines.append(f"rank {r} compute stream waits on work {work}: {why_group(groups[(r, work)])}")
    if not lines:
        g = stuck_groups[0]
        lines.append(f"rank {g.rank} work {g.work} never completes: {why_group(g)}")
    return "; ".join(lines)
