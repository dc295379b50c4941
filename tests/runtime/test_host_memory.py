"""A rank computing on the CPU keeps freed host memory in the process (csrc/runtime/host_memory.h):
glibc would otherwise hand large freed blocks back to the kernel, and every W and B would fault
in fresh pages for its weight gradients. ZBPIPE_KEEP_HOST_MEMORY=0 leaves malloc as it is.

Each case runs in a fresh process (the policy is set once per process, at the first executor):
a 64 MiB tensor freed before any step returns its pages (glibc's default), and after one step
of a CPU schedule it stays in the process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.subprocess_env import NEUTRAL_CWD, child_env

CHILD = """
import torch, torch.distributed as dist, torch.nn.functional as F
import zbpipe
torch.set_num_threads(1)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def returned_mib(mib=64):
    t = torch.ones(mib << 18)  # touched: resident
    before = rss()
    del t
    return (before - rss()) >> 20

first = returned_mib()
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
stage = zbpipe.PipelineStage(torch.nn.Linear(8, 8), 0, 1, "cpu")
zbpipe.Schedule1F1B(stage, 2, loss_fn=F.mse_loss).step(torch.randn(4, 8), target=torch.randn(4, 8))
print(first, returned_mib())
dist.destroy_process_group()
"""


def _returned(keep: str | None) -> tuple[int, int]:
    """MiB a freed 64 MiB tensor gives back to the kernel, before and after a step."""
    env = child_env()  # the zbpipe this process imported (the installed one in CI)
    env.pop("ZBPIPE_KEEP_HOST_MEMORY", None)
    if keep is not None:
        env["ZBPIPE_KEEP_HOST_MEMORY"] = keep
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=NEUTRAL_CWD, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split()[-2:])
    return before, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the policy is glibc's (Linux)")
def test_a_cpu_rank_keeps_freed_host_memory():
    before, after = _returned(None)
    assert before >= 60, f"glibc kept a freed 64 MiB block before any step ({before} MiB returned)"
    assert after <= 4, f"after a CPU step, a freed 64 MiB block went back to the kernel ({after} MiB)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the policy is glibc's (Linux)")
def test_zbpipe_keep_host_memory_0_leaves_malloc_alone():
    before, after = _returned("0")
    assert before >= 60 and after >= 60, (before, after)
