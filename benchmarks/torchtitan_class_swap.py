"""torchtitan's own trainer with torch.distributed.pipelining's classes swapped for zbpipe's:
per schedule, the loss and gradient norm of each step against torchtitan's run on torch's
classes (same seed, same data: torch's run is the reference). Needs a torchtitan install
(docs/torchtitan.md says how it was made on a CPU host: triton too, which torchtitan 0.3.0
imports at module level).

    PYTHONPATH=. /path/to/venv-with-torchtitan/bin/python benchmarks/torchtitan_class_swap.py \
        [--schedules 1F1B,Interleaved1F1B,ZBVZeroBubble,InterleavedZeroBubble,DualPipeV,VFillDrainCSV] \
        [--steps 5] [--seq-len 128] [--ac selective|full|none] [--param-dtype bfloat16|float32] \
        [--tolerance 1e-5] [--keep]

Without torchtitan it prints why and exits 0 (exit 1 when a schedule fails). Checked on
torchtitan 0.3.0 with torch 2.13 (docs/torchtitan.md, "Run on torchtitan 0.3.0"); the entry
points it patches are that version's.

Each run is `torch.distributed.run --nproc_per_node 2` on 127.0.0.1 (Gloo, CPU) of torchtitan's
train.py main with `--module llama3 --config llama3_debugmodel`, pipeline_parallel_degree 2, the
debug model's own settings otherwise: local_batch_size 8 (8 microbatches), selective activation
checkpointing, fully_shard with bf16 parameters and fp32 reduction (applied even with a dp mesh
of size 1), the chunked loss, AdamW with warmup, clipping at max_norm 1. The verdict takes each
step's loss and the gradient norm torchtitan's clipping computes (over both ranks), and passes
when both are within --tolerance (relative) at every step.

The reference. For 1F1B and Interleaved1F1B it is torch's same schedule. torch's schedules that
split the backward cannot serve: under selective activation checkpointing they raise "Trying to
backward an extra time", and without it their W gives no gradient to norm.weight (torch's
stage_backward_input collects the stage's parameters while FSDP's root group, norm and lm_head,
holds sharded DTensors that are not in the autograd graph). So the reference is torch's
full-backward run with the same stage placement, hence the same initial weights:
Interleaved1F1B for InterleavedZeroBubble; for ZBVZeroBubble and DualPipeV a fill-drain CSV with
the V placement (--parallelism.pipeline_parallel_schedule_csv, torch's _PipelineScheduleRuntime).
torch's own run of the split schedule is still made and shown (--no-torch-split skips it).
VFillDrainCSV runs that CSV on both sides (torchtitan's CSV path on zbpipe).

This file is also the per-rank entry (--rank-entry). There it patches torchtitan and torch where
they cannot run on this host, the same way for both sides, never the pipeline:
- torchtitan 0.3.0 names its device `_get_available_device_type() or "cuda"`, so a CPU-only
  host gets "cuda": the entry makes it "cpu" before torchtitan is imported.
- Its device memory monitor calls accelerator-only functions (torch.cpu has no
  get_device_name or memory_stats): a monitor reporting zero device memory replaces it. Its
  set_pg_timeouts (after step 1) calls torch.distributed.set_timeout, which torch 2.13 lacks:
  the process groups keep their initial timeout.
- torch 2.13's FlexAttention has no backward on CPU, and torchtitan 0.3.0's language models
  attend only through FlexAttention or varlen (CUDA): the compiled flex kernel is replaced by
  scaled_dot_product_attention under the dense mask of the same BlockMask, and the block mask
  is built by eager create_block_mask.
- torch 2.13's `step()`/`eval()` have no `arg_mbs`/`kwarg_mbs`/`target_mbs` (torch's nightly has
  them; torchtitan 0.3.0 calls them): for the torch run only, the entry gives torch's schedules
  a `step()` that hands pre-split microbatches to torch's own `_step_microbatches`, the body of
  torch's whole-batch `step()` without its split.
- It records the loss torchtitan's step returns and the gradient norm its clipping computes.
For the zbpipe run it replaces the names torchtitan/distributed/pipeline_parallel.py imports
from torch.distributed.pipelining with zbpipe's (docs/torchtitan.md's import block).

torchtitan's launcher also needs --training.disable_cuda_graphs (its config refuses pipeline
parallelism otherwise). The data: torchtitan's c4_test files are not in its wheel, so the run
writes its own (text made from a fixed seed) and a word-level tokenizer with the debug model's
vocabulary size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SCHEDULES = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV", "VFillDrainCSV"]
# VFillDrainCSV: --parallelism.pipeline_parallel_schedule_csv (torch's _PipelineScheduleRuntime._load_csv
# path) with write_v_fill_drain_csv's file, the V placement of ZBVZeroBubble's name, on both sides.
PIPELINES = ["torch", "zbpipe"]  # torch first: the reference
AC_MODES = ["selective", "full", "none"]  # torchtitan's activation-checkpoint subcommands
VOCAB = 2048  # llama3 debugmodel's vocab_size
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<unk>"]


# ---- per rank: torchtitan's main, patched ------------------------------------------------------

def _cpu_device_type() -> None:
    """torchtitan 0.3.0's tools/utils.py: `_get_available_device_type() or "cuda"`."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"


def _cpu_memory_monitor() -> None:
    """torchtitan 0.3.0's DeviceMemoryMonitor reads an accelerator module (get_device_name,
    memory_stats); torch.cpu has neither. A monitor that reports no device memory stands in."""
    from torchtitan.components import metrics

    class CpuMemoryMonitor:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor

    # set_pg_timeouts (after step 1) calls torch.distributed.set_timeout, which torch 2.13 lacks
    # (torchtitan 0.3.0 follows torch's nightly): the groups keep their initial timeout.
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None


def _eager_flex_attention() -> None:
    """torch 2.13's FlexAttention refuses backward on CPU ("FlexAttention does not support
    backward on CPU"), and every language-model attention torchtitan 0.3.0 offers is FlexAttention
    or varlen (CUDA). The same attention, eager: scaled_dot_product_attention under the dense
    boolean mask of the BlockMask torchtitan built (its document mask_mod), and the block mask
    built by eager create_block_mask instead of a compiled one."""
    import torch.nn.functional as F
    from torch.nn.attention import flex_attention as fa
    from torchtitan.models.common import attention

    def flex_as_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("score_mod / lse: the eager stand-in for FlexAttention takes a mask only")
        batch, heads, q_len, kv_len = block_mask.shape
        mask = fa.create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None

    attention._compiled_create_block_mask = fa.create_block_mask
    attention.FlexAttention._compiled_flex_attn = flex_as_sdpa


def _torch_step_takes_presplit_microbatches() -> None:
    """torch 2.13's step() without its whole-batch split, for the microbatches torchtitan split."""
    import torch
    from torch.distributed.pipelining import schedules as ts

    def wrap(cls):
        whole_batch_step = cls.step

        def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, target=None, losses=None,
                 return_outputs=True, loss_kwargs=None, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return whole_batch_step(self, *args, target=target, losses=losses, return_outputs=return_outputs,
                                        loss_kwargs=loss_kwargs, **kwargs)
            if args or kwargs or target is not None:
                raise ValueError("pre-split microbatches cannot be mixed with whole-batch inputs")
            stages = getattr(self, "_stages", None) or [self._stage]
            needs_grad = self._has_backward and getattr(self, "_backward_requires_autograd", True)
            if needs_grad and not torch.is_grad_enabled():
                raise RuntimeError("step() requires gradients to be enabled; use eval()")
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                    loss_kwargs=loss_kwargs)
            for stage in stages:
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

        cls.step = step

    wrap(ts.PipelineScheduleSingle)
    wrap(ts.PipelineScheduleMulti)


def _swap_in_zbpipe() -> None:
    """docs/torchtitan.md's import block, applied to the module torchtitan builds its pipeline in."""
    import zbpipe
    import zbpipe.schedules as zs
    from torchtitan.distributed import pipeline_parallel as pp

    pp.PipelineStage = zbpipe.PipelineStage
    for name in ("_PipelineSchedule", "_PipelineScheduleRuntime", "get_schedule_class", "PipelineScheduleMulti",
                 "PipelineScheduleSingle", "ScheduleDualPipeV", "ScheduleZBVZeroBubble"):
        setattr(pp, name, getattr(zs, name))


def _record(path: str) -> None:
    """Append {ran: schedule and stage classes} once, {step, loss} (ranks holding the last stage)
    and {grad_norm} per step."""
    import torch
    from torchtitan import trainer as tt
    from torchtitan.distributed import utils as dist_utils

    rows = []

    def write():
        with open(path, "w") as f:
            json.dump(rows, f)

    pp_step = tt.Trainer.pp_forward_backward_step

    def pp_forward_backward_step(self, **kwargs):
        if not any("ran" in row for row in rows):  # which classes ran: the verdict checks the swap took
            ran = [self.pp_schedule, *getattr(self.pp_schedule, "_stages", [getattr(self.pp_schedule, "_stage", None)])]
            rows.append({"ran": [f"{type(x).__module__}.{type(x).__qualname__}" for x in ran if x is not None]})
            write()
        loss = pp_step(self, **kwargs)
        if self.pp_has_last_stage:
            rows.append({"step": self.step, "loss": float(loss.detach().double().sum())})
            write()
        return loss

    clip = dist_utils.clip_grad_norm_

    def clip_grad_norm_(*args, **kwargs):
        norm = clip(*args, **kwargs)
        rows.append({"grad_norm": float(torch.as_tensor(norm).double())})
        write()
        return norm

    tt.Trainer.pp_forward_backward_step = pp_forward_backward_step
    dist_utils.clip_grad_norm_ = clip_grad_norm_


def rank_entry(pipeline: str, record_dir: str, titan_args: list[str]) -> None:
    _cpu_device_type()
    _cpu_memory_monitor()
    _eager_flex_attention()
    if pipeline == "torch":
        _torch_step_takes_presplit_microbatches()
    else:
        _swap_in_zbpipe()
    _record(os.path.join(record_dir, f"rank{os.environ['RANK']}.json"))
    from torchtitan.train import main as titan_main

    sys.argv = ["torchtitan/train.py", *titan_args]
    titan_main()


# ---- the driver ---------------------------------------------------------------------------------

def _torchtitan_version(python: str) -> str | None:
    probe = "import importlib.metadata as m, torchtitan.trainer; print(m.version('torchtitan'))"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"skipped: torchtitan is not importable from {python}: "
              f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return out.stdout.strip()


def write_assets(work: str, docs: int = 1500, seed: int = 0) -> tuple[str, str]:
    """A c4_test-shaped dataset (JSON lines with "text") and a word-level tokenizer.json with
    the debug model's vocabulary size; the BOS/EOS names torchtitan's tokenizer looks up."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = sorted({"".join(rng.choice(letters[: rng.randint(6, 26)]) for _ in range(rng.randint(1, 8)))
                    for _ in range(4 * VOCAB)})[: VOCAB - len(SPECIAL)]
    data_dir = os.path.join(work, "c4_test")
    os.makedirs(data_dir, exist_ok=True)
    zipf = [1.0 / (i + 1) for i in range(len(words))]
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choices(words, zipf, k=rng.randint(64, 512)))}) + "\n")
    tok_dir = os.path.join(work, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    vocab = {w: i for i, w in enumerate(words + SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
                   "add_bos_token": True, "add_eos_token": True}, f)
    return data_dir, tok_dir


def titan_args(run: dict, args, work: str, dump: str) -> list[str]:
    out = ["--module", "llama3", "--config", "llama3_debugmodel", "--hf_assets_path", os.path.join(work, "tokenizer"),
           "--dataloader.dataset_path", os.path.join(work, "c4_test"), "--dump_folder", dump,
           "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
           "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", run["schedule"],
           "--debug.seed", "42", "--training.disable_cuda_graphs",
           "--training.mixed_precision_param", args.param_dtype]
    if run["csv"]:
        out += ["--parallelism.pipeline_parallel_schedule_csv", os.path.join(work, run["csv"])]
    return out + [f"activation-checkpoint:{run['ac']}"]  # a tyro subcommand: last


def write_v_fill_drain_csv(work: str, microbatches: int = 8) -> str:
    """A compute-only CSV (torch's _load_csv layout) with the V placement (rank 0: stages 0 and 3,
    rank 1: stages 1 and 2) and full backwards: every forward, then every backward, each stage's
    microbatches in order. torchtitan runs it with --parallelism.pipeline_parallel_schedule_csv
    and a V schedule's name (the name picks the placement and so the weights' initial values)."""
    def row(first, second):
        return ([f"{first}F{m}" for m in range(microbatches)] + [f"{second}F{m}" for m in range(microbatches)]
                + [f"{second}B{m}" for m in range(microbatches)] + [f"{first}B{m}" for m in range(microbatches)])

    name = "v_fill_drain.csv"
    with open(os.path.join(work, name), "w") as f:
        f.write(",".join(row(0, 3)) + "\n" + ",".join(row(1, 2)) + "\n")
    return name


def reference_of(schedule: str, ac: str) -> dict:
    """torch's run that zbpipe's is compared with. For the schedules that split the backward,
    torch's own cannot serve (docs/torchtitan.md): under selective activation checkpointing it
    raises "Trying to backward an extra time", and without it its W gives no gradient to the
    FSDP root group's parameters (norm.weight). So: torch's non-split schedule with the same
    stage placement, which gives the same initial weights: Interleaved1F1B for
    InterleavedZeroBubble, the V fill-drain CSV for ZBVZeroBubble and DualPipeV."""
    if schedule == "InterleavedZeroBubble":
        return {"pipeline": "torch", "schedule": "Interleaved1F1B", "csv": None, "ac": ac}
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return {"pipeline": "torch", "schedule": schedule, "csv": "v_fill_drain.csv", "ac": ac}
    if schedule == "VFillDrainCSV":
        return zbpipe_run(schedule, ac) | {"pipeline": "torch"}
    return {"pipeline": "torch", "schedule": schedule, "csv": None, "ac": ac}


def zbpipe_run(schedule: str, ac: str) -> dict:
    if schedule == "VFillDrainCSV":
        return {"pipeline": "zbpipe", "schedule": "ZBVZeroBubble", "csv": "v_fill_drain.csv", "ac": ac}
    return {"pipeline": "zbpipe", "schedule": schedule, "csv": None, "ac": ac}


def describe(run: dict) -> str:
    what = f"{run['pipeline']} {run['schedule']}" + (" + V fill-drain CSV" if run["csv"] else "")
    return f"{what} (AC {run['ac']})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _zbpipe_parent() -> str:
    """The folder holding the zbpipe this driver imports (an installed one, or PYTHONPATH=.'s
    built tree); this file's source tree where none is importable."""
    try:
        import zbpipe
    except ImportError:
        return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.dirname(os.path.dirname(os.path.abspath(zbpipe.__file__)))


def run_one(run: dict, args, work: str) -> dict:
    tag = f"{run['pipeline']}-{run['schedule']}{'-csv' if run['csv'] else ''}-ac_{run['ac']}"
    record_dir = os.path.join(work, tag)
    os.makedirs(record_dir, exist_ok=True)
    cmd = [args.python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "--max_restarts", "0", os.path.abspath(__file__),
           "--rank-entry", "--pipeline", run["pipeline"], "--record-dir", record_dir, "--",
           *titan_args(run, args, work, os.path.join(record_dir, "dump"))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([_zbpipe_parent(), os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    with open(os.path.join(record_dir, "log.txt"), "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    rows = []
    for r in range(2):
        path = os.path.join(record_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows += json.load(f)
    losses = [row["loss"] for row in rows if "loss" in row]
    norms = [row["grad_norm"] for row in rows if "grad_norm" in row][: len(losses) or None]
    ran = sorted({name for row in rows for name in row.get("ran", [])})
    error = None
    if rc != 0:
        with open(os.path.join(record_dir, "log.txt")) as f:
            lines = [ln for ln in f.read().splitlines() if "Error" in ln]
        error = f"rc={rc}: {lines[-1].strip() if lines else 'see ' + record_dir + '/log.txt'}"
    return {**run, "losses": losses, "grad_norms": norms, "ran": ran, "error": error, "seconds": time.time() - t0,
            "command": " ".join(cmd)}


def _max_rel(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=math.nan)


def compare(schedule: str, ref: dict, got: dict, own: dict | None, args) -> bool:
    print(f"\n== {schedule}: {describe(got)} against {describe(ref)}")
    print(f"   zbpipe: {got['command']}")
    for run in (ref, got):
        if run["error"]:
            print(f"   {describe(run)}: FAILED {run['error']}")
    print(f"   {'step':>4} {'loss torch':>14} {'loss zbpipe':>14} {'rel diff':>9} "
          f"{'grad_norm torch':>16} {'grad_norm zbpipe':>16} {'rel diff':>9}")
    for k in range(max(len(ref["losses"]), len(got["losses"]))):
        def cell(run, key):
            return f"{run[key][k]:.8f}" if k < len(run[key]) else "-"

        def rel(key):
            both = k < min(len(ref[key]), len(got[key]))
            return f"{_max_rel(got[key][k:k + 1], ref[key][k:k + 1]):.1e}" if both else "-"

        print(f"   {k + 1:>4} {cell(ref, 'losses'):>14} {cell(got, 'losses'):>14} {rel('losses'):>9} "
              f"{cell(ref, 'grad_norms'):>16} {cell(got, 'grad_norms'):>16} {rel('grad_norms'):>9}")
    complete = all(len(r["losses"]) == args.steps and len(r["grad_norms"]) == args.steps and not r["error"]
                   for r in (ref, got))
    for run in (ref, got):  # each side ran its own pipeline's classes, and only those
        foreign = [name for name in run["ran"] if name.split(".")[0] != run["pipeline"]]
        if foreign or not run["ran"]:
            complete = False
            print(f"   {describe(run)}: ran {', '.join(run['ran']) or 'no recorded schedule'}: not its pipeline's classes")
    print(f"   classes: {', '.join(got['ran'])} against {', '.join(ref['ran'])}")
    loss_rel, norm_rel = _max_rel(got["losses"], ref["losses"]), _max_rel(got["grad_norms"], ref["grad_norms"])
    ok = complete and loss_rel <= args.tolerance and norm_rel <= args.tolerance
    print(f"   {'PASS' if ok else 'FAIL'}: largest relative difference {loss_rel:.1e} in the losses, "
          f"{norm_rel:.1e} in the gradient norms (tolerance {args.tolerance:g}, {args.steps} steps)")
    if own is not None:
        status = (f"FAILED {own['error']}" if own["error"] else
                  f"losses within {_max_rel(own['losses'], ref['losses']):.1e} of the reference, gradient norms "
                  f"within {_max_rel(own['grad_norms'], ref['grad_norms']):.1e}")
        print(f"   torch's own {describe(own)}: {status}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-entry", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pipeline", choices=PIPELINES, help=argparse.SUPPRESS)
    p.add_argument("--record-dir", help=argparse.SUPPRESS)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--ac", choices=AC_MODES, default="selective",
                   help="torchtitan's activation checkpointing (its debug model's own: selective)")
    p.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="torchtitan's training.mixed_precision_param: FSDP's compute dtype (its default: bfloat16)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest relative difference accepted in each step's loss and gradient norm")
    p.add_argument("--no-torch-split", action="store_true",
                   help="skip torch's own run of the schedules that split the backward (shown, not compared)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per torchrun")
    p.add_argument("--python", default=sys.executable, help="the Python that has torchtitan")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, records)")
    p.add_argument("titan_args", nargs="*")
    args = p.parse_args()
    if args.rank_entry:
        rank_entry(args.pipeline, args.record_dir, args.titan_args)
        return 0

    version = _torchtitan_version(args.python)
    if version is None:
        return 0
    work = tempfile.mkdtemp(prefix="torchtitan_class_swap_")
    write_assets(work)
    write_v_fill_drain_csv(work)
    schedules = args.schedules.split(",")
    print(f"torchtitan {version}, llama3 debugmodel, {args.steps} steps, seq_len {args.seq_len}, pp 2 "
          f"(Gloo, CPU), activation checkpointing {args.ac}, parameters in {args.param_dtype}; work folder {work}")
    done: dict = {}  # reference runs, shared by the schedules that have the same one

    def run(spec: dict) -> dict:
        key = json.dumps(spec, sort_keys=True)
        if key not in done:
            done[key] = run_one(spec, args, work)
        return done[key]

    passed = 0
    for schedule in schedules:
        ref = run(reference_of(schedule, args.ac))
        got = run(zbpipe_run(schedule, args.ac))
        own = None
        if ref["schedule"] != got["schedule"] or ref["csv"] != got["csv"]:
            if not args.no_torch_split:
                own = run({"pipeline": "torch", "schedule": schedule, "csv": None, "ac": args.ac})
        passed += compare(schedule, ref, got, own, args)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{passed}/{len(schedules)} schedules on zbpipe equal torch's run within {args.tolerance:g}")
    return 0 if passed == len(schedules) else 1


if __name__ == "__main__":
    sys.exit(main())
