"""Prints the NCCL model's verdict, as a markdown table, on what the executor posts now (every
batch coalesced on stream-ordered backends) and on the rule it followed before (only batches of
several ops coalesced, as a tag-matched group still posts), for every schedule, pp in
{2, 3, 4, 8}, microbatches in {pp, 2pp, 3pp} where valid, one- and multi-tensor boundaries;
"lazy" communicators are created at first use, "device_id" ones eagerly.

    PYTHONPATH=. python tests/helpers/nccl_model_report.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

import torch  # noqa: E402

import zbpipe  # noqa: E402
from helpers.loopback import record  # noqa: E402
from helpers.nccl_model import check  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    rows: dict = collections.OrderedDict()
    for name in zbpipe.schedule_names():
        for pp in (2, 3, 4, 8):
            for m in (pp, 2 * pp, 3 * pp):
                try:
                    zbpipe.compile(name, pp, m)
                except zbpipe.ScheduleError:
                    continue
                for boundary in ("one", "multi"):
                    now = record(name, pp, m, boundary)
                    before = record(name, pp, m, boundary, stream_ordered=False, prepost_receives=False)
                    r = rows.setdefault((name, boundary), collections.Counter())
                    r["configs"] += 1
                    r["now"] += check(now).ok
                    r["now_eager"] += check(now, eager=True).ok
                    v = check(before)
                    r["before"] += v.ok
                    r["before_eager"] += check(before, eager=True).ok
                    r["deadlock"] += bool(v.deadlock)
                    r["mismatch"] += bool(v.mismatches)
    print("| schedule | boundary | configs | now ok (lazy / device_id) | before ok (lazy / device_id) "
          "| before, lazy: deadlock / mismatch |")
    print("|---|---|---|---|---|---|")
    for (name, boundary), r in rows.items():
        print(f"| {name} | {boundary} | {r['configs']} | {r['now']} / {r['now_eager']} | "
              f"{r['before']} / {r['before_eager']} | {r['deadlock']} / {r['mismatch']} |")


if __name__ == "__main__":
    main()
