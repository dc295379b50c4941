"""Store inboxes (csrc/runtime/store_inbox.h) with ranks as threads of one process sharing one
HashStore, through the store-facing control plane of zbpipe._C._ControlPlaneRank: 8 ranks
(pipelines of 4, groups of 2 replicas) agree on a program, meet their replicas and hear of one
rank's failure. A HashStore wakes one waiter per queue push, maybe the blocked read of another
rank's inbox; every push must still reach its reader (zbpipe wakes them all), or a read waits
for the store's timeout (300 s, far above this test's bound)."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from zbpipe import _C

PP, DP = 4, 2
BOUND_S = 30.0


def test_ranks_on_one_hash_store_agree_meet_and_hear_of_a_failure():
    store = dist.HashStore()
    ranks = [_C._ControlPlaneRank(dist.PrefixStore(f"pp{g // PP}/", store), g % PP, PP,
                                  dist.PrefixStore(f"dp{g % PP}/", store), g // PP, DP, g) for g in range(PP * DP)]
    errors = []

    def setup(r):
        try:
            r.agree("the same program", BOUND_S)
            r.meet(BOUND_S)
        except Exception as e:  # noqa: BLE001 - the point
            errors.append(repr(e))

    t0 = time.monotonic()
    threads = [threading.Thread(target=setup, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S + 10)
    assert not errors and time.monotonic() - t0 < BOUND_S, errors
    ranks[0].fail("RuntimeError: rank 0 stops")
    deadline = time.monotonic() + BOUND_S
    while any(r.seen_at_ns < 0 for r in ranks[1:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(r.seen.startswith("rank 0 failed in the benchmark: RuntimeError: rank 0 stops") for r in ranks[1:]), \
        [r.seen for r in ranks]
