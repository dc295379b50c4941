"""`zbpipe bench --draw PATH`: one step's realized timeline (the last timed step's compute
records on the host clock, each from the end of its receive wait; every rank from its own step
start) above the simulation fed with the costs the trace measured."""

from __future__ import annotations

import os

from .. import _C
from ..plot import COLORS, Box, legend_handles, lighter, program_boxes
from ..programs import simulate
from ..tuning.stage_costs import compile_costs
from ..timeline_text import chunk_of


def _realized_boxes(program: _C.Program, traces: dict[int, list[dict]]) -> list[Box]:
    boxes = []  # times from each rank's own step start (every rank leaves one barrier)
    for rank, records in traces.items():
        for r in records:
            try:
                a = _C.Action.parse(r["action"])
            except ValueError:
                continue  # a communication batch
            if not a.is_compute:
                continue
            parts = list(a.sub_actions) or [a]
            boxes.append(Box(rank, a.kind.name, "/".join(str(p.microbatch) for p in parts),
                             (r["start_ns"] + r.get("wait_ns", 0)) / 1e6, r["end_ns"] / 1e6,
                             chunk_of(program, parts[0].stage)))
    return boxes


def _panel(ax, boxes: list[Box], pp: int, end: float, title: str) -> None:
    for b in boxes:
        color = COLORS.get(b.kind, "#999999")
        ax.broken_barh([(b.start, b.end - b.start)], (pp - 1 - b.rank - 0.3, 0.7),
                       facecolors=[lighter(color) if b.chunk % 2 else color], edgecolors="white", linewidth=0.4)
    ax.set_xlim(0, end)
    ax.set_ylim(-0.6, pp - 0.4)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {pp - 1 - i}" for i in range(pp)], fontsize=7)
    ax.set_title(title, fontsize=9)


# Layout in pixels (100 dpi), so that no text lands on another at any pp: from the top, the
# upper panel's title, the panel, its tick labels and the lower panel's title, the lower panel,
# its tick labels and axis label, then the legend.
_TITLE_PX, _BETWEEN_PX, _BELOW_PX, _LEGEND_PX = 26, 50, 44, 30
_WIDTH_PX, _LEFT, _RIGHT = 1600, 0.06, 0.98


def figure_for_row(program: _C.Program, gathered: dict, key, row: dict):
    """The two panels of one (schedule, zbpipe, AC) run: a matplotlib Figure (100 dpi)."""
    from matplotlib.figure import Figure

    traces = {rank: r[key]["last_trace"] for rank, r in enumerate(gathered["ranks"]) if "last_trace" in r.get(key, {})}
    realized = _realized_boxes(program, traces)
    profile: dict = {}
    for r in gathered["ranks"]:
        profile.update(r[key].get("profile", {}))
    comm = row["hop_ms"] / 1e3
    costs = compile_costs(profile, program.num_stages)
    res = simulate(program, f=costs["f"], b=costs["b"], w=costs["w"], comm=comm)
    simulated, _ = program_boxes(program, res, comm)
    for b in simulated:
        b.start, b.end = b.start * 1e3, b.end * 1e3
    end = max([b.end for b in realized + simulated] + [1e-9])
    pp = program.pp
    panel = max(70, 32 * pp)
    height = _TITLE_PX + panel + _BETWEEN_PX + panel + _BELOW_PX + _LEGEND_PX
    fig = Figure(figsize=(_WIDTH_PX / 100, height / 100), dpi=100)
    lower_y = (_BELOW_PX + _LEGEND_PX) / height
    upper_y = lower_y + (panel + _BETWEEN_PX) / height
    top = fig.add_axes((_LEFT, upper_y, _RIGHT - _LEFT, panel / height))
    bottom = fig.add_axes((_LEFT, lower_y, _RIGHT - _LEFT, panel / height))
    _panel(top, realized, pp, end, f"{row['schedule']}: realized step (last timed step, host clock), "
                                   f"{row['realized_ms']:.1f} ms")
    _panel(bottom, simulated, pp, end, f"simulated under the measured costs, {res.makespan * 1e3:.1f} ms "
                                       f"(gap {row['gap']:.3f})" if row.get("gap") else "simulated")
    bottom.set_xlabel("time (ms)", fontsize=8)
    handles = legend_handles(realized + simulated)
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles),
               fontsize=8, frameon=False)
    return fig


def draw_row(path: str, program: _C.Program, gathered: dict, key, row: dict) -> None:
    """Writes the two panels of one (schedule, zbpipe, AC) run to `path`."""
    figure_for_row(program, gathered, key, row).savefig(path, dpi=100)


def paths_for(path: str, names: list[str]) -> dict[str, str]:
    """One picture per name: `path` itself for one, `stem_NAME.ext` for several."""
    if len(names) == 1:
        return {names[0]: path}
    stem, ext = os.path.splitext(path)
    return {n: f"{stem}_{n}{ext or '.png'}" for n in names}
