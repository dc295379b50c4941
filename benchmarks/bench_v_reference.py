"""v_half / v_min against the reference implementation of the controllable-memory V paper.

    PYTHONPATH=. python benchmarks/bench_v_reference.py [--sweep] [--markdown]

The reference is sail-sg/zero-bubble-pipeline-parallelism (commit 39f2c18), the V-Half / V-Min
greedy of megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py: the paper's
repeating block, W in idle slots, warm-up / cool-down reordering, squeeze
(PipelineGraph.schedule_from_pattern(..., do_reorder=True)). Its figures below were printed by
that code (it needs megatron to import, so it is not run here); bubble rate = (longest span -
work) / longest span, as zbpipe.simulate. Costs: the Zero Bubble paper's Table 6 (T_F, T_B, T_W,
T_comm per 1F1B stage), pass times halved per V stage, T_comm not.

"block" is the paper's block laid out as is, each idle slot running the oldest pending W (what
zbpipe built before its post-passes; its program at these cells), "search" is zbpipe.compile
with refine=False (the post-passes and the search: the reference's program), "zbpipe" the
default compile (refined, the same memory); "vs ref" compares it with the reference's 6
decimals; "refine 3M" is zbpipe.refine at its default budget on the search's pick, "bound" the
lower bound of zbpipe.lower_bound (no program within the cap does better), both within the
paper's cap. Memory: the largest per-rank peak in (stage, microbatch) units, half a
1F1B stage's activations each, against the paper's cap of (p+2)//2 (V-Half) and (p+4)//3
(V-Min) 1F1B microbatches. --sweep adds p = 4..12 at m = p, 2p, 3p (1.5B m=24 costs).
"""

from __future__ import annotations

import argparse

import zbpipe
from bench_compile import machine_line

TABLE6 = {  # (T_F, T_B, T_W, T_comm) per 1F1B stage
    "1.5B m=24": (18.522, 18.086, 9.337, 0.601),
    "1.5B m=32": (18.513, 18.086, 9.331, 0.626),
    "1.5B m=64": (18.546, 18.097, 9.321, 0.762),
    "14.6B m=48": (11.347, 11.248, 8.132, 0.377),
}
COSTS_1_5B = "1.5B m=24"
REFERENCE = [  # schedule, p, m, Table 6 row of the costs, the reference's bubble rate
    ("v_half", 8, 24, "1.5B m=24", 0.170151), ("v_half", 8, 32, "1.5B m=32", 0.133903),
    ("v_half", 8, 64, "1.5B m=64", 0.073731), ("v_half", 16, 48, "14.6B m=48", 0.168185),
    ("v_min", 8, 24, "1.5B m=24", 0.335264), ("v_min", 8, 32, "1.5B m=32", 0.310344),
    ("v_min", 8, 64, "1.5B m=64", 0.275758), ("v_min", 16, 48, "14.6B m=48", 0.292658),
    # the same cells, all at the 1.5B m=24 row's costs
    ("v_half", 8, 32, COSTS_1_5B, 0.133283), ("v_half", 8, 64, COSTS_1_5B, 0.071399),
    ("v_half", 16, 48, COSTS_1_5B, 0.190173), ("v_min", 8, 32, COSTS_1_5B, 0.308900),
    ("v_min", 8, 64, COSTS_1_5B, 0.265186), ("v_min", 16, 48, COSTS_1_5B, 0.349004),
]
# The reference at the 1.5B m=24 row's costs for m = p, 2p, 3p.
REFERENCE_SWEEP = {
    "v_half": {4: (0.372788, 0.182894, 0.129845), 5: (0.428570, 0.234556, 0.169633),
               6: (0.380325, 0.217627, 0.156433), 7: (0.471363, 0.249220, 0.181199),
               8: (0.395879, 0.235215, 0.170151), 9: (0.459532, 0.256031, 0.186614),
               10: (0.414274, 0.246951, 0.179402), 11: (0.477697, 0.262428, 0.191723),
               12: (0.424554, 0.252034, 0.183433)},
    "v_min": {4: (0.443530, 0.346142, 0.305635), 5: (0.463816, 0.360360, 0.316393),
              6: (0.455702, 0.357334, 0.316137), 7: (0.483640, 0.377259, 0.331290),
              8: (0.490694, 0.382385, 0.335264), 9: (0.482933, 0.377558, 0.332194),
              10: (0.498169, 0.388891, 0.340856), 11: (0.502041, 0.391463, 0.342818),
              12: (0.495552, 0.387201, 0.339942)},
}
CAP_UNITS = {"v_half": lambda p: 2 * ((p + 2) // 2), "v_min": lambda p: 2 * ((p + 4) // 3)}
V_BLOCK_SLOTS = {  # v_half.cpp / v_min.cpp: slots of F chunk 0, F chunk 1, I chunk 1, I chunk 0
    "v_half": lambda p, i, g: (2 * i, 3 * p - i - 2, 3 * p + g + 2 * i - 1, 6 * p + g - i - 2),
    "v_min": lambda p, i, g: (i, 2 * p - i - 1, 2 * p + g + i, 4 * p + g - i - 1),
}


def v_costs(row: str) -> dict:
    f, b, w, comm = TABLE6[row]
    return dict(f=f / 2, b=b / 2, w=w / 2, comm=comm)


def block_layout(name: str, pp: int, m: int) -> zbpipe.Program:
    """The paper's block laid out as is, each idle slot running the oldest pending W."""
    g = (3 if pp % 2 == 0 else 0) if name == "v_half" else (2 if pp % 3 == 0 else 0)
    ranks = []
    for i in range(pp):
        passes = [f"{i}F", f"{2 * pp - 1 - i}F", f"{2 * pp - 1 - i}I", f"{i}I"]
        slots = {first + 6 * k: f"{p}{k}" for k in range(m)
                 for first, p in zip(V_BLOCK_SLOTS[name](pp, i, g), passes)}
        order, pending = [], []
        for t in range(max(slots) + 1):
            if t in slots:
                order.append(slots[t])
                if "I" in slots[t]:
                    pending.append(slots[t].replace("I", "W"))
            elif pending:
                order.append(pending.pop(0))
        ranks.append(order + pending)
    return zbpipe.Program.from_actions(ranks, list(range(pp)) + list(reversed(range(pp))), m)


HEAD = ("schedule", "p", "m", "costs", "reference", "block", "search", "zbpipe", "vs ref",
        "refine 3M", "bound", "peak / cap units", "1F1B-mb")
WIDTHS = (-8, 4, 5, -14, 11, 9, 9, 9, 7, 11, 8, 17, 8)  # negative: left-aligned


def row(name: str, pp: int, m: int, costs_row: str, reference: float) -> tuple:
    costs = v_costs(costs_row)
    block = zbpipe.simulate(block_layout(name, pp, m), **costs)
    searched = zbpipe.compile(name, pp, m, refine=False, **costs)
    search = zbpipe.simulate(searched, **costs)
    res = zbpipe.simulate(zbpipe.compile(name, pp, m, **costs), **costs)
    cap = CAP_UNITS[name](pp)
    refined = zbpipe.simulate(zbpipe.refine(searched, **costs, memory_cap=cap), **costs)
    bound = zbpipe.lower_bound(searched, **costs, memory_cap=cap)
    peak = max(res.peak_activations)
    diff = res.bubble_rate - reference  # the reference is given to 6 decimals
    vs = "=" if abs(diff) <= 5e-7 else ("<" if diff < 0 else ">")
    return (name, pp, m, costs_row, f"{reference:.4f}", f"{block.bubble_rate:.4f}",
            f"{search.bubble_rate:.4f}", f"{res.bubble_rate:.4f}", vs,
            f"{refined.bubble_rate:.4f}", f"{max(bound.bubble_rate, 0.0):.4f}",
            f"{peak} / {cap}", f"{peak / 2:.1f}")


def line(values: tuple, markdown: bool) -> str:
    if markdown:
        return "| " + " | ".join(str(v) for v in values) + " |"
    return "".join(f"{v:<{-w}}" if w < 0 else f"{v:>{w}}" for v, w in zip(values, WIDTHS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also p = 4..12 at m = p, 2p, 3p")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    print(machine_line() + "\n")
    print(line(HEAD, args.markdown))
    print("|" + "---|" * len(HEAD) if args.markdown else "-" * sum(abs(w) for w in WIDTHS))
    for cell in REFERENCE:
        print(line(row(*cell), args.markdown), flush=True)
    if args.sweep:
        for name, table in REFERENCE_SWEEP.items():
            for pp, refs in table.items():
                for m, reference in zip((pp, 2 * pp, 3 * pp), refs):
                    print(line(row(name, pp, m, COSTS_1_5B, reference), args.markdown), flush=True)


if __name__ == "__main__":
    main()
