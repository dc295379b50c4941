"""zbpipe.plan_partition against the even split and against brute force, measured in one run.

    PYTHONPATH=. python benchmarks/bench_partition.py                        # planning time + emulated
    PYTHONPATH=. python benchmarks/bench_partition.py --model llama          # needs transformers
    PYTHONPATH=. python benchmarks/bench_partition.py --model all --steps 7

Three parts:

planning  The search alone (zbpipe.partition.search_split: compile every default candidate schedule,
          then the core's search) for 80 units shaped like an LM (embedding, 78 layers, a head
          costing 4 layers) at pp=16, 32 microbatches; median of 3. Goal < 1 s.
emulated  pp=4 Gloo ranks (spawned, one thread each), 16 microbatches, a model of EmulatedBlock
          units (zbpipe/bench/emulated.py: F, I, W of fixed milliseconds, sleeps that leave the
          CPU alone): an embedding (0.1 layer), 16 layers, a head costing 4 layers. Every rank
          plans (measuring the units), then three configurations run round-robin, one step
          each per round after a warm-up: the plan, the even split on the plan's schedule, and
          the best split x schedule found by enumerating every contiguous split of every
          default candidate and simulating it (_C.score_split per split). A step's time is
          the slowest rank's, between barriers; the median over --steps rounds. Goals: plan <=
          0.80x even, plan within 3% of brute force. Memory: one probing step of the plan
          (measure_memory) gives each stage's mem_f / mem_w as the runtime measures them; the
          plan's schedule simulated with them gives each rank's activation peak, to which the
          static bytes are added: goal within 10% of the plan's peak_bytes.
llama     pp=2, a transformers LlamaForCausalLM (32k vocab, d=256, 12 layers, GQA 4/2 heads,
          sequence 64, 4 microbatches of 1 sequence), its modules run by a forward that skips
          removed units (the embedding, decoder layers, norm and lm_head of the HF model, its
          rotary embedding on every stage). Plan against even split as above (goal: plan
          faster), and the loss and every gradient of each pipelined step against
          LlamaForCausalLM run in one process.

The machine is shared (other jobs run on its 2 cores): times drift; the emulated model's
sleeps are steadier than the CPU-bound Llama's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import zbpipe
from zbpipe import _C
from zbpipe.bench.emulated import EmulatedBlock
from zbpipe.partition import DEFAULT_SCHEDULES, UnitCost, candidate_programs, search_split, unit_profile
from zbpipe.launch import run_local
from zbpipe.train.metrics import SavedActivationMeter

# ---- planning time ----------------------------------------------------------------------------


def planning_time(reps: int = 3) -> float:
    units = [UnitCost("embed", 0.1e-3, 0.1e-3, 0.1e-3, 0.2e-3, 1e6, 1e6, 1e8, 4e8)]
    units += [UnitCost(f"layers.{k}", 1e-3, 1e-3, 1e-3, 2e-3, 8e6, 4e6, 5e7, 2e8) for k in range(78)]
    units += [UnitCost("head", 4e-3, 4e-3, 4e-3, 8e-3, 3e7, 4e6, 1e8, 4e8)]
    took = []
    for _ in range(reps):
        start = time.perf_counter()
        programs, skipped = candidate_programs(None, 16, 32, len(units))
        plan = search_split(units, programs, skipped, 16, 32, None, 0.0, 50_000)
        took.append(time.perf_counter() - start)
    print(f"planning: 80 units, pp=16, 32 microbatches, {len(programs)} candidate schedules "
          f"({plan.simulated} simulations, {'exact' if plan.exact else 'local search'}): "
          f"median {statistics.median(took):.3f} s of {reps} (goal < 1 s); chosen {plan.schedule}, "
          f"predicted {plan.predicted_step_s * 1e3:.1f} ms vs even {plan.even_step_s * 1e3:.1f} ms")
    return statistics.median(took)


# ---- running splits ---------------------------------------------------------------------------


def _pipeline(model, fqns_per_stage, program, loss_fn, rank):
    modules = zbpipe.split_by_fqn(model, fqns_per_stage)
    mine = [s for s, r in enumerate(program.stage_to_rank) if r == rank]
    stages = [zbpipe.PipelineStage(modules[s], s, program.num_stages, torch.device("cpu")) for s in mine]
    return zbpipe.PipelineSchedule.from_program(stages, program, loss_fn), {s: modules[s] for s in mine}


def _slowest(wall: float) -> float:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, wall)
    return max(every)


def _timed_rounds(configs: dict, batch: tuple, steps: int) -> dict[str, float]:
    """Median slowest-rank step per configuration, run round-robin after one warm-up step each."""
    x, y = batch
    walls: dict[str, list[float]] = {name: [] for name in configs}
    for k in range(steps + 1):
        for name, (sched, _) in configs.items():
            dist.barrier()
            start = time.perf_counter()
            sched.step(x, target=y)
            wall = _slowest(time.perf_counter() - start)
            if k > 0:
                walls[name].append(wall)
    return {name: statistics.median(w) for name, w in walls.items()}


def _runtime_peaks(plan, model, loss_fn, rank, batch) -> tuple[list[float], list[float], list[float]]:
    """(activation peak per rank, static bytes per rank, held peak per rank) from one probing
    step of the plan: the stages' mem_f / mem_w as the runtime's memory probe measures them,
    simulated on the plan's program with the plan's times; and the bytes autograd held at once
    in the stages' module forwards (zbpipe.train.metrics.SavedActivationMeter: a pack hook
    per saved tensor, released when autograd frees it; the loss's saved tensors not included)."""
    program = plan.program()
    sched, modules = _pipeline(model, plan.module_fqns_per_stage, program, loss_fn, rank)
    meter = SavedActivationMeter(modules)
    sched.measure_memory = True
    sched.step(batch[0], target=batch[1])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sched.memory_profile(), meter.peak))
    held = [float(p) for _, p in every]
    measured = {s: v for m, _ in every for s, v in m.items()}
    costs = plan.stage_costs()
    costs["mem_f"] = [max(float(measured[s]["mem_f"]), 1.0) for s in range(program.num_stages)]
    costs["mem_w"] = [min(float(measured[s]["mem_w"]), costs["mem_f"][s]) for s in range(program.num_stages)]
    act = list(zbpipe.simulate(program, **costs).peak_memory)
    static = [0.0] * program.pp
    for s, (lo, hi) in enumerate(zip(plan.bounds, plan.bounds[1:])):
        static[program.stage_to_rank[s]] += sum(u.static_bytes for u in plan.units[lo:hi])
    return act, static, held


def _brute_force(plan, pp, microbatches):
    """The least simulated step over every contiguous split of every default candidate."""
    import itertools

    profile = unit_profile(plan.units)
    programs, _ = candidate_programs(DEFAULT_SCHEDULES, pp, microbatches, len(plan.units))
    best = (float("inf"), None, None)
    count = 0
    for prog in programs:
        for cuts in itertools.combinations(range(1, len(plan.units)), prog.num_stages - 1):
            bounds = [0, *cuts, len(plan.units)]
            score = _C.score_split(prog, profile, bounds)
            count += 1
            if score.makespan < best[0]:
                best = (score.makespan, prog.schedule, bounds)
    return best, count


def _report_memory(plan, act, static, held):
    mib = 1024.0 ** 2
    planned_act = [p - s for p, s in zip(plan.peak_bytes, static)]
    total = [a + s for a, s in zip(act, static)]
    worst = max(abs(p - t) / t for p, t in zip(plan.peak_bytes, total))
    print("memory per rank (MiB): plan peak " + ", ".join(f"{p / mib:.2f}" for p in plan.peak_bytes) +
          "; runtime-measured " + ", ".join(f"{t / mib:.2f}" for t in total) +
          f" (activations planned {', '.join(f'{a / mib:.2f}' for a in planned_act)}, measured "
          f"{', '.join(f'{a / mib:.2f}' for a in act)}); worst gap {worst * 100:.1f}% (goal <= 10%)")
    print("activations held at once in the module forwards (SavedActivationMeter, loss excluded): " +
          ", ".join(f"{h / mib:.2f}" for h in held) + " MiB per rank")


# ---- emulated ---------------------------------------------------------------------------------

LAYER_MS, HEAD_LAYERS, N_LAYERS, WIDTH, SAVED = 2.0, 4, 16, 8, 1 << 16


class EmulatedLm(nn.Module):
    """embedding, layers, head of EmulatedBlocks; the forward skips what a stage lacks."""

    def __init__(self):
        super().__init__()
        e, h = 0.1 * LAYER_MS, HEAD_LAYERS * LAYER_MS
        self.embed = EmulatedBlock(WIDTH, e, e, e, SAVED // 8)
        self.layers = nn.ModuleList(EmulatedBlock(WIDTH, LAYER_MS, LAYER_MS, LAYER_MS, SAVED) for _ in range(N_LAYERS))
        self.head = EmulatedBlock(WIDTH, h, h, h, SAVED * HEAD_LAYERS)

    def forward(self, x):
        for unit in (self.embed, *(self.layers if self.layers is not None else []), self.head):
            if unit is not None:
                x = unit(x)
        return x


def _sum_loss(out, target):
    return (out * target).sum()


def _emulated_rank(rank, size, microbatches, steps):
    torch.manual_seed(0)
    model = EmulatedLm()
    mb = 2
    x, y = torch.randn(mb * microbatches, WIDTH), torch.randn(mb * microbatches, WIDTH)
    start = time.perf_counter()
    plan = zbpipe.plan_partition(model, (x[:mb],), pp=size, microbatches=microbatches, loss_fn=_sum_loss,
                                 mb_target=y[:mb])
    plan_s = time.perf_counter() - start
    brute = [None]
    if rank == 0:
        t0 = time.perf_counter()
        (step, schedule, bounds), count = _brute_force(plan, size, microbatches)
        brute = [(step, schedule, bounds, count, time.perf_counter() - t0)]
    dist.broadcast_object_list(brute, src=0)
    b_step, b_schedule, b_bounds, b_count, b_took = brute[0]
    b_program = zbpipe.compile(b_schedule, size, microbatches, (len(b_bounds) - 1) // size)
    program = plan.program()
    configs = {"plan": _pipeline(model, plan.module_fqns_per_stage, program, _sum_loss, rank),
               "even": _pipeline(model, plan.even_module_fqns_per_stage, program, _sum_loss, rank)}
    b_fqns = [[n for u in plan.units[lo:hi] for n in u.fqns] for lo, hi in zip(b_bounds, b_bounds[1:])]
    if b_fqns != plan.module_fqns_per_stage or b_schedule != plan.schedule:
        configs["brute"] = _pipeline(model, b_fqns, b_program, _sum_loss, rank)
    measured = _timed_rounds(configs, (x, y), steps)
    act, static, held = _runtime_peaks(plan, model, _sum_loss, rank, (x, y))
    return dict(plan=plan, plan_s=plan_s, brute=(b_step, b_schedule, b_bounds, b_count, b_took),
                measured=measured, act=act, static=static, held=held)


def emulated(steps: int) -> dict:
    pp, m = 4, 16
    res = run_local(_emulated_rank, pp, (m, steps), timeout_s=900, pg_timeout_s=600)[0]
    plan, (b_step, b_schedule, b_bounds, b_count, b_took), meas = res["plan"], res["brute"], res["measured"]
    print(plan.table())
    sizes = lambda bounds: [hi - lo for lo, hi in zip(bounds, bounds[1:])]  # noqa: E731
    print(f"\nemulated LM (embedding 0.1 layer, {N_LAYERS} layers of F=I=W={LAYER_MS} ms, head {HEAD_LAYERS} "
          f"layers), pp={pp}, {m} microbatches; planning on each rank took {res['plan_s']:.2f} s")
    print(f"brute force: {b_count} splits x schedules simulated in {b_took:.1f} s; best {b_schedule} units per "
          f"stage {sizes(b_bounds)}, simulated {b_step * 1e3:.1f} ms (plan predicted "
          f"{plan.predicted_step_s * 1e3:.1f} ms, {plan.schedule} {sizes(plan.bounds)})")
    brute_real = meas.get("brute", meas["plan"])
    print(f"{'config':<8} {'measured ms':>11} {'simulated ms':>12}")
    print(f"{'plan':<8} {meas['plan'] * 1e3:11.1f} {plan.predicted_step_s * 1e3:12.1f}")
    print(f"{'even':<8} {meas['even'] * 1e3:11.1f} {plan.even_step_s * 1e3:12.1f}")
    print(f"{'brute':<8} {brute_real * 1e3:11.1f} {b_step * 1e3:12.1f}" +
          ("" if "brute" in meas else "  (the plan's own split and schedule)"))
    print(f"plan / even measured: {meas['plan'] / meas['even']:.3f} (goal <= 0.80); plan / brute-force best: "
          f"measured {meas['plan'] / brute_real:.3f}, plan's simulated over brute force's "
          f"{plan.predicted_step_s / b_step:.4f} (goal <= 1.03)")
    _report_memory(plan, res["act"], res["static"], res["held"])
    return res


# ---- transformers Llama -----------------------------------------------------------------------

VOCAB, D, LAYERS, SEQ = 32000, 256, 12, 64


class PipelinedLlama(nn.Module):
    """A LlamaForCausalLM's modules under a forward that skips what a stage lacks: its
    embed_tokens, decoder layers, norm and lm_head are the HF model's own (shared, not copied),
    its rotary embedding runs on every stage (held outside the module tree: no parameters)."""

    def __init__(self, hf):
        super().__init__()
        self.embed_tokens = hf.model.embed_tokens
        self.layers = hf.model.layers
        self.norm = hf.model.norm
        self.lm_head = hf.lm_head
        self._rotary = [hf.model.rotary_emb]

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        pe = self._rotary[0](x, position_ids=pos)
        for layer in self.layers if self.layers is not None else []:
            x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else x


def build_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=688, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _grad_gap(modules: dict, hf) -> tuple[float, int]:
    """Largest |pipeline grad - one-process grad| over this rank's stages, and how many compared."""
    ref = dict(hf.named_parameters())
    names = {"embed_tokens": "model.embed_tokens", "layers": "model.layers", "norm": "model.norm"}
    gap, count = 0.0, 0
    for mod in modules.values():
        for n, p in mod.named_parameters():
            head = n.split(".")[0]
            q = ref[n.replace(head, names[head], 1) if head in names else n]
            gap = max(gap, (p.grad - q.grad).abs().max().item())
            count += 1
    return gap, count


def _llama_rank(rank, size, microbatches, steps):
    hf = build_llama()
    model = PipelinedLlama(hf)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(VOCAB, (microbatches, SEQ), generator=g)
    y = torch.randint(VOCAB, (microbatches, SEQ), generator=g)
    plan = zbpipe.plan_partition(model, (x[:1],), pp=size, microbatches=microbatches, loss_fn=lm_loss,
                                 mb_target=y[:1])
    program = plan.program()
    configs = {"plan": _pipeline(model, plan.module_fqns_per_stage, program, lm_loss, rank),
               "even": _pipeline(model, plan.even_module_fqns_per_stage, program, lm_loss, rank)}
    # Exactness: one step of each against LlamaForCausalLM in one process.
    ref = build_llama()
    ref_loss = lm_loss(ref(x).logits, y)
    ref_loss.backward()
    checks = {}
    for name, (sched, modules) in configs.items():
        for mod in modules.values():
            mod.zero_grad(set_to_none=True)
        losses: list = []
        sched.step(x, target=y, losses=losses)
        loss = torch.stack(losses).mean().item() if losses else None
        gap, count = _grad_gap(modules, ref)
        checks[name] = (loss, gap, count)
    measured = _timed_rounds(configs, (x, y), steps)
    act, static, held = _runtime_peaks(plan, model, lm_loss, rank, (x, y))
    return dict(plan=plan, measured=measured, checks=checks, ref_loss=ref_loss.item(), act=act, static=static,
                held=held)


def llama(steps: int) -> dict | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("llama: skipped (transformers is not installed)")
        return None
    pp, m = 2, 4
    every = run_local(_llama_rank, pp, (m, steps), timeout_s=1200, pg_timeout_s=900)
    res = every[0]
    plan, meas = res["plan"], res["measured"]
    print(plan.table())
    print(f"\nLlamaForCausalLM (vocab {VOCAB}, d={D}, {LAYERS} layers, seq {SEQ}), pp={pp}, {m} microbatches of 1 "
          f"sequence, one thread per rank")
    print(f"plan ({plan.schedule}) measured {meas['plan'] * 1e3:.1f} ms, even split {meas['even'] * 1e3:.1f} ms: "
          f"{meas['plan'] / meas['even']:.3f}x (goal < 1)")
    for name in ("plan", "even"):
        losses = [r["checks"][name][0] for r in every if r["checks"][name][0] is not None]
        gap = max(r["checks"][name][1] for r in every)
        count = sum(r["checks"][name][2] for r in every)
        print(f"{name}: loss {losses[0]:.6f} vs one process {res['ref_loss']:.6f}; {count} gradients, "
              f"largest difference {gap:.2e}")
    _report_memory(plan, res["act"], res["static"], res["held"])
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("emulated", "llama", "all", "none"), default="emulated")
    p.add_argument("--steps", type=int, default=5, help="timed rounds per configuration")
    args = p.parse_args(argv)
    planning_time()
    if args.model in ("emulated", "all"):
        print()
        emulated(args.steps)
    if args.model in ("llama", "all"):
        print()
        llama(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
