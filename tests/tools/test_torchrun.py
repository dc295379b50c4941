"""`zbpipe train` under torchrun (zbpipe/torchrun.py): it joins torchrun's world instead of
spawning, one rank per process. Launched as a two-node job on this host (two torchrun agents,
--nnodes 2 --nproc-per-node 1 --node-rank 0/1, static rendezvous on 127.0.0.1) it is one job
of two ranks whose rank 0 prints the comparison with one process once, and it MATCHes. Bad
input fails before joining, naming what is missing: torchrun's variables set only in part, a
world that is not pp x dp, --device cuda without a GPU for LOCAL_RANK."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.subprocess_env import NEUTRAL_CWD, child_env, free_port

from zbpipe.torchrun import VARIABLES, TorchrunEnv, rank_device, torchrun_env
from zbpipe.train import main as train_main

FULL = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
JOB_TIMEOUT_S = 240  # a bound on the whole two-node job (a few seconds on a quiet machine)
RDZV_TIMEOUT_S = 120  # the agents' wait for each other


def test_outside_torchrun_there_is_no_world_to_join():
    assert torchrun_env({"PATH": "/bin"}) is None
    assert torchrun_env({v: "" for v in VARIABLES}) is None  # set but empty counts as unset


def test_torchrun_variables_give_the_rank_its_place():
    assert torchrun_env(FULL) == TorchrunEnv(world_size=2, rank=1, local_rank=0, master_addr="127.0.0.1",
                                             master_port=29511)


@pytest.mark.parametrize("missing", [("RANK",), ("LOCAL_RANK",), ("MASTER_ADDR", "MASTER_PORT"), ("WORLD_SIZE",)])
def test_variables_set_only_in_part_name_what_is_missing(missing):
    with pytest.raises(ValueError) as e:
        torchrun_env({k: v for k, v in FULL.items() if k not in missing})
    assert f"set only in part: {', '.join(missing)} missing" in str(e.value), e.value


@pytest.mark.parametrize("name,value,needle", [("RANK", "one", "RANK must be an integer, got 'one'"),
                                               ("RANK", "2", "RANK=2, LOCAL_RANK=0 and WORLD_SIZE=2 do not fit"),
                                               ("MASTER_PORT", "70000", "MASTER_PORT must be a TCP port")])
def test_values_that_make_no_sense_are_named(name, value, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        torchrun_env(dict(FULL, **{name: value}))


def test_cuda_takes_local_rank_gpu_and_names_a_missing_one():
    count = torch.cuda.device_count()
    env = TorchrunEnv(world_size=count + 1, rank=count, local_rank=count, master_addr="x", master_port=1)
    assert rank_device(env, "cpu") == torch.device("cpu")
    missing = rf"--device cuda: no GPU for LOCAL_RANK {count} on this node \({count} visible"
    with pytest.raises(ValueError, match=missing):
        rank_device(env, "cuda")
    if count:
        assert rank_device(TorchrunEnv(count, count - 1, count - 1, "x", 1), "cuda") == torch.device("cuda", count - 1)


def _train_fails_before_joining(monkeypatch, capsys, env: dict, *args: str) -> str:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        train_main(["--steps", "1", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_train_refuses_variables_set_only_in_part(monkeypatch, capsys):
    err = _train_fails_before_joining(monkeypatch, capsys, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"})
    assert "set only in part: WORLD_SIZE, RANK, LOCAL_RANK missing" in err, err


def test_train_refuses_a_world_that_is_not_pp_x_dp(monkeypatch, capsys):
    err = _train_fails_before_joining(monkeypatch, capsys, dict(FULL, WORLD_SIZE="3"), "--pp", "2", "--dp", "1")
    assert "torchrun's world has WORLD_SIZE=3 ranks, but --pp 2 x --dp 1 = 2" in err, err


def test_train_refuses_cuda_without_a_gpu_for_local_rank(monkeypatch, capsys):
    local = str(torch.cuda.device_count())  # one past the last GPU (0 on a machine without)
    err = _train_fails_before_joining(monkeypatch, capsys, dict(FULL, LOCAL_RANK=local), "--device", "cuda")
    assert f"--device cuda: no GPU for LOCAL_RANK {local} on this node" in err, err


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc): torchrun starts each worker in a session of its
    own, so the agent's process group does not hold them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to check that no process is left")
def test_two_torchrun_nodes_make_one_job_of_two_ranks_that_matches():
    port = free_port()
    env = dict(child_env(), GLOO_SOCKET_IFNAME="lo,lo", OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--max-restarts", "0", "--rdzv-conf", f"timeout={RDZV_TIMEOUT_S}",
         "-m", "zbpipe.train", "--steps", "2", "--log-every", "1", "--timeout", str(JOB_TIMEOUT_S)],
        cwd=NEUTRAL_CWD, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for node in (0, 1)]
    seen: set[int] = set()
    deadline = time.monotonic() + JOB_TIMEOUT_S + 30
    try:
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            for a in agents:
                seen |= _descendants(a.pid)
            time.sleep(0.5)
    finally:
        if any(a.poll() is None for a in agents):  # past the deadline: end the job
            for a in agents:
                os.killpg(a.pid, signal.SIGTERM)  # an agent ends its workers on SIGTERM
            time.sleep(5)
            for pid in [*seen, *(a.pid for a in agents)]:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        outs = [a.communicate(timeout=30) for a in agents]
    left = [pid for pid in seen if _alive(pid)]
    report = "\n".join(f"--- node {n} (exit {a.returncode})\nstdout:\n{o}\nstderr:\n{e[-3000:]}"
                       for n, (a, (o, e)) in enumerate(zip(agents, outs)))
    assert all(a.returncode == 0 for a in agents), report
    assert seen and not left, f"processes left: {left}"
    node0, node1 = outs[0][0], outs[1][0]
    # One world of two ranks, one rank on each node (no local spawning: no third process).
    assert re.search(r"^zbpipe train: rank 0 of 2 in torchrun's world \(local rank 0, cpu,", node0, re.M), report
    assert re.search(r"^zbpipe train: rank 1 of 2 in torchrun's world \(local rank 0, cpu,", node1, re.M), report
    # Rank 0 prints the job's lines and the comparison once; its report holds both ranks.
    both = node0 + node1
    assert len(re.findall(r"^zbpipe train: lib=", both, re.M)) == 1, report
    finals = re.findall(r"^final loss: .* (MATCH|MISMATCH)$", both, re.M)
    assert finals == ["MATCH"] and re.search(r"^final loss: .* MATCH$", node0, re.M), report
    assert re.findall(r"^saved activations rank (\d) ", node0, re.M) == ["0", "1"], report


def test_rank_zero_verdict_is_the_exit_status():
    """A one-rank world (the variables set by hand): a MISMATCH (here forced by --tol -1) exits 1."""
    env = dict(child_env(), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, "-m", "zbpipe.train", "--pp", "1", "--schedule", "gpipe", "--steps", "1", "--tol", "-1",
         "--timeout", "60"], cwd=NEUTRAL_CWD, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 1, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert "zbpipe train: rank 0 of 1 in torchrun's world" in out, out
    assert re.search(r"^final loss: .* MISMATCH$", out, re.M), out
