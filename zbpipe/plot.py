"""Timeline pictures (ranks as rows, F/I/W/B colored, communication drawn) of a simulated
program or of a runtime Chrome trace. matplotlib is imported only inside draw(), so the rest of
zbpipe works without it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import _C
from .timeline_text import VOCAB_PASSES, chunk_of

COLORS = {
    "F": "#4c78a8",
    "B": "#7b4f9d",
    "I": "#f58518",
    "W": "#54a24b",
    "OVERLAP_F_B": "#e45756",
    "S": "#eeca3b",  # vocabulary parallelism: a shard's S pass
    "T": "#9d755d",  # and its T pass
    "E": "#72b7b2",  # the embedding's lookup
    "EW": "#b279a2",  # and its weight gradient
}
COMM_COLOR = "#555555"


@dataclass
class Box:
    """One compute (or, from a trace, communication) interval on a rank's row."""

    rank: int
    kind: str  # "F", "I", ..., or "COMM"
    label: str  # microbatch number shown inside when it fits
    start: float
    end: float
    chunk: int = 0  # 1 = the rank's second stage, drawn lighter


@dataclass
class Arrow:
    """A cross-rank transfer: from the producer's row at `start` to the consumer's at `end`."""

    src_rank: int
    dst_rank: int
    start: float
    end: float


def program_boxes(program: _C.Program, result: _C.SimResult, comm: float):
    """Boxes for every simulated compute, arrows for every output that crosses ranks. With
    vocabulary parallelism also the S and T passes, the collectives' arrows (the broadcast from
    the last stage's rank, the reduction back to it) and each all-reduce as a communication
    bar from a rank's post to its completion."""
    boxes, arrows = [], []
    last = program.num_stages - 1
    rank_of = program.stage_to_rank
    for e in result.timeline:
        a = e.action
        parts = list(a.sub_actions) if a.kind == _C.Kind.OVERLAP_F_B else [a]
        label = "/".join(str(p.microbatch) for p in parts)
        if a.kind in VOCAB_PASSES:
            boxes.append(Box(e.rank, a.kind.name, label, e.start, e.end))
            continue
        chunk = chunk_of(program, parts[0].stage)
        boxes.append(Box(e.rank, a.kind.name, label, e.start, e.end, chunk))
        for p in parts:
            if p.kind == _C.Kind.F and p.stage < last:
                dst = rank_of[p.stage + 1]
            elif p.kind in (_C.Kind.B, _C.Kind.I) and p.stage > 0:
                dst = rank_of[p.stage - 1]
            else:
                continue
            if dst != e.rank:
                arrows.append(Arrow(e.rank, dst, e.end, e.end + comm))
    for e in result.collectives:
        kind = e.action.kind
        # The head's collectives meet at the last stage's rank, the embedding's at stage 0's.
        root = rank_of[0] if kind in (_C.Kind.REDUCE_E, _C.Kind.BCAST_E) else rank_of[last]
        if kind == _C.Kind.ALLREDUCE_S:
            boxes.append(Box(e.rank, "COMM", str(e.action.microbatch), e.start, e.end))
        elif e.rank != root:  # BCAST_*: from the root to this rank; REDUCE_*: to the root
            posted = next(c.start for c in result.collectives if c.rank == root and c.action.kind == kind
                          and c.action.microbatch == e.action.microbatch)
            arrows.append(Arrow(root, e.rank, posted, e.end) if kind in (_C.Kind.BCAST_F, _C.Kind.BCAST_E)
                          else Arrow(e.rank, root, e.start, e.end))
    return boxes, arrows


def _parse_name(name: str) -> list[_C.Action] | None:
    """An event name as actions: one canonical string, or a comm batch joined with '+'."""
    try:
        return [_C.Action.parse(part) for part in name.split("+")]
    except ValueError:
        return None


def load_trace(path: str, lane: int | None = None) -> list[Box]:
    """Boxes from a Chrome-trace JSON (a list of events or {"traceEvents": [...]}) whose
    complete events are named by action strings ("1F3", "0SEND_B2", a comm batch
    "0SEND_F1+0RECV_B0"); "ts"/"dur" in us. The rank is "pid" (or "tid" when there is no pid).
    A rank with several tids is a runtime trace with one lane per clock (zbpipe's: tid 0 host,
    tid 1 device, whose time bases differ): `lane` picks the tid, default the smallest one.
    Events named otherwise are skipped."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no event list)")
    parsed = []
    for ev in events:
        if not (isinstance(ev, dict) and "ts" in ev and "dur" in ev):
            continue
        actions = _parse_name(str(ev.get("name", "")))
        try:
            rank = int(ev["pid"] if "pid" in ev else ev.get("tid", 0))
            tid = int(ev.get("tid", rank))
            ts, dur = float(ev["ts"]), float(ev["dur"])
        except (TypeError, ValueError):
            continue
        if actions:
            parsed.append((rank, tid, actions, ts, dur))
    lanes: dict[int, set[int]] = {}
    for rank, tid, *_ in parsed:
        lanes.setdefault(rank, set()).add(tid)
    parsed = [e for e in parsed if e[1] == (min(lanes[e[0]]) if lane is None else lane)]
    if not parsed:
        raise ValueError(f"{path}: no events named by schedule actions (like '1F3')"
                         + (f" on tid {lane}" if lane is not None else ""))
    t0 = min(ts for *_, ts, _ in parsed)
    # A rank's stages in ascending order give each action's chunk.
    stages: dict[int, set[int]] = {}
    for rank, _, actions, _, _ in parsed:
        for a in actions:
            stages.setdefault(rank, set()).update(p.stage for p in a.sub_actions or [a] if not _vocab(p))
    boxes = []
    for rank, _, actions, ts, dur in parsed:
        a = actions[0]
        parts = a.sub_actions or [a]
        chunk = 0 if _vocab(a) else sorted(stages[rank]).index(parts[0].stage)
        kind = a.kind.name if len(actions) == 1 and a.is_compute else "COMM"
        label = "/".join(str(p.microbatch) for p in parts)
        boxes.append(Box(rank, kind, label, (ts - t0) / 1e3, (ts - t0 + dur) / 1e3, chunk))
    return boxes


def _vocab(action: _C.Action) -> bool:
    """A vocabulary action: its leading number is the rank's shard, not a stage."""
    return action.kind in VOCAB_PASSES or action.kind in _COLLECTIVES


_COLLECTIVES = (_C.Kind.BCAST_F, _C.Kind.ALLREDUCE_S, _C.Kind.REDUCE_B, _C.Kind.REDUCE_E, _C.Kind.BCAST_E)


def lighter(color: str, amount: float = 0.45) -> tuple[float, float, float]:
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)


def draw(boxes: list[Box], arrows: list[Arrow], pp: int, path: str, *, size=(1600, 400),
         title: str = "", time_unit: str = "cost units") -> None:
    """Writes the picture to `path` (format from its extension) at exactly `size` pixels."""
    figure(boxes, arrows, pp, size=size, title=title, time_unit=time_unit).savefig(path, dpi=100)


def figure(boxes: list[Box], arrows: list[Arrow], pp: int, *, size=(1600, 400), title: str = "",
           time_unit: str = "cost units"):
    """The picture of draw() as a matplotlib Figure (100 dpi)."""
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    dpi = 100
    fig = Figure(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi)
    # Margins in pixels so that ticks, label and legend never overlap at any size.
    bottom, top, left = 85 / size[1], 28 / size[1], 70 / size[0]
    ax = fig.add_axes((left, bottom, 0.985 - left, 1 - bottom - top))
    end = max([b.end for b in boxes] + [a.end for a in arrows] + [1e-9])
    px_per_unit = size[0] * (0.985 - left) / end
    row = lambda r: pp - 1 - r  # rank 0 on top  # noqa: E731
    for b in boxes:
        if b.kind == "COMM":  # a thin bar under the row: the transfer's own time
            ax.broken_barh([(b.start, b.end - b.start)], (row(b.rank) - 0.45, 0.15),
                           facecolors=COMM_COLOR)
            continue
        color = COLORS.get(b.kind, "#999999")
        face = lighter(color) if b.chunk % 2 == 1 else color
        ax.broken_barh([(b.start, b.end - b.start)], (row(b.rank) - 0.3, 0.7),
                       facecolors=[face], edgecolors="white", linewidth=0.5)
        if (b.end - b.start) * px_per_unit >= 7 * len(b.label) + 2:
            ax.text((b.start + b.end) / 2, row(b.rank) + 0.05, b.label, ha="center",
                    va="center", fontsize=7, color="black" if b.chunk % 2 else "white")
    if arrows:
        lines = [((a.start, row(a.src_rank) - 0.3 if a.dst_rank > a.src_rank else row(a.src_rank) + 0.4),
                  (a.end, row(a.dst_rank) + 0.4 if a.dst_rank > a.src_rank else row(a.dst_rank) - 0.3))
                 for a in arrows]
        ax.add_collection(LineCollection(lines, colors=COMM_COLOR, linewidths=0.6, alpha=0.5))
    ax.set_xlim(0, end)
    ax.set_ylim(-0.6, pp - 0.4)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {pp - 1 - i}" for i in range(pp)])
    ax.set_xlabel(f"time ({time_unit})")
    if title:
        ax.set_title(title, fontsize=10)
    handles = legend_handles(boxes, comm=bool(arrows) or any(b.kind == "COMM" for b in boxes))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles),
               fontsize=8, frameon=False)
    return fig


def legend_handles(boxes: list[Box], comm: bool = False) -> list:
    """Legend patches: one per compute kind drawn; where a rank holds two stages (V), the dark
    and light shades of its first and second stage; communication where drawn."""
    from matplotlib.patches import Patch

    order = list(COLORS)
    kinds = sorted({b.kind for b in boxes if b.kind != "COMM"}, key=lambda k: order.index(k) if k in order else 99)
    handles = [Patch(color=COLORS.get(k, "#999999"), label=k) for k in kinds]
    if any(b.chunk % 2 for b in boxes):
        handles += [Patch(color="#777777", label="dark: the rank's first stage"),
                    Patch(color=lighter("#777777"), label="light: its second stage")]
    if comm:
        handles.append(Patch(color=COMM_COLOR, label="communication"))
    return handles
