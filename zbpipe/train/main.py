"""`zbpipe train` / `python -m zbpipe.train`: pipelined training of a tiny transformer, checked
against one process.

Spawns `--pp` x `--dp` local ranks (Gloo on 127.0.0.1, or NCCL with --device cuda), or under
torchrun joins its world, one rank per process on any number of nodes (zbpipe/torchrun.py), splits the
model of zbpipe.train.model into pipeline stages, trains it on the synthetic Markov task with
the chosen schedule, and prints step / loss / tokens-per-second / MFU from the rank that holds
the last stage, then torchtitan's throughput figures and every rank's saved activations against
the simulator's prediction (metrics.py). `--checkpoint DIR` saves with DCP at the end and
`--resume` continues from it at any pipeline size (checkpoint.py). With `--dp N`, N pipeline
replicas each train on 1/N of every batch, their stages wrapped in DistributedDataParallel over
the replicas of the same stage (the printed loss is the mean over replicas, the loss of the
whole batch). Then it trains the same model (same seed, same batches, same optimizer) in this
one process and prints both final losses and their difference: pipelining must not change the
math, so they agree to float-reassociation tolerance (exit status 1 if they do not). Under
torchrun, rank 0 runs the one-process reference and prints the comparison, once for the job.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zbpipe
from zbpipe import torchrun
from zbpipe.cli import USAGE_ERROR, CliError, Subcommand
from zbpipe.cli import main as cli_main

from .data import MarkovTask
from ..launch import rank_device, run_local
from . import checkpoint
from .metrics import SavedActivationMeter, flops_per_token, peak_flops
from .model import TinyConfig, build_model, build_stages, lm_loss, stage_io_examples
from .pipeline import LIBRARIES, build_pipeline, local_stages, schedule_class, topology, training_schedules


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default, except where the help text already says it."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `zbpipe train`."""
    p.add_argument("--schedule", default="zbv", choices=sorted(training_schedules()) + ["auto"],
                   help="pipeline schedule")  # auto: ScheduleAuto, one stage per rank (docs/cli.md)
    p.add_argument("--lib", default="zbpipe", choices=LIBRARIES,
                   help="pipeline library: zbpipe, or torch.distributed.pipelining for comparison")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas of the pipeline (world = pp x dp), DDP-wrapped stages")
    p.add_argument("--stages-per-rank", type=int, default=None,
                   help="loop-style multi-stage schedules only (default: the schedule's own)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (whole batch)")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--seed", type=int, default=0, help="model, data and init seed")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (Gloo) or cuda (NCCL)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: max(4, stages))")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"), help="optimizer")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (SGD uses 10x)")
    p.add_argument("--log-every", type=int, default=None, help="progress interval (default: ~10 lines)")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="max |pipelined - single| final loss, relative to max(1, |loss|)")
    p.add_argument("--timeout", type=float, default=600.0, help="whole-run limit in seconds")
    p.add_argument("--trace", metavar="PREFIX", default=None,
                   help="--lib zbpipe: write each rank's last-step Chrome trace to PREFIX.rank<r>.json")
    p.add_argument("--max-norm", type=float, default=None,
                   help="clip gradients by the whole model's norm (zbpipe.clip_grad_norm_; default: off)")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="save model, optimizer and data position to DIR/step-<steps> at the end (DCP)")
    p.add_argument("--partition", default="even", choices=("even", "auto"),
                   help="the split into stages: even blocks per stage, or planned by zbpipe.plan_partition "
                   "from measured per-block costs (docs/partition.md)")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="split the LM head and its loss, and the token embedding, over every pipeline rank "
                   "(zbpipe.VocabParallelOutput, zbpipe.VocabParallelEmbedding; docs/vocab_parallel.md); with "
                   "--partition auto the layers are planned around the head")
    p.add_argument("--vocab", type=int, default=16, help="vocabulary size of the model and the task")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint DIR, at any --pp/--dp/--schedule, "
                   "up to --steps in all")


def _config(opts: dict[str, Any], num_stages: int) -> TinyConfig:
    return TinyConfig(n_layers=opts["layers"] or max(4, num_stages), vocab=opts.get("vocab", 16))


def _optimizer(opts: dict[str, Any], params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if opts["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=opts["lr"] * 10)  # SGD wants a larger step than Adam
    return torch.optim.AdamW(params, lr=opts["lr"])


def _groups(rank: int, pp: int, dp: int):
    """(pipeline group, data-parallel group) of `rank`: replica d holds ranks d*pp .. d*pp+pp-1;
    every rank creates every group, in the same order."""
    pipes = [dist.new_group([d * pp + i for i in range(pp)]) for d in range(dp)]
    replicas = [dist.new_group([d * pp + i for d in range(dp)]) for i in range(pp)]
    return pipes[rank // pp], replicas[rank % pp]


def _topology(opts: dict[str, Any]) -> zbpipe.Program:
    """The schedule's program; for auto, its measuring schedule's (one stage per rank: zb_h1)."""
    name = "zb_h1" if opts["schedule"] == "auto" else opts["schedule"]
    return topology(name, opts["pp"], opts["microbatches"], opts["stages_per_rank"])


def _stage_optimizers(opts: dict[str, Any], modules: list[nn.Module]) -> list[torch.optim.Optimizer]:
    """One optimizer per stage module (as torchtitan has one per model part): each maps its
    state to the parameter names of its own module, which is what a checkpoint keeps."""
    return [_optimizer(opts, list(m.parameters())) for m in modules]


def _worker(rank: int, world: int, opts: dict[str, Any], device: torch.device | None = None) -> dict[str, Any]:
    """One pipeline rank: builds the whole model from the seed (identical init everywhere),
    keeps its own stages, resumes them from a checkpoint if asked, and trains them on its
    replica's share of each batch; the rank holding the last stage of replica 0 logs. Every
    rank returns its report (losses and step time on the logging rank, saved-activation bytes
    everywhere). `device`: the rank's device where the caller set up the world (torchrun)."""
    pp, dp = opts["pp"], opts["dp"]
    device = rank_device() if device is None else device
    replica = rank // pp
    group, dp_group = _groups(rank, pp, dp) if dp > 1 else (None, None)
    program = _topology(opts)
    num_stages = program.num_stages
    cfg = _config(opts, num_stages)
    task = MarkovTask(cfg.vocab, cfg.seq_len, opts["seed"])
    vocab = opts.get("vocab_parallel", False)
    if opts.get("stage_fqns"):  # --partition auto: the plan's split
        model = build_model(cfg, opts["seed"])
        fqns = opts["stage_fqns"]
        if vocab:
            model.head = model.tok_emb = None  # split over the ranks below
            fqns = [[n for n in names if n != "tok_emb"] for names in fqns]
        modules = zbpipe.split_by_fqn(model, fqns)
    else:
        modules = build_stages(cfg, num_stages, opts["seed"], head=not vocab)
    local = local_stages(program, rank % pp)
    mine = [modules[s].to(device) for s in local]
    optims = _stage_optimizers(opts, mine)
    output = embedding = None
    if vocab:  # this rank's rows of the head, from the same seed's model
        output = zbpipe.VocabParallelOutput(build_model(cfg, opts["seed"]).head.to(device), group=group,
                                            data_parallel_group=dp_group)
        embedding = zbpipe.VocabParallelEmbedding(build_model(cfg, opts["seed"]).tok_emb.to(device), group=group,
                                                  data_parallel_group=dp_group)
        optims.append(_optimizer(opts, list(output.parameters()) + list(embedding.parameters())))
    start = checkpoint.load(opts["resume_from"], mine, optims) if opts["resume_from"] else 0
    meter = SavedActivationMeter({s: modules[s] for s in local})
    share = opts["batch_size"] // dp
    mb = share // opts["microbatches"]
    wrap = (lambda m: DistributedDataParallel(m, process_group=dp_group)) if dp > 1 else None
    sched, _ = build_pipeline(
        opts["lib"], program, modules, rank % pp, device, None if vocab else lm_loss,
        group=group, io_examples=lambda s: stage_io_examples(cfg, s, num_stages, mb, device, head=not vocab),
        wrap=wrap, schedule_cls=zbpipe.ScheduleAuto if opts["schedule"] == "auto" else None,
        schedule_kwargs=dict(output=output, input_embedding=embedding,
                             compile_options=opts.get("compile_options")) if vocab else None,
    )
    first, last = 0 in local, num_stages - 1 in local
    logs = last and replica == 0
    steps, every = opts["steps"], opts["log_every"]
    tokens = opts["batch_size"] * cfg.seq_len
    per_device = tokens / world  # torchtitan's tokens/s per device: the world shares each batch
    flops = flops_per_token(build_model(cfg, opts["seed"]), cfg)[1] if logs else 0
    history: list[float] = []
    window_t, window_steps, timed_s = time.perf_counter(), 0, []
    tuned = False
    for step in range(start, steps):
        t_step = time.perf_counter()
        x, y = (t[replica * share:(replica + 1) * share].to(device) for t in task.batch(step, opts["batch_size"]))
        for optim in optims:
            optim.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        sched.step(*((x,) if first or vocab else ()), target=y if last or vocab else None,
                   losses=losses if last else None)
        if opts["max_norm"]:  # the head's and embedding's rows are this rank's too: disjoint shards, one norm
            zbpipe.clip_grad_norm_(mine + ([output, embedding] if vocab else []), opts["max_norm"], group=group)
        for optim in optims:
            optim.step()
        if opts["schedule"] == "auto" and logs and sched.tuning is not None and not tuned:
            print(sched.tuning.table(), flush=True)  # after the tuning's steps
            tuned = True
        if not last:
            continue
        loss = torch.stack([l.detach().float() for l in losses]).mean()
        if dp > 1:  # the whole batch's loss: the mean of the replicas' (equal shares)
            dist.all_reduce(loss, group=dp_group)
            loss /= dp
        if not logs:
            continue
        history.append(float(loss))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step > start:  # the first step sets up (shapes, buffers): not timed
            timed_s.append(time.perf_counter() - t_step)
        window_steps += 1
        if (step + 1) % every == 0 or step + 1 == steps or step == start:
            now = time.perf_counter()
            dt = (now - window_t) / window_steps
            print(f"step {step + 1:>5}/{steps} | loss {history[-1]:.4f} | {tokens / dt:>9.0f} tok/s | "
                  f"{per_device / dt:>8.0f} tok/s/dev | MFU {flops * per_device / dt / opts['peak_flops']:6.2%} | "
                  f"{dt * 1e3:7.2f} ms/step", flush=True)
            window_t, window_steps = now, 0
    if opts["checkpoint"]:
        checkpoint.save(opts["checkpoint"], steps, mine, optims)
    if opts["trace"]:
        sched.export_chrome_trace(f"{opts['trace']}.rank{rank}.json")
    return {"history": history if logs else None, "step_s": timed_s, "stages": local,
            "saved_peak": meter.peak, "saved_per_forward": meter.per_forward}


def _single_process(opts: dict[str, Any], num_stages: int, device: torch.device) -> list[float]:
    """The same model, data and optimizer in one process, whole batch at once, from step 0."""
    cfg = _config(opts, num_stages)
    task = MarkovTask(cfg.vocab, cfg.seq_len, opts["seed"])
    model = build_model(cfg, opts["seed"]).to(device)
    optim = _optimizer(opts, list(model.parameters()))
    history = []
    for step in range(opts["steps"]):
        x, y = (t.to(device) for t in task.batch(step, opts["batch_size"]))
        optim.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        if opts["max_norm"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts["max_norm"])
        optim.step()
        history.append(float(loss.detach()))
    return history


def _report(opts: dict[str, Any], cfg: TinyConfig, program: zbpipe.Program, results: list[dict[str, Any]]) -> None:
    """The throughput line (torchtitan's tokens/s per device, FLOPs per token, MFU) and the
    saved activations of every rank, measured against the simulator's prediction."""
    world = opts["pp"] * opts["dp"]
    n, flops = flops_per_token(build_model(cfg, opts["seed"]), cfg)
    timed = next(r for r in results if r["history"] is not None)["step_s"]
    if timed:
        step_s = sum(timed) / len(timed)
        tps = opts["batch_size"] * cfg.seq_len / step_s / world
        print(f"throughput: {tps:.0f} tokens/s per device ({world} devices, {step_s * 1e3:.2f} ms/step "
              f"over {len(timed)} steps) | {flops} FLOPs/token (6N + 12LHQT, N={n}) | "
              f"MFU {flops * tps / opts['peak_flops']:.2%} of {opts['peak_flops'] / 1e12:.3f} TFLOP/s "
              f"per device ({opts['peak_source']})", flush=True)
    # The simulator under the measured memory model: F adds what one forward of the stage saves
    # (mem_f per stage, from the ranks that hold it), its last backward action frees it.
    mem_f = [0.0] * program.num_stages
    for r in results:
        for s, nbytes in r["saved_per_forward"].items():
            mem_f[s] = float(nbytes)
    predicted = zbpipe.simulate(program, mem_f=mem_f).peak_memory
    print(f"saved activations per (stage, microbatch), measured: {[round(b / 2**10, 1) for b in mem_f]} KiB "
          "(the simulator's mem_f; mem_w = mem_f)", flush=True)
    for rank, r in enumerate(results):
        print(f"saved activations rank {rank} (stages {r['stages']}): peak {r['saved_peak'] / 2**10:.1f} KiB "
              f"measured | {predicted[rank % opts['pp']] / 2**10:.1f} KiB predicted", flush=True)


def _check_args(a: argparse.Namespace, joined: torchrun.TorchrunEnv | None = None) -> zbpipe.Program:
    """Refuses bad arguments (CliError: one line, exit status 2) before any process starts
    (under torchrun, `joined`: before this rank joins the world); returns the schedule's program
    (its topology)."""
    if a.pp < 1 or a.microbatches < 1 or a.steps < 1 or a.batch_size < 1 or a.dp < 1:
        raise CliError("--pp, --dp, --microbatches, --steps and --batch-size must be >= 1")
    try:  # zbpipe validates (pp, microbatches, stages per rank) for either library
        program = _topology(vars(a))
    except zbpipe.ScheduleError as e:
        raise CliError(str(e))
    if a.schedule == "auto" and a.lib != "zbpipe":
        raise CliError("--schedule auto needs --lib zbpipe")
    try:
        schedule_class(a.lib, "zb_h1" if a.schedule == "auto" else a.schedule)
    except ValueError as e:
        raise CliError(f"--lib {a.lib}: {e}")
    if a.batch_size % (a.microbatches * a.dp) != 0:
        raise CliError(f"--batch-size ({a.batch_size}) must be divisible by --microbatches x --dp "
                f"({a.microbatches} x {a.dp})")
    if a.trace and a.lib != "zbpipe":
        raise CliError("--trace needs --lib zbpipe")
    if joined is not None:
        if joined.world_size != a.pp * a.dp:
            raise CliError(f"torchrun's world has WORLD_SIZE={joined.world_size} ranks, but --pp {a.pp} x --dp {a.dp} "
                    f"= {a.pp * a.dp}: start pp x dp processes in all (--nnodes x --nproc-per-node)")
        try:
            torchrun.rank_device(joined, a.device)
        except ValueError as e:
            raise CliError(str(e))
    elif a.device == "cuda" and torch.cuda.device_count() < a.pp * a.dp:
        raise CliError(f"--device cuda needs one GPU per rank: --pp {a.pp} x --dp {a.dp}, "
                f"found {torch.cuda.device_count()}")
    if a.layers is not None and a.layers < program.num_stages:
        raise CliError(f"--layers ({a.layers}) must be >= the number of stages ({program.num_stages})")
    if a.partition == "auto" and a.schedule == "auto":
        raise CliError("--partition auto plans the split for one schedule: pick a --schedule")
    if a.partition == "auto" and a.stages_per_rank not in (None, program.num_stages // a.pp) \
            or a.partition == "auto" and program.num_stages // a.pp > 2:
        raise CliError("--partition auto plans one or two stages per rank (the schedule's default --stages-per-rank)")
    if a.vocab < 2:
        raise CliError(f"--vocab ({a.vocab}) must be >= 2")
    if a.vocab_parallel:
        if a.lib != "zbpipe" or a.schedule == "auto":
            raise CliError("--vocab-parallel needs --lib zbpipe and a fixed --schedule")
        if a.checkpoint or a.resume:
            raise CliError("--vocab-parallel does not save or resume checkpoints yet")
        if a.vocab < a.pp:
            raise CliError(f"--vocab-parallel: the vocabulary ({a.vocab}) must have at least one row per rank "
                           f"(--pp {a.pp})")
    if a.max_norm is not None and not a.max_norm > 0:
        raise CliError(f"--max-norm ({a.max_norm}) must be > 0")
    a.resume_from = None
    if a.resume:
        found = checkpoint.latest(a.checkpoint) if a.checkpoint else None
        if found is None:
            raise CliError(f"--resume needs a step-N checkpoint in --checkpoint DIR ({a.checkpoint!r} has none)")
        a.resume_from, done = found
        if done >= a.steps:
            raise CliError(f"--resume: {a.resume_from} has done {done} steps, --steps is {a.steps}")
        saved = checkpoint.saved_parameters(a.resume_from)
        names = {n for n, _ in build_model(_config(vars(a), program.num_stages), a.seed).named_parameters()}
        if saved != names:
            raise CliError(f"--resume: {a.resume_from} holds another model ({len(saved)} parameters, this one "
                    f"{len(names)}; first difference {sorted(saved ^ names)[0]!r}): pass the same --layers")
    return program


def _planned_split(a: argparse.Namespace, cfg: TinyConfig, task: MarkovTask,
                   program: zbpipe.Program, show: bool = True) -> tuple[list[list[str]], dict]:
    """--partition auto: the plan for the chosen schedule, measured on one microbatch of the
    first batch (on the CPU): here before any rank starts, or under torchrun on every rank of the
    joined world, which gather one plan; so every rank gets the same split.
    TinyTransformer's forward needs a block in every stage and the embeddings (and the final
    norm and head) together, so the embeddings ride with the first block and the head with the
    last: units are [tok_emb, pos_emb, blocks.0], blocks.1 .. blocks.(n-2), [blocks.(n-1), ln_f, head].
    With --vocab-parallel the head is a unit of its own, split over the ranks (plan_partition's
    vocab_parallel). Returns the split and the program's compile options."""
    n = cfg.n_layers
    tail = [f"blocks.{n - 1}", "ln_f"] + ([] if a.vocab_parallel else ["head"])
    units: list = [["tok_emb", "pos_emb", "blocks.0"]] + [f"blocks.{k}" for k in range(1, n - 1)]
    units += [tail] if n > 1 else []
    if n == 1:
        units = [["tok_emb", "pos_emb", "blocks.0", "ln_f"] + ([] if a.vocab_parallel else ["head"])]
    if a.vocab_parallel:
        units.append("head")
    x, y = task.batch(0, a.batch_size)
    mb = a.batch_size // (a.microbatches * a.dp)
    torch.set_num_threads(1)  # as each rank runs
    plan = zbpipe.plan_partition(build_model(cfg, a.seed), (x[:mb],), pp=a.pp, microbatches=a.microbatches,
                                 loss_fn=lm_loss, mb_target=y[:mb], units=units, schedules=[program.schedule],
                                 device="cpu", vocab_parallel=a.vocab_parallel, head="head" if a.vocab_parallel else None)
    if show:
        print(plan.table(), flush=True)
    return plan.module_fqns_per_stage, plan.compile_options()


def _compare(a: argparse.Namespace, opts: dict[str, Any], cfg: TinyConfig, program: zbpipe.Program,
             results: list[dict[str, Any]], pipe_wall: str) -> bool:
    """Prints the report of every rank's results, trains the same model in this process and
    prints both final losses; True when they agree to --tol."""
    _report(opts, cfg, program, results)
    piped = next(r["history"] for r in results if r["history"] is not None)
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # like each rank, so the reference does the same float math
    ref = _single_process(opts, program.num_stages, torch.device("cuda" if a.device == "cuda" else "cpu"))
    ref = ref[len(ref) - len(piped):]  # a resumed run: its steps, against the run from step 0
    ref_s = time.perf_counter() - t0
    diffs = [abs(x - y) for x, y in zip(piped, ref)]
    diff, worst = diffs[-1], max(diffs)
    ok = len(piped) == len(ref) and diff <= a.tol * max(1.0, abs(ref[-1]))
    print(f"wall: pipelined {pipe_wall}, single-process {ref_s:.1f} s")
    print(f"final loss: pipelined {piped[-1]:.6f} | single-process {ref[-1]:.6f} | "
          f"diff {diff:.2e} (max over {len(diffs)} steps {worst:.2e}, tol {a.tol:.0e}) "
          f"{'MATCH' if ok else 'MISMATCH'}", flush=True)
    return ok


def _run_joined(env: torchrun.TorchrunEnv, a: argparse.Namespace, opts: dict[str, Any], cfg: TinyConfig,
                program: zbpipe.Program) -> int:
    """This process as one rank of torchrun's world: trains its stages, then rank 0 gathers
    every rank's report, runs the one-process reference and prints the comparison; its verdict
    is every rank's exit status (0 MATCH, 1 MISMATCH). --timeout bounds every collective."""
    device = torchrun.init_process_group(env, a.device, timeout_s=a.timeout)
    torch.set_num_threads(1)  # as a spawned rank: the reference's float math is one thread's
    print(f"zbpipe train: rank {env.rank} of {env.world_size} in torchrun's world (local rank "
          f"{env.local_rank}, {device}, master {env.master_addr}:{env.master_port})", flush=True)
    try:
        if a.partition == "auto":  # planned in the joined world: the ranks gather one plan
            opts["stage_fqns"], opts["compile_options"] = _planned_split(
                a, cfg, MarkovTask(cfg.vocab, cfg.seq_len, a.seed), program, show=env.rank == 0)
        peak = [peak_flops(a.device) if env.rank == 0 else None]  # one measure, every rank's MFU
        dist.broadcast_object_list(peak, src=0)
        opts["peak_flops"], opts["peak_source"] = peak[0]
        t0 = time.perf_counter()
        result = _worker(env.rank, env.world_size, opts, device)
        results = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(result, results, dst=0)
        pipe_wall = f"{time.perf_counter() - t0:.1f} s (in torchrun's world)"
        verdict = [_compare(a, opts, cfg, program, results, pipe_wall) if env.rank == 0 else None]
        dist.broadcast_object_list(verdict, src=0)
    finally:
        dist.destroy_process_group()
    return 0 if verdict[0] else 1


def run_command(a: argparse.Namespace) -> int:
    """`zbpipe train`: the run, then the check against one process (exit status 0 if they
    match, 1 if not or the run failed, 130 on Ctrl-C); CliError for bad arguments."""
    try:
        joined = torchrun.torchrun_env()  # set: this process is one rank of torchrun's world
    except ValueError as e:
        raise CliError(str(e)) from None
    program = _check_args(a, joined)
    num_stages = program.num_stages
    opts = vars(a).copy()
    opts["log_every"] = a.log_every or max(1, a.steps // 10)
    cfg = _config(opts, num_stages)
    task = MarkovTask(cfg.vocab, cfg.seq_len, a.seed)
    if joined is None or joined.rank == 0:  # the job's lines, once
        print(f"zbpipe train: lib={a.lib} schedule={a.schedule} pp={a.pp} dp={a.dp} stages={num_stages} "
              f"(stage->rank {list(program.stage_to_rank)}) microbatches={a.microbatches} batch={a.batch_size} "
              f"steps={a.steps} device={a.device}", flush=True)
        print(f"model: {cfg.n_layers} blocks d={cfg.d_model} heads={cfg.n_heads} vocab={cfg.vocab} "
              f"seq={cfg.seq_len}; task: 2nd-order Markov chain, loss floor ~{task.entropy_floor():.3f} "
              f"nats (uniform {math.log(cfg.vocab):.3f}); optimizer {a.optimizer} lr={a.lr}", flush=True)
        if a.vocab_parallel:
            print(f"vocabulary parallelism: the LM head 'head' and the token embedding 'tok_emb' split by rows over "
                  f"the {a.pp} pipeline ranks (VocabParallelOutput, VocabParallelEmbedding)", flush=True)
        if a.resume_from:
            print(f"resuming from {a.resume_from}", flush=True)
    if joined is not None:
        return _run_joined(joined, a, opts, cfg, program)
    opts["peak_flops"], opts["peak_source"] = peak_flops(a.device)
    if a.partition == "auto":
        opts["stage_fqns"], opts["compile_options"] = _planned_split(a, cfg, task, program)
    t0 = time.perf_counter()
    try:
        # The group's own timeout is the run's limit, as under torchrun: above the schedule's
        # (300 s), so NCCL's watchdog does not end a rank before zbpipe names the failure.
        results = run_local(_worker, a.pp * a.dp, (opts,), device=a.device, timeout_s=a.timeout,
                            pg_timeout_s=a.timeout)
    except KeyboardInterrupt:
        print("interrupted: all ranks stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"pipelined run failed: {e}", file=sys.stderr)
        return 1
    pipe_wall = f"{time.perf_counter() - t0:.1f} s (incl. process start)"
    return 0 if _compare(a, opts, cfg, program, results, pipe_wall) else 1


COMMAND = Subcommand(add_arguments, run_command, error_prog="zbpipe train", help="train a model (zbpipe.train)",
                     description="Pipelined training of a tiny transformer, checked against the same model "
                                 "trained in one process (same seed, data and optimizer).",
                     formatter_class=_DefaultsHelp)


def main(argv: list[str] | None = None) -> int:
    """`python -m zbpipe.train ...`, `zbpipe.train.main([...])`: `zbpipe train ...`. A bad
    argument exits with status 2 (SystemExit), as argparse does, after its one-line error."""
    code = cli_main(["train", *(sys.argv[1:] if argv is None else argv)])
    if code == USAGE_ERROR:
        raise SystemExit(code)
    return code
