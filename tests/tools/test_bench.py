"""zbpipe bench (zbpipe/bench/): a smoke run at pp=4 with 0.5 ms actions and one repetition
(the table's rows, every ratio finite, torch's missing schedule reported n/a, the saved-bytes
peak as the simulator's memory model predicts it, --json and --draw written), and bad input
refused before any process starts. No timed assertion: speed goals live in docs/benchmarks.md."""

from __future__ import annotations

import json
import math

import pytest

import zbpipe.bench.launch as launch_mod
import zbpipe.bench.command as run_mod
from zbpipe.bench import BenchConfig, BenchError, run
from zbpipe.cli import main as cli_main

SMOKE = ["--pp", "4", "--microbatches", "4", "--schedules", "1f1b,zb_h1,zbv", "--f", "0.5", "--i", "0.5",
         "--w", "0.5", "--act", "4K", "--reps", "1", "--warmup", "0", "--timeout", "240"]


def test_smoke_table_rows_finite_ratios_json_and_picture(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "step.png"
    code = cli_main(["bench", *SMOKE, "--json", str(out_json), "--draw", str(out_png)])
    out, err = capsys.readouterr()
    assert code == 0, err
    table_rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| schedule")]
    assert [r.split("|")[1].strip() for r in table_rows] == ["1f1b", "zb_h1", "zbv"]
    assert "hop at 4096 B" in out
    doc = json.loads(out_json.read_text())
    rows = {r["schedule"]: r for r in doc["rows"]}
    assert set(rows) == {"1f1b", "zb_h1", "zbv"}
    for name, r in rows.items():
        for key in ("realized_ms", "sim_nominal_ms", "sim_measured_ms", "gap", "host_us_per_action"):
            assert r[key] is not None and math.isfinite(r[key]), (name, key, r[key])
        assert r["realized_ms"] > 0 and r["gap"] > 0
        # The emulated blocks' saved buffers follow the simulator's memory model exactly.
        assert r["saved_peak_bytes"] == r["saved_predicted_bytes"] > 0, name
    for name in ("1f1b", "zbv"):  # torch has these: measured in the same run
        assert math.isfinite(rows[name]["zbpipe_over_torch"]) and rows[name]["torch_ms"] > 0
    assert rows["zb_h1"]["torch_ms"] is None and rows["zb_h1"]["zbpipe_over_torch"] is None
    assert "no zb_h1 schedule" in rows["zb_h1"]["torch_note"]
    assert doc["hop"]["hop_s"] > 0 and doc["hop"]["bandwidth_Bps"] > 0
    # The host: the ranks' CPUs, each run's run-queue delay beside its gap (Linux: schedstat).
    assert doc["hosts"] and sum(len(h["ranks"]) for h in doc["hosts"]) == 4 and all(h["cpus"] >= 1 for h in doc["hosts"])
    for name, r in rows.items():
        assert r["runq_ms"] is not None and r["runq_ms"] >= 0 and 0 <= r["runq_rank"] < 4, (name, r)
        assert r["runq_fraction"] == pytest.approx(r["runq_ms"] / r["realized_ms"]), (name, r)
        assert r["runq_process_ms"] >= r["runq_ms"], (name, r)  # the executor's thread is one of the process's
    assert "run-queue ms" in out and "rank(s) on" in out
    assert doc["warnings"] == [line for line in out.splitlines() if line.startswith("warning: ")]
    # zbpipe's wait bound is below the group's own timeout (NCCL's watchdog must not win).
    assert doc["timeouts"]["group_s"] > doc["timeouts"]["schedule_s"] > 0, doc["timeouts"]
    for name in rows:
        data = (tmp_path / f"step_{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if any process would start."""
    def refuse(*a, **k):
        raise AssertionError("a process was started")
    monkeypatch.setattr(run_mod, "launch", refuse)
    monkeypatch.setattr(launch_mod, "run_local", refuse, raising=False)


@pytest.mark.parametrize("options, needle", [
    (dict(pp=4, f=[1.0, 2.0]), "--f has 2 values: give one, or one per stage"),
    (dict(pp=2, w=[1.0, 2.0, 3.0]), "--w has 3 values"),
    (dict(pp=2, i=[0.0]), "--i: every time must be a positive number"),
    (dict(pp=2, f=[-1.0, 1.0]), "--f: every time must be a positive number"),
    (dict(pp=4, microbatches=4, schedules=["dualpipev"]), "dualpipev does not fit pp=4 x microbatches=4"),
    (dict(pp=2, schedules=["inference"]), "unknown or forward-only schedule 'inference'"),
    (dict(pp=2, libs=["deepspeed"]), "--lib takes"),
])
def test_bad_input_fails_before_any_process(no_launch, options, needle):
    with pytest.raises(BenchError, match=needle.replace("(", r"\(")):
        run(**options)


def test_bad_input_on_the_command_line_is_one_line_exit_2(no_launch, capsys):
    assert cli_main(["bench", "--pp", "4", "--f", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zbpipe bench: error: --f has 2 values" in err
    assert cli_main(["bench", "--act", "lots"]) == 2
    assert "expected bytes" in capsys.readouterr().err


def test_costs_spread_over_a_schedules_stages():
    cfg = BenchConfig(pp=2, f=[2.0, 4.0], i=[1.0], w=[3.0]).check()
    assert cfg.stage_costs(2) == {"f": [2.0, 4.0], "i": [1.0, 1.0], "w": [3.0, 3.0]}
    # Two stages per rank (V): each slice runs as two stages of half its cost and activation.
    assert cfg.stage_costs(4) == {"f": [1.0, 1.0, 2.0, 2.0], "i": [0.5] * 4, "w": [1.5] * 4}
    assert cfg.saved_elems(4) == cfg.saved_elems(2) // 2


def test_torch_missing_schedule_is_not_an_error():
    from zbpipe.bench.config import torch_has

    assert not torch_has("zb_h1") and torch_has("1f1b")
    BenchConfig(pp=2, schedules=["zb_h1"], libs=["zbpipe", "torch"]).check()  # no error


def test_under_torchrun_it_joins_the_world_of_the_environment():
    """WORLD_SIZE and RANK set (as torchrun sets them): one process is the whole world of pp=1,
    no process is spawned, and rank 0 prints the table."""
    import subprocess
    import sys

    from helpers.subprocess_env import NEUTRAL_CWD, child_env, free_port

    env = dict(child_env(), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-m", "zbpipe.bench", "--schedules", "1f1b", "--lib", "zbpipe",
                           "--f", "0.5", "--i", "0.5", "--w", "0.5", "--act", "4K", "--reps", "1", "--warmup", "0"],
                          capture_output=True, text=True, env=env, cwd=NEUTRAL_CWD, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pp=1 " in done.stdout and "| 1f1b | off |" in done.stdout


def test_under_torchrun_the_world_must_be_the_pipeline(monkeypatch, capsys):
    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    assert cli_main(["bench", "--pp", "4", "--schedules", "1f1b"]) == 2
    assert "WORLD_SIZE=2 but --pp=4" in capsys.readouterr().err


def test_under_torchrun_variables_set_in_part_are_named(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for k in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert cli_main(["bench", "--pp", "2", "--schedules", "1f1b"]) == 2
    err = capsys.readouterr().err
    assert "set only in part" in err and "MASTER_PORT" in err


def test_run_returns_the_rows_of_a_checked_config(monkeypatch):
    seen = {}

    def fake_measure(cfg):
        seen["cfg"] = cfg
        return {"rows": [{"schedule": "1f1b"}], "hop": {}, "gathered": {}}

    monkeypatch.setattr(run_mod, "measure", fake_measure)
    assert run(pp=2, schedules=["1f1b"], f=[3.0]) == [{"schedule": "1f1b"}]
    assert seen["cfg"].f == [3.0, 3.0] and seen["cfg"].pp == 2


def _groups_of_the_libraries(rank, world):
    import os

    import torch
    import torch.distributed as dist

    from zbpipe.bench.config import BenchConfig
    from zbpipe.bench.worker import _torch_group

    before = os.environ.get("GLOO_SOCKET_IFNAME")
    group = _torch_group(BenchConfig(pp=world, libs=["zbpipe", "torch"]), torch.device("cpu"))
    devices = lambda g: len(g._get_backend(torch.device("cpu")).options._devices)  # noqa: E731
    out = (devices(dist.group.WORLD), devices(group), os.environ.get("GLOO_SOCKET_IFNAME") == before)
    none_without_torch = _torch_group(BenchConfig(pp=world, libs=["zbpipe"]), torch.device("cpu")) is None
    return out + (none_without_torch,)


def test_torch_runs_on_a_one_device_gloo_group_zbpipe_on_the_worlds_two():
    """Each library at its best (docs/benchmarks.md): torch's pipelining on a Gloo group of one
    device, zbpipe on the launcher's world of two."""
    from zbpipe.train.launcher import run_local

    results = run_local(_groups_of_the_libraries, 2, timeout_s=60, gloo_devices=2)
    assert results == [(2, 1, True, True)] * 2


# ---- the host: run-queue delay and CPUs ----------------------------------------------------


def test_the_run_queue_delay_counts_waiting_for_a_cpu_not_sleeping():
    import os
    import subprocess
    import sys
    import time

    from zbpipe.bench.host_load import RunQueue, cpus_in_use

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no /proc/thread-self/schedstat (not Linux)")
    before = os.sched_getaffinity(0)
    assert cpus_in_use() == sorted(before)
    rq = RunQueue()
    rq.begin()
    time.sleep(0.05)  # asleep: not waiting for a CPU
    rq.end()
    # Two busy processes on this thread's one CPU: its turns come only after theirs.
    cpu = min(before)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for h in hogs:
            os.sched_setaffinity(h.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.05)
        rq.begin()
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            pass
        rq.end()
    finally:
        os.sched_setaffinity(0, before)
        for h in hogs:
            h.kill()
            h.wait(10)
    assert rq.thread_ns[0] < 20e6, rq.thread_ns  # sleeping is not counted
    assert rq.thread_ns[1] > 50e6, rq.thread_ns  # sharing one CPU with two busy processes is
    assert rq.process_ns[1] >= rq.thread_ns[1]


def test_host_warnings_for_crowded_cpus_and_a_large_delay():
    from zbpipe.bench.host_load import crowding, warnings_for

    hosts = [{"host": "a", "cpus": [0, 1]}] * 4 + [{"host": "b", "cpus": [0, 1, 2, 3]}]
    assert crowding(hosts) == [{"host": "a", "ranks": [0, 1, 2, 3], "cpus": 2}, {"host": "b", "ranks": [4], "cpus": 4}]
    rows = [{"schedule": "1f1b", "ac": False, "gap": 1.12, "runq_ms": 1.5, "runq_rank": 2, "runq_fraction": 0.075},
            {"schedule": "zbv", "ac": False, "gap": 1.01, "runq_ms": 0.1, "runq_rank": 0, "runq_fraction": 0.005}]
    said = warnings_for(rows, hosts)
    assert len(said) == 2, said
    assert said[0].startswith("warning: 4 ranks share 2 CPU(s) on a:")
    assert said[1].startswith("warning: in 1 of 2 runs an executor thread waited for a CPU more than 3% of the "
                              "step (the most: 1f1b, rank 2, 1.50 ms per step, 7.5%)"), said[1]
    assert warnings_for(rows[1:], hosts[4:]) == []


def test_draw_without_matplotlib_fails_before_any_process_starts():
    """A new user's first run: --draw without matplotlib is one line and exit 2, before the
    bench spends its minutes (it used to run everything, then die in a traceback)."""
    import subprocess
    import sys

    from helpers.subprocess_env import NEUTRAL_CWD, child_env

    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import zbpipe.bench.command as c\n"
            "def refuse(cfg): raise SystemExit('a process was started')\n"
            "c.launch = refuse\n"
            "from zbpipe.cli import main; sys.exit(main(['bench', '--pp', '2', '--schedules', '1f1b', "
            "'--draw', 'x.png']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(),
                          cwd=NEUTRAL_CWD, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.strip() == ("zbpipe bench: error: --draw needs matplotlib (pip install matplotlib); "
                                   "nothing was run"), done.stderr


def _simulated_run(name="zbv", pp=4, m=8):
    """What the ranks gather for one run, made from a simulation of `name` (no processes)."""
    import zbpipe

    program = zbpipe.compile(name, pp, m)
    res = zbpipe.simulate(program, f=1e-3, b=1e-3, w=1e-3, comm=1e-4)
    key = (name, "zbpipe", False)
    ranks = [{key: {"last_trace": [], "profile": {}}} for _ in range(pp)]
    for e in res.timeline:
        ranks[e.rank][key]["last_trace"].append(
            {"action": str(e.action), "start_ns": int(e.start * 1e9), "end_ns": int(e.end * 1e9), "wait_ns": 0})
    for s in range(program.num_stages):
        ranks[program.stage_to_rank[s]][key]["profile"][s] = {"f": 1e-3, "i": 1e-3, "w": 1e-3, "b": None}
    row = {"schedule": name, "realized_ms": res.makespan * 1e3, "hop_ms": 0.1, "gap": 1.0}
    return program, {"ranks": ranks}, key, row


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_the_pictures_text_does_not_overlap_and_the_legend_names_both_shades(pp):
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from zbpipe.bench.draw import figure_for_row

    fig = figure_for_row(*_simulated_run("zbv", pp, 2 * pp))
    renderer = FigureCanvasAgg(fig).get_renderer()
    top, bottom = fig.axes
    legend = fig.legends[0]
    assert not _overlaps(legend.get_window_extent(renderer), bottom.xaxis.get_tightbbox(renderer))  # x label, ticks
    assert not _overlaps(bottom.title.get_window_extent(renderer), top.xaxis.get_tightbbox(renderer))
    assert not _overlaps(top.title.get_window_extent(renderer), top.get_window_extent(renderer))
    fig_box = fig.bbox
    for artist in (legend, top.title, bottom.xaxis.label):  # inside the picture
        box = artist.get_window_extent(renderer)
        assert box.y0 >= fig_box.y0 and box.y1 <= fig_box.y1, artist
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["F", "I", "W", "dark: the rank's first stage", "light: its second stage"], labels
