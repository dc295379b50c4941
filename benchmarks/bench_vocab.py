"""Vocabulary parallelism (zbpipe.VocabParallelOutput) against its peer, the best split without
it: plan_partition's plan with the LM head on one rank (PartitionPlan.head_on_one_rank), on the
same schedule family, measured in the same run (issue 42's goals; docs/benchmarks.md).

    PYTHONPATH=. python benchmarks/bench_vocab.py                          # every part
    PYTHONPATH=. python benchmarks/bench_vocab.py --part real --vocab 131072 32768 --steps 5
    PYTHONPATH=. python benchmarks/bench_vocab.py --part emulated --pp 4 8
    PYTHONPATH=. python benchmarks/bench_vocab.py --part trainer
    PYTHONPATH=. python benchmarks/bench_vocab.py --part placement

Parts:

placement the simulator alone: each schedule compiled with vocab_parallel at pp 2, 4, 8 (8 layers
          per rank of f = i = w = 1, 4pp microbatches, a head of 4.9 or 24 layers split 2:1 into S
          and T per rank), its step over the base program's step plus each rank's S and T work
          (1.0: the passes fill no idle time, they add exactly their work); and compile's time
          at pp=8, 32 microbatches.

real      pp=2 Gloo ranks, one per core (sched_setaffinity) and one torch thread each, real
          compute: a Llama-shaped model (RMSNorm, causal attention, SwiGLU; d=512, 8 layers,
          8 heads, sequence 128, one sequence per microbatch, 4 microbatches) at each --vocab.
          Every rank runs plan_partition(..., vocab_parallel=True, schedules=[--schedule])
          (measuring every unit, and the head's S and T on its largest shard), which gives the
          split with the head split over the ranks and the best split with it on one rank (the
          peer). Both run round-robin, one step each per round after a warm-up; a step's time
          is the slowest rank's between barriers; the median over --steps rounds. Goals:
          vocab / peer <= 0.75 at 128k, <= 0.97 at 32k. A third configuration, "vocab+embed",
          runs the same split with the input embedding split too (VocabParallelEmbedding:
          stage 0 without tok_embeddings, every rank its rows). Memory: the plans' peak bytes
          per rank (predicted: the simulator's activation peak under the measured per-unit
          bytes, plus parameters, gradients and Adam's two states), largest over mean; for
          vocab+embed the vocab plan's with the embedding's static bytes (4 copies of V x d
          fp32) moved from stage 0's rank to every rank by its rows; and each rank's measured
          resident set (ru_maxrss) after the rounds, for all three configurations together.
          Goal <= 1.15 at 128k.
emulated  pp=4 and pp=8 Gloo ranks, EmulatedBlock units (zbpipe/bench/emulated.py: sleeps that
          leave the CPU alone): an embedding (0.1 layer), 4 layers per rank of F = I = W =
          --layer-ms, and a head of 4.9 (32k) or 24 (128k) layers (the issue's Llama at d=512).
          The peer is the core's search (zbpipe.partition.search_split, plan_partition without its
          measuring) with the head a unit; the vocabulary-parallel split is the same search
          with every rank doing S = 2H / pp and T = H / pp (H = the head's F = I = W), a
          VocabParallelOutput of a 4-row-per-rank head sleeping those times. Both plans and
          their simulations use the hop and all-reduce latencies measured in the same world
          (medians of 30). Both run round-robin as above; printed with their simulations.
          Goal: realized and simulated order the two alike.
memory    each of the three configurations of `real` (peer, vocab, vocab+embed) alone in fresh pp=2
          processes (the splits planned once, in a world of their own): the peak resident set
          per rank over --steps training steps with Adam, less the process's peak before the
          model was built; largest over mean. Goal <= 1.15 at 128k.
trainer   `zbpipe train --vocab 32000 --partition auto` with and without --vocab-parallel
          (--schedule zbv, pp=2): the trainer's own tokens/s. Goal: vocab-parallel within 5% of
          the plan without it (its step at most 1.05x).

The machine is shared (other jobs on its 2 cores): the real part's times drift with them; the
emulated part's sleeps are steady (read its ratios, and the realized against the simulated).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zbpipe
from zbpipe.bench.emulated import EmulatedBlock
from zbpipe.partition import UnitCost, candidate_programs, search_split
from zbpipe.launch import run_local

MIB = 1024.0 ** 2


# ---- a Llama-shaped model -------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(nn.Module):
    """A Llama decoder layer: pre-norm causal attention and a SwiGLU MLP (no biases)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        hidden = 256 * math.ceil(8 * d / 3 / 256)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaShaped(nn.Module):
    """Embedding, layers, final norm, head; the forward skips what a stage lacks."""

    def __init__(self, vocab: int, d: int, n_layers: int, heads: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        x = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers if self.layers is not None else []:
            x = layer(x)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


# ---- shared: run configurations round-robin ----------------------------------------------------

def _slowest(wall: float) -> float:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, wall)
    return max(every)


def _rounds(configs: dict, steps: int) -> dict[str, float]:
    """Median slowest-rank step of each configuration (name -> (schedule, step args, target,
    params)), run round-robin after one warm-up step each; gradients dropped between steps."""
    walls: dict[str, list[float]] = {name: [] for name in configs}
    for k in range(steps + 1):
        for name, (sched, args, target, params) in configs.items():
            for p in params:
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            sched.step(*args, target=target)
            wall = _slowest(time.perf_counter() - start)
            if k > 0:
                walls[name].append(wall)
    return {name: statistics.median(w) for name, w in walls.items()}


def _stages(modules, program, rank):
    mine = [s for s, r in enumerate(program.stage_to_rank) if r == rank]
    return [zbpipe.PipelineStage(modules[s], s, program.num_stages, "cpu") for s in mine], mine


# ---- real compute ------------------------------------------------------------------------------

D, LAYERS, HEADS, SEQ, MB, M = 512, 8, 8, 128, 1, 4


def _real_rank(rank, size, vocab, schedule, steps):
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(vocab, (MB * M, SEQ), generator=g) for _ in range(2))

    def build():
        torch.manual_seed(0)
        return LlamaShaped(vocab, D, LAYERS, HEADS)

    plan = zbpipe.plan_partition(build(), (x[:MB],), pp=size, microbatches=M, loss_fn=lm_loss, mb_target=y[:MB],
                                 schedules=[schedule], measure_steps=2, vocab_parallel=True)
    one = plan.head_on_one_rank
    peer_model = build()
    peer_prog = one.program()
    peer_stages, peer_mine = _stages(zbpipe.split_by_fqn(peer_model, one.module_fqns_per_stage), peer_prog, rank)
    peer = zbpipe.PipelineSchedule.from_program(peer_stages, peer_prog, lm_loss)
    split_model = build()
    head = split_model.output
    split_model.output = None
    split_prog = plan.program()
    split_stages, split_mine = _stages(zbpipe.split_by_fqn(split_model, plan.module_fqns_per_stage), split_prog, rank)
    out = zbpipe.VocabParallelOutput(head)
    split = zbpipe.PipelineSchedule.from_program(split_stages, split_prog, output=out)
    # The same split with the input embedding split over the ranks too.
    embed_model = build()
    embed_head, embed_table = embed_model.output, embed_model.tok_embeddings
    embed_model.output = embed_model.tok_embeddings = None
    fqns = [[n for n in names if n != "tok_embeddings"] for names in plan.module_fqns_per_stage]
    embed_stages, _ = _stages(zbpipe.split_by_fqn(embed_model, fqns), split_prog, rank)
    embed_out, embed_in = zbpipe.VocabParallelOutput(embed_head), zbpipe.VocabParallelEmbedding(embed_table)
    del embed_head, embed_table
    embed_prog = zbpipe.compile(plan.schedule, size, M, plan.num_stages // size, **plan.compile_options(),
                                vocab_embedding=True)
    embed = zbpipe.PipelineSchedule.from_program(embed_stages, embed_prog, output=embed_out, input_embedding=embed_in)
    table_bytes = 4 * vocab * D * 4  # the embedding's weight, gradient and Adam's two states, fp32
    root = split_prog.stage_to_rank[0]
    embed_peak = [p - (table_bytes if r == root else 0) + table_bytes * (hi - lo) / vocab
                  for r, (p, (lo, hi)) in enumerate(zip(plan.peak_bytes, [(q * vocab // size, (q + 1) * vocab // size)
                                                                           for q in range(size)]))]
    configs = {  # inputs on the first stage's rank; targets on the last's, or (vocab) on every rank
        "peer": (peer, (x,) if 0 in peer_mine else (), y if peer_prog.num_stages - 1 in peer_mine else None,
                 list(peer_model.parameters())),
        "vocab": (split, (x,) if 0 in split_mine else (), y, list(split_model.parameters()) + list(out.parameters())),
        # the token ids on every rank: each looks up its rows
        "vocab+embed": (embed, (x,), y, list(embed_model.parameters()) + list(embed_out.parameters())
                        + list(embed_in.parameters())),
    }
    times = _rounds(configs, steps)
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    units = lambda p: [hi - lo for lo, hi in zip(p.bounds, p.bounds[1:])]  # noqa: E731
    return dict(times=times, peer_predicted=one.predicted_step_s, vocab_predicted=plan.predicted_step_s,
                peer_peak=list(one.peak_bytes), vocab_peak=list(plan.peak_bytes), embed_peak=embed_peak, rss=rss,
                peer_units=units(one),
                vocab_units=units(plan), s_ms=[v * 1e3 for v in plan.vocab["s"]], t_ms=[v * 1e3 for v in plan.vocab["t"]],
                head=next(u for u in one.units if u.fqn == "output"), layer=one.units[1])


def real(vocabs, schedule, steps):
    print(f"real compute, pp=2 (one rank per core, one thread each), Llama-shaped d={D}, {LAYERS} layers, "
          f"sequence {SEQ}, {M} microbatches of {MB}; schedule family {schedule}; median of {steps} rounds")
    rows = []
    for vocab in vocabs:
        every = run_local(_real_rank_call, 2, (vocab, schedule, steps), timeout_s=3600)
        res = every[0]
        t = res["times"]
        head, layer = res["head"], res["layer"]
        ratio = t["vocab"] / t["peer"]
        goal = 0.75 if vocab >= 100_000 else 0.97
        peak = lambda v: max(v) / (sum(v) / len(v))  # noqa: E731
        rows.append((vocab, ratio, goal, res))
        print(f"vocab {vocab}: head F+I+W {(head.f + head.i + head.w) * 1e3:.0f} ms = "
              f"{(head.f + head.i + head.w) / (layer.f + layer.i + layer.w):.1f} layers; S {res['s_ms'][0]:.0f} ms, "
              f"T {res['t_ms'][0]:.0f} ms per rank")
        print(f"  peer (head on one rank, units per stage {res['peer_units']}): {t['peer'] * 1e3:.0f} ms "
              f"(predicted {res['peer_predicted'] * 1e3:.0f}); vocab-parallel (units {res['vocab_units']}): "
              f"{t['vocab'] * 1e3:.0f} ms (predicted {res['vocab_predicted'] * 1e3:.0f})")
        print(f"  step vocab / peer: {ratio:.3f} measured, {res['vocab_predicted'] / res['peer_predicted']:.3f} "
              f"predicted (goal <= {goal}: {'met' if ratio <= goal else 'NOT met'})")
        print(f"  peak MiB per rank (predicted): peer {[round(p / MIB) for p in res['peer_peak']]} (largest / mean "
              f"{peak(res['peer_peak']):.2f}), vocab {[round(p / MIB) for p in res['vocab_peak']]} (largest / mean "
              f"{peak(res['vocab_peak']):.2f}; goal at 128k <= 1.15)")
        print(f"  vocab+embed (the input embedding split too): {t['vocab+embed'] * 1e3:.0f} ms, over peer "
              f"{t['vocab+embed'] / t['peer']:.3f}, over vocab {t['vocab+embed'] / t['vocab']:.3f}; peak MiB per rank "
              f"(predicted) {[round(p / MIB) for p in res['embed_peak']]} (largest / mean {peak(res['embed_peak']):.2f}; "
              f"goal at 128k <= 1.15)")
        print(f"  measured max RSS per rank (all three configurations built): "
              f"{[round(r['rss'] / MIB) for r in every]} MiB")
    return rows


def _real_rank_call(rank, size, vocab, schedule, steps):
    return _real_rank(rank, size, vocab, schedule, steps)


# ---- memory, measured: each configuration alone in fresh processes ------------------------------

def _plan_rank(rank, size, vocab, schedule):
    """plan_partition's two splits (head split, head on one rank) as plain data."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(vocab, (MB * M, SEQ), generator=g) for _ in range(2))
    torch.manual_seed(0)
    plan = zbpipe.plan_partition(LlamaShaped(vocab, D, LAYERS, HEADS), (x[:MB],), pp=size, microbatches=M,
                                 loss_fn=lm_loss, mb_target=y[:MB], schedules=[schedule], measure_steps=2,
                                 vocab_parallel=True)
    plain = lambda p: (p.schedule, p.num_stages, p.module_fqns_per_stage, p.compile_options())  # noqa: E731
    return plain(plan), plain(plan.head_on_one_rank)


def _memory_rank(rank, size, vocab, config, split, peer, steps):
    """One configuration alone: its peak resident set over `steps` training steps with Adam (the
    parameters, their gradients and Adam's two states, and the step's activations), less the
    process's peak before the model was built."""
    import resource

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(vocab, (MB * M, SEQ), generator=g) for _ in range(2))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    torch.manual_seed(0)
    model = LlamaShaped(vocab, D, LAYERS, HEADS)
    schedule, num_stages, fqns, options = peer if config == "peer" else split
    extra, kwargs = [], {}
    if config != "peer":
        kwargs["output"] = zbpipe.VocabParallelOutput(model.output)
        model.output = None
        extra += list(kwargs["output"].parameters())
    if config == "vocab+embed":
        kwargs["input_embedding"] = zbpipe.VocabParallelEmbedding(model.tok_embeddings)
        model.tok_embeddings = None
        fqns = [[n for n in names if n != "tok_embeddings"] for names in fqns]
        extra += list(kwargs["input_embedding"].parameters())
        options = dict(options, vocab_embedding=True)
    program = zbpipe.compile(schedule, size, M, num_stages // size, **options)
    stages, mine = _stages(zbpipe.split_by_fqn(model, fqns), program, rank)
    sched = zbpipe.PipelineSchedule.from_program(stages, program, None if kwargs else lm_loss, **kwargs)
    params = [p for st in stages for p in st.submod.parameters()] + extra
    del model
    opt = torch.optim.Adam(params)
    first = 0 in mine or config == "vocab+embed"
    target = y if (config != "peer" or program.num_stages - 1 in mine) else None
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        sched.step(*((x,) if first else ()), target=target)
        opt.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0 - before


def memory(vocabs, schedule, steps):
    print(f"memory, measured: pp=2, Llama-shaped d={D}, {LAYERS} layers; each configuration alone in fresh "
          f"processes, {steps} training steps with Adam; peak resident set per rank less the process's before the "
          f"model (parameters, gradients, Adam's states, activations, allocator slack)")
    for vocab in vocabs:
        split, peer = run_local(_plan_rank, 2, (vocab, schedule), timeout_s=3600)[0]
        row = {}
        for config in ("peer", "vocab", "vocab+embed"):
            row[config] = run_local(_memory_rank, 2, (vocab, config, split, peer, steps), timeout_s=3600)
        line = ", ".join(f"{c} {[round(b / MIB) for b in v]} MiB (largest / mean {max(v) / (sum(v) / len(v)):.2f})"
                         for c, v in row.items())
        print(f"vocab {vocab}: {line}; goal at 128k <= 1.15")


# ---- emulated ----------------------------------------------------------------------------------

WIDTH = 8


def _units(pp: int, layer_ms: float, head_layers: float, with_head: bool) -> list[UnitCost]:
    s = layer_ms * 1e-3
    out = [UnitCost("embed", 0.1 * s, 0.0, 0.1 * s, 0.1 * s, 1e3, 1e3, 1e3, 4e3)]
    out += [UnitCost(f"layers.{k}", s, s, s, 2 * s, 1e3, 5e2, 1e3, 4e3) for k in range(4 * pp)]
    if with_head:
        h = head_layers * s
        out.append(UnitCost("head", h, h, h, 2 * h, 1e3, 5e2, 1e3, 4e3))
    return out


def _sum_loss(out, target):
    return (out * target).sum()


def _emulated_module(units: list[UnitCost]) -> nn.Sequential:
    return nn.Sequential(*(EmulatedBlock(WIDTH, u.f * 1e3, u.i * 1e3, u.w * 1e3) for u in units))


def _latencies(reps: int = 30) -> tuple[float, float]:
    """(a small message's one-way latency, a small all-reduce's), medians over `reps`, seconds:
    the simulations' comm and collective."""
    t = torch.zeros(8)
    rank, size = dist.get_rank(), dist.get_world_size()
    hops, reduces = [], []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        hops.append((time.perf_counter() - start) / 2)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        reduces.append(time.perf_counter() - start)
    every = [None] * size
    dist.all_gather_object(every, (statistics.median(hops), statistics.median(reduces)))
    return every[0][0], max(r for _, r in every)


def _emulated_rank(rank, size, schedule, layer_ms, head_layers, steps):
    m = 2 * size
    comm, collective = _latencies()
    programs, skipped = candidate_programs([schedule], size, m, 4 * size + 2)
    peer_plan = search_split(_units(size, layer_ms, head_layers, True), programs, skipped, size, m, None, comm, 20_000)
    h = head_layers * layer_ms * 1e-3
    vocab = dict(s=[2 * h / size] * size, t=[h / size] * size, mem_s=[0.0] * size, static_bytes=[0.0] * size,
                 collective=collective)
    split_plan = search_split(_units(size, layer_ms, head_layers, False), programs, skipped, size, m, None, comm,
                              20_000, vocab)
    split_plan.head = "head"
    x = torch.zeros(2 * m, WIDTH)
    configs, predicted = {}, {}
    for name, plan in (("peer", peer_plan), ("vocab", split_plan)):
        units = plan.units
        modules = [_emulated_module(units[lo:hi]) for lo, hi in zip(plan.bounds, plan.bounds[1:])]
        program = plan.program()
        stages, mine = _stages(modules, program, rank)
        params = [p for mod in modules for p in mod.parameters()]
        if name == "peer":
            sched = zbpipe.PipelineSchedule.from_program(stages, program, _sum_loss)
            target = torch.zeros(2 * m, WIDTH) if program.num_stages - 1 in mine else None
        else:
            out = zbpipe.VocabParallelOutput(nn.Linear(WIDTH, 4 * size))
            out._emulate_ms = (vocab["s"][0] * 1e3, vocab["t"][0] * 1e3)
            sched = zbpipe.PipelineSchedule.from_program(stages, program, output=out)
            target = torch.zeros(2 * m, dtype=torch.long)
            params += list(out.parameters())
        configs[name] = (sched, (x,) if 0 in mine else (), target, params)
        predicted[name] = plan.predicted_step_s
    return _rounds(configs, steps), predicted, (comm, collective)


def emulated(pps, schedule, layer_ms, steps):
    print(f"emulated LM stages (sleeps), {schedule} family, 4 layers per rank of F = I = W = {layer_ms} ms, "
          f"2pp microbatches; median of {steps} rounds")
    rows = []
    for pp in pps:
        for label, head_layers in (("32k", 4.9), ("128k", 24.0)):
            times, predicted, (comm, collective) = run_local(_emulated_rank, pp, (schedule, layer_ms, head_layers,
                                                                               steps), timeout_s=3600)[0]
            real_ratio, sim_ratio = times["vocab"] / times["peer"], predicted["vocab"] / predicted["peer"]
            same = (real_ratio < 1) == (sim_ratio < 1)
            rows.append((pp, label, real_ratio, sim_ratio, same))
            print(f"pp={pp} head {label} ({head_layers} layers; measured hop {comm * 1e3:.2f} ms, all-reduce "
                  f"{collective * 1e3:.2f} ms, simulated with them): peer {times['peer'] * 1e3:.0f} ms (simulated "
                  f"{predicted['peer'] * 1e3:.0f}, realized / simulated {times['peer'] / predicted['peer']:.2f}); "
                  f"vocab {times['vocab'] * 1e3:.0f} ms (simulated {predicted['vocab'] * 1e3:.0f}, "
                  f"{times['vocab'] / predicted['vocab']:.2f}); vocab / peer {real_ratio:.3f} realized, "
                  f"{sim_ratio:.3f} simulated: {'same order' if same else 'ORDER DIFFERS'}")
    return rows


# ---- placement (simulation only) ---------------------------------------------------------------

PLACED = ["gpipe", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b", "interleaved_zb", "looped_bfs", "zbv", "dualpipev",
          "v_half", "v_min", "zb_auto"]


def placement():
    """How much the placed passes add over the schedule without a head (simulated): the step
    against the base program's step plus each rank's S and T work; and compile's time."""
    print("placement (simulated): 8 layers per rank of f = i = w = 1, 4pp microbatches, head of H layers split 2:1 "
          "into S and T per rank; step / (base step + 4pp (S + T))")
    print(f"{'schedule':<17}" + "".join(f"{f'pp={pp} H={h}':>14}" for pp in (2, 4, 8) for h in (4.9, 24)) +
          f"{'compile ms pp=8':>17}")
    for name in PLACED:
        cells = []
        for pp in (2, 4, 8):
            m = 4 * pp
            base = zbpipe.compile(name, pp, m)
            c = 8 * pp / base.num_stages
            base_step = zbpipe.simulate(base, c, c, c, 0.05).makespan
            for h in (4.9, 24.0):
                sv, tv = 2 * h / pp, h / pp
                prog = zbpipe.compile(name, pp, m, vocab_parallel=True, f=c, b=c, w=c, comm=0.05, s=sv, t=tv,
                                      collective=0.1)
                step = zbpipe.simulate(prog, c, c, c, 0.05, s=sv, t=tv, collective=0.1).makespan
                cells.append(step / (base_step + m * (sv + tv)))
        start = time.perf_counter()
        zbpipe.compile(name, 8, 32, vocab_parallel=True)
        took = (time.perf_counter() - start) * 1e3
        print(f"{name:<17}" + "".join(f"{v:14.3f}" for v in cells) + f"{took:17.1f}")


# ---- the toy trainer ---------------------------------------------------------------------------

def trainer(steps: int):
    print(f"zbpipe train --vocab 32000 --partition auto --schedule zbv --pp 2 --steps {steps}: tokens/s per device")
    result = {}
    for flag in ([], ["--vocab-parallel"]):
        cmd = [sys.executable, "-m", "zbpipe", "train", "--pp", "2", "--schedule", "zbv", "--vocab", "32000",
               "--partition", "auto", "--steps", str(steps), "--timeout", "1800", *flag]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "."}).stdout
        m = re.search(r"throughput: (\d+) tokens/s per device .*?, ([\d.]+) ms/step", out)
        match = "MATCH" in out
        result[bool(flag)] = (float(m.group(2)), int(m.group(1))) if m else None
        print(f"  {'vocab-parallel' if flag else 'best plan without it'}: "
              + (f"{m.group(2)} ms/step, {m.group(1)} tokens/s per device" if m else "no throughput line")
              + f"; loss vs one process: {'MATCH' if match else 'MISMATCH'}")
    if result[False] and result[True]:
        ratio = result[True][0] / result[False][0]
        print(f"  vocab-parallel step / best plan's: {ratio:.3f} (goal <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("all", "placement", "real", "memory", "emulated", "trainer"), default="all")
    p.add_argument("--vocab", type=int, nargs="+", default=[131072, 32768])
    p.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--schedule", default="zbv")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layer-ms", type=float, default=2.0)
    p.add_argument("--trainer-steps", type=int, default=20)
    a = p.parse_args()
    print(f"bench_vocab: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}, zbpipe {zbpipe.__version__}")
    if a.part in ("all", "placement"):
        placement()
    if a.part in ("all", "real"):
        real(a.vocab, a.schedule, a.steps)
    if a.part in ("all", "memory"):
        memory(a.vocab, a.schedule, a.steps)
    if a.part in ("all", "emulated"):
        emulated(a.pp, a.schedule, a.layer_ms, a.steps)
    if a.part in ("all", "trainer"):
        trainer(a.trainer_steps)


if __name__ == "__main__":
    main()
