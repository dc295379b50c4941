"""An independent re-check of compiled programs from their action strings (pure Python, never
calls zbpipe.validate), so a bug in the C++ validator cannot hide a bug in a builder."""

from __future__ import annotations

import re
from collections import defaultdict

_SIMPLE = re.compile(r"^(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")
_OVERLAP = re.compile(r"^\((.+)\)OVERLAP_F_B$")
COMPUTE = ("F", "B", "I", "W")


class ProgramError(AssertionError):
    """A rule the program breaks; the message names the rule, the rank and the action."""


def parse(text: str) -> list[tuple[int, str, int]]:
    """The (stage, kind, microbatch) parts an action string stands for (2 for OVERLAP_F_B)."""
    m = _OVERLAP.match(text)
    parts = m.group(1).split(";") if m else [text]
    out = []
    for part in parts:
        p = _SIMPLE.match(part)
        if not p or (m and p.group(2) not in COMPUTE):
            raise ProgramError(f"unparsable action {text!r}")
        out.append((int(p.group(1)), p.group(2), int(p.group(3))))
    return out


def check_program(ranks: list[list[str]], stage_to_rank: list[int], microbatches: int,
                  forward_only: bool = False) -> None:
    """Raises ProgramError unless the lowered program (compute + SEND/RECV strings per rank) is
    complete, placed on the owning ranks, matched in its communication and deadlock-free."""
    pp, n_stages, last = len(ranks), len(stage_to_rank), len(stage_to_rank) - 1
    rank_of = stage_to_rank.__getitem__
    seen: dict[tuple[int, str, int], int] = {}  # part -> rank
    # Per ordered rank pair, the messages in send order and in receive order.
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    parsed = [[parse(a) for a in row] for row in ranks]

    for r, row in enumerate(parsed):
        for text, parts in zip(ranks[r], row):
            for stage, kind, mb in parts:
                where = f"rank {r}, {text}"
                if not (0 <= stage < n_stages and 0 <= mb < microbatches):
                    raise ProgramError(f"out of range: {where}")
                if rank_of(stage) != r:
                    raise ProgramError(f"stage {stage} lives on rank {rank_of(stage)}: {where}")
                if (stage, kind, mb) in seen:
                    raise ProgramError(f"runs twice: {where}")
                seen[(stage, kind, mb)] = r
                if kind in COMPUTE:
                    continue
                other = stage + 1 if kind in ("SEND_F", "RECV_B") else stage - 1
                if not (0 <= other < n_stages) or rank_of(other) == r:
                    raise ProgramError(f"communication without a cross-rank peer: {where}")
                grad = kind.endswith("_B")
                msg = (stage if kind.startswith("SEND") else other, grad, mb)  # named by sender
                if kind.startswith("SEND"):
                    sends[(r, rank_of(other))].append(msg)
                else:
                    recvs[(rank_of(other), r)].append(msg)

    # Exactly once: F, and B or (I and W); and every cross-rank edge has its SEND and RECV.
    for s in range(n_stages):
        for mb in range(microbatches):
            has = {k: (s, k, mb) in seen for k in COMPUTE}
            if not has["F"]:
                raise ProgramError(f"stage {s} mb {mb} never runs F")
            if forward_only:
                if has["B"] or has["I"] or has["W"]:
                    raise ProgramError(f"stage {s} mb {mb} runs a backward in a forward-only program")
            elif not ((has["B"] and not has["I"] and not has["W"]) or
                      (has["I"] and has["W"] and not has["B"])):
                raise ProgramError(f"stage {s} mb {mb} needs B once or I and W once, has {has}")
            if s < last and rank_of(s + 1) != rank_of(s):
                need = [(s, "SEND_F", mb), (s + 1, "RECV_F", mb)]
                if not forward_only:
                    need += [(s + 1, "SEND_B", mb), (s, "RECV_B", mb)]
                for part in need:
                    if part not in seen:
                        raise ProgramError(f"missing {part[0]}{part[1]}{part[2]}")

    for pair in set(sends) | set(recvs):
        if sends[pair] != recvs[pair]:
            raise ProgramError(f"rank {pair[0]} -> rank {pair[1]}: sends {sends[pair]} and "
                               f"receives {recvs[pair]} differ in content or order")

    _run_blocking(parsed, ranks, rank_of, last)


def _needs(part: tuple[int, str, int], rank_of, last: int) -> list[tuple[int, str, int]]:
    """What must have run (anywhere) before `part` can: an any-of list per requirement."""
    s, k, mb = part
    if k == "F":
        if s == 0:
            return []
        return [((s - 1, "F", mb),) if rank_of(s - 1) == rank_of(s) else ((s, "RECV_F", mb),)]
    if k in ("B", "I"):
        reqs = [((s, "F", mb),)]
        if s < last:
            reqs.append(((s + 1, "B", mb), (s + 1, "I", mb)) if rank_of(s + 1) == rank_of(s)
                        else ((s, "RECV_B", mb),))
        return reqs
    if k == "W":
        return [((s, "I", mb),)]
    if k == "SEND_F":
        return [((s, "F", mb),)]
    if k == "SEND_B":
        return [((s, "B", mb), (s, "I", mb))]
    if k == "RECV_F":
        return [((s - 1, "SEND_F", mb),)]
    return [((s + 1, "SEND_B", mb),)]  # RECV_B


def _run_blocking(parsed, ranks, rank_of, last: int) -> None:
    """Every rank runs its list in order; an action waits until what it needs has run (sends
    never block, receives do). Raises on a deadlock, naming each stuck rank's next action."""
    done: set = set()
    pos = [0] * len(parsed)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(parsed):
            while pos[r] < len(row):
                parts = row[pos[r]]  # the parts of an OVERLAP_F_B run together: independent
                if not all(any(opt in done for opt in req)
                           for p in parts for req in _needs(p, rank_of, last)):
                    break
                done.update(parts)
                pos[r] += 1
                progress = True
    stuck = [f"rank {r} at {ranks[r][pos[r]]}" for r in range(len(parsed)) if pos[r] < len(parsed[r])]
    if stuck:
        raise ProgramError("deadlock in a blocking-receive run: " + "; ".join(stuck))


def check(prog, forward_only: bool = False) -> None:
    """check_program on a zbpipe.Program (its action strings only)."""
    check_program([prog.actions(r) for r in range(prog.pp)], list(prog.stage_to_rank),
                  prog.microbatches, forward_only)


# ---- vocabulary parallelism (docs/vocab_parallel.md) ------------------------------------------

_VOCAB = re.compile(r"^(\d+)(S|T|BCAST_F|ALLREDUCE_S|REDUCE_B)(\d+)$")
COLLECTIVES = ("BCAST_F", "ALLREDUCE_S", "REDUCE_B")


def check_vocab_program(ranks: list[list[str]], stage_to_rank: list[int], microbatches: int,
                        forward_only: bool = False) -> None:
    """check_program on the program without its vocabulary actions, then the vocabulary rule
    restated: on rank r the shard r's BCAST_F, S, ALLREDUCE_S (and, training, REDUCE_B and T)
    of every microbatch, once each; one order of collectives on every rank; and a blocking run
    where a collective completes once every rank posted it, S waits for BCAST_F, T and REDUCE_B
    for ALLREDUCE_S, the root's BCAST_F follows the last stage's F and the last stage's backward
    waits for REDUCE_B."""
    pp, last = len(ranks), len(stage_to_rank) - 1
    root = stage_to_rank[last]
    base = [[a for a in row if not _VOCAB.match(a)] for row in ranks]
    check_program(base, stage_to_rank, microbatches, forward_only)
    kinds = ("S", "BCAST_F", "ALLREDUCE_S") if forward_only else ("S", "T", *COLLECTIVES)
    orders = []
    for r, row in enumerate(ranks):
        mine = [(int(m.group(1)), m.group(2), int(m.group(3))) for m in map(_VOCAB.match, row) if m]
        if any(shard != r for shard, _, _ in mine):
            raise ProgramError(f"rank {r} runs another shard's vocabulary action: {mine}")
        want = sorted((k, mb) for k in kinds for mb in range(microbatches))
        if sorted((k, mb) for _, k, mb in mine) != want:
            raise ProgramError(f"rank {r}: vocabulary actions {sorted((k, mb) for _, k, mb in mine)} "
                               f"are not one of each of {kinds} per microbatch")
        orders.append([(k, mb) for _, k, mb in mine if k in COLLECTIVES])
    if any(o != orders[0] for o in orders):
        raise ProgramError("the ranks post the collectives in different orders")

    posted: dict[tuple[str, int], int] = defaultdict(int)
    done: set = set()
    pos = [0] * pp
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(ranks):
            while pos[r] < len(row):
                text = row[pos[r]]
                m = _VOCAB.match(text)
                if m:
                    kind, mb = m.group(2), int(m.group(3))
                    wait = {"S": "BCAST_F", "T": "ALLREDUCE_S", "REDUCE_B": "ALLREDUCE_S"}.get(kind)
                    if wait and posted[(wait, mb)] < pp:
                        break
                    if kind == "ALLREDUCE_S" and (r, "S", mb) not in done:
                        break
                    if kind == "BCAST_F" and r == root and (last, "F", mb) not in done:
                        break
                    if kind in COLLECTIVES:
                        posted[(kind, mb)] += 1
                    done.add((r, kind, mb))
                else:
                    parts = parse(text)
                    ok = all(any(opt in done for opt in req)
                             for p in parts for req in _needs(p, stage_to_rank.__getitem__, last))
                    if ok and not forward_only:
                        ok = all(posted[("REDUCE_B", mb)] == pp for s, k, mb in parts if s == last and k in ("B", "I"))
                    if not ok:
                        break
                    done.update(parts)
                pos[r] += 1
                progress = True
    stuck = [f"rank {r} at {ranks[r][pos[r]]}" for r in range(pp) if pos[r] < len(ranks[r])]
    if stuck:
        raise ProgramError("deadlock in a blocking run with collectives: " + "; ".join(stuck))


def check_vocab(prog, forward_only: bool = False) -> None:
    """check_vocab_program on a zbpipe.Program (its action strings only)."""
    check_vocab_program([prog.actions(r) for r in range(prog.pp)], list(prog.stage_to_rank),
                        prog.microbatches, forward_only)
