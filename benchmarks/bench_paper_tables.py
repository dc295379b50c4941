"""The Zero Bubble paper's Table 5 (ZB-1p and ZB-2p columns) against zb_auto under the paper's
own memory model, with the refinement and the lower bound of every cell.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): Table 6 gives the profiled costs,
Table 5 the bubble rates, Table 1 the memory: a forward holds M_B = 34h + 5as per token and
layer, of which M_W = 32h waits from I to W (mem_f = M_B, mem_w = M_W; h, a from the model
table, s = 1024). ZB-1p and ZB-2p cap every rank at p and 2p forwards (memory_cap = p * M_B,
2p * M_B).

Columns: the paper's figure; zb_auto with refine=False (the heuristics' pick: the paper's own
greedy heuristic among the candidates); zb_auto as compiled by default (refined); the lower
bound of zbpipe.lower_bound (no order reaches below it: a cell at its bound is optimal); and the
compile time of the default build (median of 3, one search thread).

The V schedules against their reference, refined and bounded: bench_v_reference.py.

    PYTHONPATH=. python benchmarks/bench_paper_tables.py
    PYTHONPATH=. python benchmarks/bench_paper_tables.py --markdown   # docs/schedules.md's table
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import zbpipe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "core"))
from test_paper_bubble_rates import TABLE, paper_memory  # noqa: E402
from bench_compile import machine_line  # noqa: E402


def cell(row, cap_in_p):
    name, p, m, f, b, w, c = row[:7]
    costs = dict(f=f, b=b, w=w, comm=c)
    memory = paper_memory(name)
    cap = cap_in_p * p * memory["mem_f"]
    plain = zbpipe.compile("zb_auto", p, m, memory_cap=cap, refine=False, **memory, **costs)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        refined = zbpipe.compile("zb_auto", p, m, memory_cap=cap, search_threads=1, **memory, **costs)
        times.append(time.perf_counter() - t0)
    sim = lambda prog: zbpipe.simulate(prog, **costs, **memory).bubble_rate  # noqa: E731
    bound = zbpipe.lower_bound(plain, **costs, **memory, memory_cap=cap).bubble_rate
    return sim(plain), sim(refined), max(bound, 0.0), statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    print(machine_line() + "\n")
    head = ("model", "p", "m", "cap", "paper", "zb_auto refine=False", "zb_auto", "lower bound",
            "compile ms")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print(f"{head[0]:<6} {head[1]:>3} {head[2]:>4} {head[3]:>4} {head[4]:>7} {head[5]:>21} "
              f"{head[6]:>8} {head[7]:>12} {head[8]:>11}")
    for cap_in_p, column in ((1, 10), (2, 11)):
        for row in TABLE:
            plain, refined, bound, ms = cell(row, cap_in_p)
            values = (row[0], row[1], row[2], f"{cap_in_p}p", f"{row[column]:.4f}", f"{plain:.4f}",
                      f"{refined:.4f}", f"{bound:.4f}", f"{ms:.1f}")
            if args.markdown:
                print("| " + " | ".join(str(v) for v in values) + " |")
            else:
                print(f"{values[0]:<6} {values[1]:>3} {values[2]:>4} {values[3]:>4} {values[4]:>7} "
                      f"{values[5]:>21} {values[6]:>8} {values[7]:>12} {values[8]:>11}")


if __name__ == "__main__":
    main()
