"""What `zbpipe train` reports beyond the loss, as torchtitan computes it: FLOPs per token
(PaLM's convention), the device's peak FLOP/s for MFU, and the bytes of saved activations a
rank holds (measured with saved-tensor hooks) against the simulator's prediction.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch
from torch import nn

from .model import TinyConfig

# Dense bf16 peak FLOP/s per GPU, from the vendors' data sheets (torchtitan's table,
# torchtitan/tools/utils.py get_peak_flops); the first name found in the device name wins.
PEAK_BF16_FLOPS = (
    ("GB200", 2.5e15), ("B200", 2.25e15),
    ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H20", 148e12),
    ("A100", 312e12), ("A6000", 154.85e12), ("L40S", 362e12),
    ("MI355X", 2500e12), ("MI300X", 1300e12), ("MI325X", 1300e12), ("MI250X", 191.5e12),
)


def flops_per_token(model: nn.Module, cfg: TinyConfig) -> tuple[int, int]:
    """(N, FLOPs per token) of a training step: 6 N for the matmuls of the parameters outside
    the embeddings (forward 2, backward 4 per multiply-add) plus 12 L H Q T for attention's two
    matmuls over the sequence (PaLM; torchtitan's get_dense_model_nparams_and_flops). N counts
    every parameter; the embedding lookups do no matmul, so they are left out of the 6 N."""
    n = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for m in model.children() if isinstance(m, nn.Embedding) for p in m.parameters())
    head_dim = cfg.d_model // cfg.n_heads
    return n, 6 * (n - emb) + 12 * cfg.n_layers * cfg.n_heads * head_dim * cfg.seq_len


def measured_peak_flops(size: int = 1024, reps: int = 5) -> float:
    """FLOP/s of this process's best `size`^3 float32 matmul out of `reps` (after a warm-up):
    the CPU peak MFU is taken against, with the thread count the ranks use."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def peak_flops(device: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where it came from): a GPU's from the table by its name, a
    CPU's (or an unknown GPU's) measured with measured_peak_flops on one thread."""
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        for key, flops in PEAK_BF16_FLOPS:
            if key in name:
                return flops, f"{name}, bf16 dense, table"
        return measured_peak_flops(8192), f"{name}, not in the table: measured fp32 matmul"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a rank's share: each rank computes on one thread
    try:
        return measured_peak_flops(), "CPU, one thread, measured fp32 matmul"
    finally:
        torch.set_num_threads(threads)


class _Held:  # what the pack hook saves: the tensor (or what an outer hook packed it to), so
    # its lifetime is the holder's, and the outer hook's unpack
    __slots__ = ("t", "unpack", "__weakref__")

    def __init__(self, t, unpack=None):
        self.t, self.unpack = t, unpack


class SavedActivationMeter:
    """Bytes of the tensors autograd saves in this rank's stage forwards: the largest amount
    one forward saves per stage (the bytes of one (stage, microbatch) pair) and the peak held
    at once. A pack hook keeps each saved tensor in a holder whose release (autograd frees the
    saved tensors at the microbatch's last backward) subtracts its storage; a storage saved
    several times counts once; parameters do not count (shape inference runs under no_grad)."""

    def __init__(self, modules: dict[int, nn.Module]):
        self._lock = threading.Lock()
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, holders]
        self.current = self.peak = 0
        self.per_forward: dict[int, int] = dict.fromkeys(modules, 0)
        self._params = {p.untyped_storage().data_ptr() for m in modules.values() for p in m.parameters()}
        self._ctx = None
        self._outer_pack = self._outer_unpack = None
        for s, m in modules.items():
            m.register_forward_pre_hook(lambda mod, args, s=s: self._enter(s))
            m.register_forward_hook(lambda mod, args, out, s=s: self._exit(s))

    def _enter(self, stage: int) -> None:
        if not torch.is_grad_enabled():
            return
        self._start = self.current
        # Chain to the hooks active around the forward (the schedule's memory probe, save_on_cpu):
        # torch runs only the innermost pair, and this one is installed inside the module.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer_pack, self._outer_unpack = outer if outer is not None else (None, None)
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def _exit(self, stage: int) -> None:
        if self._ctx is None:
            return
        self._ctx.__exit__(None, None, None)
        self._ctx = None
        self.per_forward[stage] = max(self.per_forward[stage], self.current - self._start)

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if t.device.type == "meta" or key in self._params:
            return t
        with self._lock:
            entry = self._live.setdefault(key, [t.untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
        held = _Held(self._outer_pack(t) if self._outer_pack is not None else t, self._outer_unpack)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held):
        if not isinstance(held, _Held):
            return held
        return held.unpack(held.t) if held.unpack is not None else held.t

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live[key]
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self._live[key]
