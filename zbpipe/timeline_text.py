"""Terminal pictures of a simulated program: the slot grid of ``zbpipe plan`` (ranks as rows,
one column per time slot, like the papers' figures) and short labels shared with the plots.
A vocabulary-parallel program's S and T passes show as "S3" / "T3"."""

from __future__ import annotations

from . import _C


# The vocabulary passes (docs/vocab_parallel.md): their leading number is the rank's shard.
VOCAB_PASSES = (_C.Kind.S, _C.Kind.T)


def kind_letter(kind: _C.Kind) -> str:
    """``Kind.F`` -> ``"F"``; OVERLAP_F_B -> ``"OVERLAP_F_B"``."""
    return kind.name


def chunk_of(program: _C.Program, stage: int) -> int:
    """Position of `stage` among its rank's stages: 0 for the first, 1 for the second, ..."""
    return program.stages_of(program.stage_to_rank[stage]).index(stage)


def short_label(program: _C.Program, action: _C.Action) -> str:
    """Kind letter + microbatch ("F3"); lowercase on a rank's second stage ("f3"), as the
    papers shade a V schedule's second chunk; canonical strings beyond two stages per rank."""
    if action.kind == _C.Kind.OVERLAP_F_B:
        return "+".join(short_label(program, sub) for sub in action.sub_actions)
    if action.kind in VOCAB_PASSES:  # the rank's vocabulary shard: not a stage
        return f"{kind_letter(action.kind)}{action.microbatch}"
    spr = program.num_stages // program.pp
    if spr > 2:
        return str(action)
    text = f"{kind_letter(action.kind)}{action.microbatch}"
    return text.lower() if chunk_of(program, action.stage) == 1 else text


def slot_grid(program: _C.Program, result: _C.SimResult, slot: float = 1.0) -> str:
    """One row per rank, one column per `slot` of simulated time; an action that lasts several
    slots is its label followed by dashes, an idle slot is a dot."""
    events = list(result.timeline)
    labels = [short_label(program, e.action) for e in events]
    # Width from one-slot actions so the grid stays as narrow as the labels allow.
    one_slot = [len(lab) for lab, e in zip(labels, events) if round((e.end - e.start) / slot) <= 1]
    width = max(one_slot or [2]) + 1
    # An event covers slots round(start) .. max(round(end), round(start) + 1): half-slot times
    # (vocabulary passes of 0.5) round to even, so the end alone may fall short of the start.
    def end_slot(e):
        return max(round(e.end / slot), round(e.start / slot) + 1)

    n_slots = max((end_slot(e) for e in events), default=0)
    rows = []
    head = "rank"
    name_w = max(len(head), len(f"rank {program.pp - 1}")) + 1
    for r in range(program.pp):
        # Idle slots are dots up to the rank's last action (its span and warm-up wait).
        last_end = max((end_slot(e) for e in events if e.rank == r), default=0)
        cells = [".".ljust(width)] * last_end + [""] * (n_slots - last_end)
        for lab, e in zip(labels, events):
            if e.rank != r:
                continue
            first, last = round(e.start / slot), end_slot(e)
            span = (last - first) * width - 1
            text = (lab if len(lab) <= span else lab[:span]).ljust(span, "-") + " "
            cells[first] = text
            for k in range(first + 1, last):
                cells[k] = ""
        rows.append(f"rank {r}".ljust(name_w) + "".join(cells).rstrip())
    ruler = [" "] * (n_slots * width)
    for t in range(0, n_slots, 5):
        for k, ch in enumerate(str(t)):
            if t * width + k < len(ruler):
                ruler[t * width + k] = ch
    return "\n".join(["slot".ljust(name_w) + "".join(ruler).rstrip(), *rows])
