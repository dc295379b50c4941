"""Every program the builders emit, byte for byte: the to_csv text of each schedule over a
grid of pp, microbatch counts, stages per rank and costs, compared with the digests recorded in
tests/core/golden/programs.json.

A refactor of the core (lowering, validation, the list scheduler) must leave this test passing
unchanged. A change that alters programs on purpose regenerates the file and says so in its
commit:

    PYTHONPATH=. python tests/core/test_program_golden.py --write
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, when run as a script
from helpers.schedule_registry import RULES  # noqa: E402  (the legal sizes of every schedule)

import zbpipe  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden" / "programs.json"
PPS = (1, 2, 3, 4, 6, 8)
# Unequal costs (the zero-bubble paper's 1.5B row, per microbatch) drive the search-based builders
# down different branches than the unit costs do.
COSTED = dict(f=[18.522], b=[18.086], w=[9.337], comm=0.601)


def cells():
    """(key, compile kwargs) for every cell of the grid."""
    for name in zbpipe.schedule_names():
        rule = RULES[name]
        for pp in PPS:
            for spr in rule.spr_values():
                for m in rule.microbatch_counts(pp):
                    kw = dict(pp=pp, microbatches=m)
                    if spr:
                        kw["stages_per_rank"] = spr
                    yield f"{name} pp={pp} m={m} spr={spr or '-'}", name, kw
                    if name in ("zb_auto", "v_half", "v_min") and m == rule.microbatch_counts(pp)[-1]:
                        yield f"{name} pp={pp} m={m} spr={spr or '-'} costed", name, dict(kw, **COSTED)


def digests() -> dict[str, str]:
    return {key: hashlib.sha256(zbpipe.compile(name, **kw).to_csv_text().encode()).hexdigest()
            for key, name, kw in cells()}


def test_every_program_is_byte_identical_to_the_recorded_one():
    recorded = json.loads(GOLDEN.read_text())
    now = digests()
    missing = sorted(set(recorded) - set(now))
    added = sorted(set(now) - set(recorded))
    changed = sorted(k for k in set(now) & set(recorded) if now[k] != recorded[k])
    assert not (missing or added or changed), (
        f"programs differ from tests/core/golden/programs.json: changed {changed[:12]} "
        f"({len(changed)} in all), new cells {added[:6]}, cells gone {missing[:6]}. "
        f"If the change is intended, regenerate: PYTHONPATH=. python tests/core/test_program_golden.py --write")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=. python tests/core/test_program_golden.py --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    d = digests()
    GOLDEN.write_text(json.dumps(d, indent=0, sort_keys=True) + "\n")
    print(f"wrote {len(d)} program digests to {GOLDEN}")
