"""The runtime's memory deltas, measured: per local stage, the bytes one microbatch's F saved
(mem_f) and the bytes of those still held from its I to its W (mem_w), the two numbers
zbpipe.simulate(..., mem_f=, mem_w=) and the cost-driven builders take.

A probing step wraps each stage forward (and its loss) in a saved-tensor pack hook that records
the storage of every tensor autograd saves, parameters and buffers excluded, counted once per
(stage, microbatch) by storage. The hook chains to the saved-tensor hooks active around the
step (save_on_cpu, a counting hook): their pack and unpack still run, and the bytes counted are
those of the tensors autograd handed to the pack. Hooks a module installs *inside* its forward
take precedence over the probe's (torch keeps one active pair), so what they pack is not seen.
Right after each I (the executor's memory probe, Executor.set_memory_probe) the probe sums the
recorded storages still alive: what waits for W. Stages that ran no I (a full B) report
mem_w = mem_f, as simulate's default does.
"""

from __future__ import annotations

import contextlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class MemoryProbe:
    """What one probing step's stages saved, per (stage, microbatch). Used from the executor
    thread only (forwards and the I callbacks run there or with the GIL held)."""

    def __init__(self):
        self.saved: dict[tuple[int, int], dict[int, tuple[StorageWeakRef, int]]] = {}
        self.after_i: dict[tuple[int, int], int] = {}

    @contextlib.contextmanager
    def recording(self, stage_index: int, mb: int, module: torch.nn.Module, data: list):
        """Records the storages autograd saves inside the block for (stage_index, mb), but
        those of the module's parameters and buffers and of the tensors in `data`."""
        own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers(), *data)}
        rec = self.saved.setdefault((stage_index, mb), {})
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in own and ptr not in rec:
                rec[ptr] = (StorageWeakRef(storage), storage.nbytes())
            return outer_pack(t) if outer_pack is not None else t

        def unpack(h):
            return outer_unpack(h) if outer_unpack is not None else h

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def backward_input_done(self, stage_index: int, mb: int) -> None:
        """Right after (stage_index, mb)'s I: the recorded bytes still alive wait for W."""
        rec = self.saved.get((stage_index, mb), {})
        self.after_i[(stage_index, mb)] = sum(n for ref, n in rec.values() if not ref.expired())

    def profile(self) -> dict[int, dict[str, int]]:
        """{stage: {"mem_f": bytes, "mem_w": bytes}}, the largest microbatch of each stage."""
        out: dict[int, dict[str, int]] = {}
        for (stage, mb), rec in sorted(self.saved.items()):
            mem_f = sum(n for _, n in rec.values())
            entry = out.setdefault(stage, {"mem_f": 0, "mem_w": 0, "_i": False})
            entry["mem_f"] = max(entry["mem_f"], mem_f)
            if (stage, mb) in self.after_i:
                entry["_i"] = True
                entry["mem_w"] = max(entry["mem_w"], self.after_i[(stage, mb)])
        for entry in out.values():
            if not entry.pop("_i"):
                entry["mem_w"] = entry["mem_f"]  # a full B holds it all until it ends
        return out


def chrome_memory_events(profile: dict[int, dict[str, int]], rank: int) -> list[dict]:
    """The profile as Chrome trace counter events on the rank's process, one per stage."""
    return [{"name": f"stage {s} saved bytes", "ph": "C", "pid": rank, "tid": 0, "ts": 0,
             "args": {"mem_f": v["mem_f"], "mem_w": v["mem_w"]}} for s, v in sorted(profile.items())]
