"""Memory follows the program: a rank holds the saved activations of exactly the (stage,
microbatch) pairs its program has live (from F to the pair's last backward action, B or W;
the simulator's peak is the largest such set) and nothing after a step, for every training
schedule at pp=4, checked at the end of every forward in three ways on the same stages: a
counting saved_tensors_hooks pack that keeps the tensor (as save_on_cpu does on CPU: a saved
output then forms a reference cycle with its node, which only releasing the node's saved
tensors breaks); no hooks at all (weak references to the storages autograd saved); and
non-reentrant checkpoint under the counting hook, where a pair holds exactly its input (what
the counting hook sees) from F to its first backward action (B or I), and from I to W
exactly what W needs of the recomputed tensors (weak references to the storages the
recomputation made), nothing of either before or after. With save_on_cpu, a rank's RSS stays
flat over 100 steps of every split (I/W) schedule. Reentrant checkpoint under a split schedule
runs the stage's backward fused (its I does B's work), warning once, naming use_reentrant=False.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from helpers.model_registry import WIDTH, build, data
from helpers.schedule_registry import rank_schedule, training_names

import zbpipe

STEPS = 2  # per mode
MODES = ("hook", "plain", "checkpoint")


class _Holder:  # what the counting pack hook saves: the tensor itself, like save_on_cpu on CPU
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _saved_storages(out: torch.Tensor, skip: set[int]) -> list[StorageWeakRef]:
    """Weak references to the storages the forward's graph saved (its nodes' _saved_*
    tensors), but those in `skip` (parameters, the stage input)."""
    refs, seen, stack = {}, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            val = getattr(node, name)
            for t in val if isinstance(val, (tuple, list)) else (val,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                    refs.setdefault(t.untyped_storage().data_ptr(), StorageWeakRef(t.untyped_storage()))
        stack.extend(fn for fn, _ in node.next_functions)
    return list(refs.values())


class _Recorded(TorchDispatchMode):
    """Weak references to the storages of the op outputs made while active, but those in
    `skip` (the recomputation's own views of its input and of the parameters)."""

    def __init__(self, refs: list, skip: set[int]):
        super().__init__()
        self.refs, self.skip = refs, skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.skip:
                self.refs.append(StorageWeakRef(t.untyped_storage()))
        return out


class LiveCounter:
    """What each (stage, microbatch) pair of one rank's stages still holds, in `mode`, with a
    snapshot of the live pairs at the end of every forward (checkpoint mode: of the pairs
    holding their input, and of those holding recomputed tensors)."""

    def __init__(self, microbatches: int):
        self.m = microbatches
        self.mode = MODES[0]
        self.refs: dict[tuple[int, int], list] = {}
        self.recomputed: dict[tuple[int, int], list] = {}  # checkpoint mode
        self.calls: dict[int, int] = {}
        self.snapshots: list = []

    def _alive(self, r) -> bool:
        return not r.expired() if isinstance(r, StorageWeakRef) else r() is not None

    def _pairs(self, refs: dict) -> frozenset:
        return frozenset(k for k, rs in refs.items() if any(self._alive(r) for r in rs))

    def live_pairs(self) -> frozenset:
        return self._pairs(self.refs)

    def live_tensors(self) -> int:
        return sum(self._alive(r) for d in (self.refs, self.recomputed) for refs in d.values() for r in refs)

    def wrap(self, module: nn.Module, stage: int) -> nn.Module:
        counter = self

        class Counted(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = module

            def forward(self, x):
                if not torch.is_grad_enabled():  # the handshake's shape run
                    return self.inner(x)
                k = counter.calls.get(stage, 0)
                counter.calls[stage] = k + 1
                key = (stage, k % counter.m)  # each stage runs its forwards in microbatch order
                refs = counter.refs[key] = []
                recomputed = counter.recomputed[key] = []
                if counter.mode == "plain":
                    out = self.inner(x)
                    skip = {p.untyped_storage().data_ptr() for p in self.parameters()}
                    refs.extend(_saved_storages(out, skip | {x.untyped_storage().data_ptr()}))
                else:
                    def pack(t):
                        h = _Holder(t)
                        refs.append(weakref.ref(h))
                        return h

                    ran = []

                    def region(t):  # its second call is the recomputation: record what it makes
                        if not ran:
                            ran.append(1)
                            return self.inner(t)
                        skip = {p.untyped_storage().data_ptr() for p in self.parameters()}
                        with _Recorded(recomputed, skip | {t.untyped_storage().data_ptr()}):
                            return self.inner(t)

                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
                        if counter.mode == "checkpoint":
                            out = checkpoint(region, x, use_reentrant=False)
                        else:
                            out = self.inner(x)
                assert refs, f"{counter.mode}: nothing saved for stage {stage}"
                if counter.mode == "checkpoint":
                    counter.snapshots.append((counter.live_pairs(), counter._pairs(counter.recomputed)))
                else:
                    counter.snapshots.append(counter.live_pairs())
                return out

        return Counted()


def _program_live_sets(prog, rank: int) -> tuple[list[frozenset], list[frozenset], list[tuple]]:
    """The rank's live (stage, microbatch) pairs at the end of each of its forwards, in program
    order: a pair is live from its F to its B or W (an OVERLAP_F_B runs F, then B). Also, per
    forward, the pairs its unit's backward half may free while that forward runs (the executor
    runs an OVERLAP_F_B's halves at the same time): those may already be gone; and the live
    pairs split into those between F and their first backward action (B or I) and those
    between I and W. Stage 0's input needs no gradient: its I does nothing and its W the whole
    backward (the recomputation too), so its pairs stay in the first set until W."""
    before_bwd, after_i, out, concurrent, split = set(), set(), [], [], []
    for action in prog.compute_actions(rank):
        parts = [(int(stage), kind, int(mb)) for stage, kind, mb in re.findall(r"(\d+)([FBIW])(\d+)", action)]
        racing = frozenset((st, mb) for st, kind, mb in parts if kind == "B") if len(parts) > 1 else frozenset()
        for stage, kind, mb in parts:
            pair = (stage, mb)
            if kind == "F":
                before_bwd.add(pair)
                out.append(frozenset(before_bwd | after_i))
                concurrent.append(racing)
                split.append((frozenset(before_bwd), frozenset(after_i)))
            elif kind == "I":
                if stage != 0:
                    before_bwd.discard(pair)
                    after_i.add(pair)
            else:
                before_bwd.discard(pair)
                after_i.discard(pair)
    return out, concurrent, split


def _memory(rank, pp, name):
    """STEPS steps per mode; AssertionError naming the first forward whose live pairs differ
    from the program's, or saved tensors alive after a step."""
    m = 2 * pp
    prog = zbpipe.compile(name, pp, m)
    want, racing, split = _program_live_sets(prog, rank)
    assert zbpipe.simulate(prog).peak_activations[rank] == max(map(len, want)), "simulator peak vs program's"
    counter = LiveCounter(m)
    mods = [counter.wrap(mod, s) for s, mod in enumerate(build("mlp", prog.num_stages))]
    sched, mine = rank_schedule(name, mods, rank, pp, m, loss_fn=F.mse_loss, timeout=60)
    for mode in MODES:
        counter.mode = mode
        for k in range(STEPS):
            counter.snapshots = []
            x, y = data("mlp", 2 * m, seed=k + 1)
            sched.step(*((x,) if 0 in mine else ()), target=y if prog.num_stages - 1 in mine else None)
            # Exactly the program's pairs; a pair whose B runs concurrently with this F (the
            # same OVERLAP_F_B) may be freed already, never any other.
            if mode == "checkpoint":
                # Inputs from F to B/I; recomputed tensors from I to W (a concurrent B's
                # recomputation may be under way).
                wrong = [(i, "inputs", sorted(inp), sorted(exp_in), "recomputed", sorted(rec), sorted(exp_rec))
                         for i, ((inp, rec), (exp_in, exp_rec), race) in
                         enumerate(zip(counter.snapshots, split, racing))
                         if not (inp <= exp_in and exp_in - inp <= race and exp_rec <= rec <= exp_rec | race)]
            else:
                wrong = [(i, sorted(got), sorted(exp)) for i, (got, exp, race) in
                         enumerate(zip(counter.snapshots, want, racing)) if not (got <= exp and exp - got <= race)]
            where = f"{name} rank {rank} {mode} step {k + 1}"
            assert len(counter.snapshots) == len(want), f"{where}: {len(counter.snapshots)} forwards, want {len(want)}"
            assert not wrong, f"{where}: live pairs at the end of forward #i (got, want) {wrong[:2]}"
            assert not counter.live_tensors(), f"{where}: {counter.live_tensors()} saved tensors alive after the step"
    return len(mine)


@pytest.mark.parametrize("name", training_names())
def test_saved_activations_follow_the_program(spawn_world, name):
    assert spawn_world(4).run(_memory, name, timeout_s=300) == [len(zbpipe.compile(name, 4, 8).stage_to_rank) // 4] * 4


class Wide(nn.Module):
    """Saved outputs (tanh) whose leak would be visible in RSS: 64 KiB per tensor."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        with torch.autograd.graph.save_on_cpu():
            return torch.tanh(self.b(torch.tanh(self.a(x))))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _rss(rank, pp, name, steps):
    """RSS after step 10 and after the last of `steps` steps."""
    m = 8
    torch.manual_seed(0)
    mods = [Wide() for _ in range(zbpipe.compile(name, pp, m).num_stages)]
    sched, mine = rank_schedule(name, mods, rank, pp, m, loss_fn=F.mse_loss, timeout=60)
    x, y = torch.randn(64 * m, 256), torch.randn(64 * m, 256)
    rss = []
    for k in range(steps):
        sched.step(*((x,) if 0 in mine else ()), target=y if len(mods) - 1 in mine else None)
        if k in (9, steps - 1):
            rss.append(_rss_bytes())
    return rss


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)


def _reentrant(rank, pp):
    """Reentrant checkpoint on a stage with an input gradient (stage 1): its I runs the whole
    backward, said once (the warnings of this rank's step)."""
    group = torch.distributed.new_group(list(range(pp)), backend="gloo")
    stage = zbpipe.PipelineStage(Reentrant(), rank, pp, "cpu", group=group)
    sched = zbpipe.ScheduleZBH1(stage, 2, loss_fn=F.mse_loss, timeout=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step(*((torch.randn(4, 8),) if rank == 0 else ()), target=torch.randn(4, 8) if rank == pp - 1 else None)
    return [str(w.message) for w in caught if "runs its whole backward" in str(w.message)]


SPLIT = ["zb_h1", "zb_h2", "zbv", "v_half", "v_min", "interleaved_zb", "zb_auto", "dualpipev"]


def test_every_split_schedule_is_measured():
    split = [n for n in zbpipe.schedule_names() if any("I" in a for a in zbpipe.compile(n, 2, 8).compute_actions(0))]
    assert sorted(split) == sorted(SPLIT)


@pytest.mark.parametrize("name", SPLIT)
def test_save_on_cpu_rss_is_flat_over_100_steps(spawn_world, name):
    for rank, (at10, at100) in enumerate(spawn_world(2, gloo_devices=2).run(_rss, name, 100, timeout_s=400)):
        # A leak of the closure's saved tensors is about 1 MiB per step here (90 MiB).
        assert at100 - at10 <= 16 << 20, (
            f"{name} rank {rank}: RSS {at10 >> 20} MiB after step 10, {at100 >> 20} MiB after step 100")


def test_reentrant_checkpoint_runs_fused_under_a_split_schedule(spawn_world):
    first, second = spawn_world(2, gloo_devices=2).run(_reentrant, timeout_s=120)
    assert len(second) == 1 and "cannot be split" in second[0] and "use_reentrant=False" in second[0], second
    assert first == []  # stage 0's input needs no gradient: its W runs the backward, as always


class ByteCounter:
    """The live saved bytes of one rank, measured apart from the runtime's probe: per (stage,
    microbatch) pair the storages its forward (and loss) saved, counted once per pair, without
    parameters and the step's data; snapshots of the rank's total at the end of every forward
    (of the loss on the last stage), where the total only grows. `hook`: a counting pack hook
    around the step (the probe chains to it); else weak references to the storages the graph's
    nodes saved."""

    def __init__(self, microbatches: int, last: int, hook: bool):
        self.m, self.last, self.hook, self.skip = microbatches, last, hook, set()
        self.refs: dict[tuple[int, int], dict[int, tuple]] = {}
        self.calls: dict[int, int] = {}
        self.current = None
        self.snapshots: list[int] = []

    def live_bytes(self) -> int:
        return sum(n for refs in self.refs.values() for r, n in refs.values() if not r.expired())

    def record(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.data_ptr() not in self.skip:
            self.refs[self.current].setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))

    def walk(self, out: torch.Tensor, params: set[int]) -> None:
        seen, stack = set(), [out.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for name in dir(node):
                if name.startswith("_saved_"):
                    val = getattr(node, name)
                    for t in val if isinstance(val, (tuple, list)) else (val,):
                        # 0-dim: a Python number autograd wrapped (`* gain`), saved without
                        # any pack hook and no activation
                        if isinstance(t, torch.Tensor) and t.dim() and t.untyped_storage().data_ptr() not in params:
                            self.record(t)
            stack.extend(fn for fn, _ in node.next_functions)

    def pack(self, t):
        self.record(t)
        return _Holder(t)

    def wrap(self, module: nn.Module, stage: int) -> nn.Module:
        counter = self

        class Counted(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = module

            def forward(self, x):
                if not torch.is_grad_enabled():
                    return self.inner(x)
                k = counter.calls.get(stage, 0)
                counter.calls[stage] = k + 1
                counter.current = (stage, k % counter.m)
                counter.refs[counter.current] = {}
                counter.skip |= {p.untyped_storage().data_ptr() for p in self.parameters()}
                if stage == 0:  # a view of the step's batch, not an activation
                    counter.skip.add(x.untyped_storage().data_ptr())
                out = self.inner(x)
                if not counter.hook:
                    counter.walk(out, counter.skip)
                if stage != counter.last:
                    counter.snapshots.append(counter.live_bytes())
                return out

        return Counted()

    def loss(self, out, y):
        self.skip.add(y.untyped_storage().data_ptr())  # a view of the step's targets
        loss = F.mse_loss(out, y)
        if not self.hook:
            self.walk(loss, self.skip)
        self.snapshots.append(self.live_bytes())
        return loss


def _bytes(rank, pp, name):
    """Per mode: (predicted peak bytes of this rank from the gathered memory_profile()s,
    measured peak of live saved bytes, the largest mem_f of this rank's stages)."""
    m = 2 * pp
    prog = zbpipe.compile(name, pp, m)
    last = prog.num_stages - 1
    results = []
    for mode in ("hook", "plain"):
        x, y = data("mlp", 2 * m, seed=1)
        counter = ByteCounter(m, last, mode == "hook")
        mods = [counter.wrap(mod, s) for s, mod in enumerate(build("mlp", prog.num_stages))]
        sched, mine = rank_schedule(name, mods, rank, pp, m, loss_fn=counter.loss, timeout=60, measure_memory=True)
        hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda h: h.t) if mode == "hook"
                 else contextlib.nullcontext())
        with hooks:
            sched.step(*((x,) if 0 in mine else ()), target=y if last in mine else None, return_outputs=False)
        profiles = [None] * pp
        torch.distributed.all_gather_object(profiles, sched.memory_profile())
        per_stage = {s: v for p in profiles for s, v in p.items()}
        mem_f = [float(per_stage[s]["mem_f"]) for s in range(prog.num_stages)]
        mem_w = [float(per_stage[s]["mem_w"]) for s in range(prog.num_stages)]
        predicted = zbpipe.simulate(prog, mem_f=mem_f, mem_w=mem_w).peak_memory[rank]
        with tempfile.TemporaryDirectory() as tmp:  # the profile is in the Chrome trace too
            sched.export_chrome_trace(f"{tmp}/t.json")
            with open(f"{tmp}/t.json") as f:
                counters = {e["name"]: e["args"] for e in json.load(f)["traceEvents"] if e.get("ph") == "C"}
        assert counters == {f"stage {s} saved bytes": v for s, v in sched.memory_profile().items()}, counters
        assert not counter.live_bytes(), f"{name} {mode}: saved bytes alive after the step"
        results.append((mode, predicted, max(counter.snapshots), max(mem_f[s] for s in mine)))
    return results


@pytest.mark.parametrize("name", training_names())
def test_measured_deltas_predict_the_peak_bytes(spawn_world, name):
    """memory_profile() fed to simulate predicts each rank's peak of live saved bytes exactly,
    with and without saved-tensor hooks, with two exceptions the model does not express. On a V
    schedule's turn rank (pp-1), stage pp-1's output is handed to stage pp as its input, which
    stage pp saves, and is kept as stage pp-1's backward root until its I: that storage may
    outlive stage pp's W, so the measured peak may exceed the prediction by one boundary tensor.
    Under DualPipeV's concurrent OVERLAP_F_B halves the backward half may free its pair before
    the forward half's snapshot: there the measured peak may also be below the prediction by at
    most one pair's mem_f."""
    topo = zbpipe.compile(name, 4, 8).stage_to_rank
    pp, v = 4, len(topo) > 4 and topo[4] == 3
    boundary = 2 * WIDTH * 4  # one microbatch (2 samples) of WIDTH float32 crossing a stage boundary
    for rank, results in enumerate(spawn_world(pp).run(_bytes, name, timeout_s=300)):
        for mode, predicted, measured, mem_f in results:
            where = f"{name} rank {rank} {mode}: predicted {predicted} bytes, measured {measured}"
            assert measured > 0, where
            low = predicted - (mem_f if name == "dualpipev" else 0)
            high = predicted + (boundary if v and rank == pp - 1 else 0)
            assert low <= measured <= high, where
