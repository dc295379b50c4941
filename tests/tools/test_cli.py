"""The zbpipe command line: output on small cases, one-line errors with exit status 2, the
PNG of `draw` (schedule and Chrome trace), and `python -m zbpipe` in a subprocess."""

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.subprocess_env import NEUTRAL_CWD, child_env

import zbpipe
from zbpipe.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plan_grid_1f1b(capsys):
    code, out, _ = run(capsys, "plan", "1f1b", "--pp", "2", "--microbatches", "3")
    assert code == 0
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("rank ")}
    # Unit costs: rank 0 runs F0 F1, waits for B0's gradient (F0, B0 on rank 1 = 3 slots)...
    assert rows["0"].split()[2:] == ["F0", "F1", ".", ".", "B0---", "F2", "B1---", ".", "B2---"]
    assert rows["1"].split()[2:] == [".", "F0", "B0---", "F1", "B1---", "F2", "B2---"]
    assert "bubble rate: 0.2500" in out  # (p-1)/(m+p-1)
    assert "peak activations per rank: [2, 1]" in out


def test_plan_v_schedule_marks_second_stage_and_memory_units(capsys):
    code, out, _ = run(capsys, "plan", "v_min", "--pp", "4", "-m", "8")
    assert code == 0
    rank0 = next(line for line in out.splitlines() if line.startswith("rank 0"))
    assert "F0" in rank0 and "f0" in rank0 and "i0" in rank0 and "W0" in rank0
    prog = zbpipe.compile("v_min", 4, 8)
    peaks = list(zbpipe.simulate(prog, 1, 1, 1).peak_activations)
    assert f"{peaks} (stage, microbatch) units = {[p / 2 for p in peaks]} 1F1B-mb" in out


def test_simulate_numbers_match_the_api(capsys):
    code, out, _ = run(capsys, "simulate", "zb_h1", "--pp", "4", "-m", "8", "--f", "1,2,1,1",
                       "--b", "1.5", "--w", "0.5", "--comm", "0.25")
    assert code == 0
    res = zbpipe.simulate(zbpipe.compile("zb_h1", 4, 8), [1, 2, 1, 1], 1.5, 0.5, 0.25)
    assert f"makespan: {res.makespan:.4f}" in out
    assert f"bubble rate: {res.bubble_rate:.4f}" in out


def test_simulate_scales_costs_for_more_stages_per_rank(capsys):
    # zbv runs each 1F1B-stage slice as 2 stages of half the cost; --raw-costs does not.
    _, scaled, _ = run(capsys, "simulate", "zbv", "--pp", "2", "-m", "4", "--f", "2,4")
    code, _, err = run(capsys, "simulate", "zbv", "--pp", "2", "-m", "4", "--f", "2,4", "--raw-costs")
    assert "f=[1.0, 1.0, 2.0, 2.0]" in scaled
    res = zbpipe.simulate(zbpipe.compile("zbv", 2, 4), [1.0, 1.0, 2.0, 2.0], 0.5, 0.5)
    assert f"makespan: {res.makespan:.4f}" in scaled
    assert code == 2 and "one per stage (4), got 2" in err  # raw lists: one value per stage


def test_compare_lists_every_schedule_that_accepts(capsys):
    code, out, _ = run(capsys, "simulate", "--compare", "--pp", "4", "-m", "8", "--memory-cap", "7")
    assert code == 0
    listed = {line.split()[0] for line in out.splitlines()[2:] if not line.startswith("skipped")}
    skipped = {line.split()[1] for line in out.splitlines() if line.startswith("skipped")}
    assert listed | skipped == set(zbpipe.schedule_names())
    assert {"1f1b", "zb_h1", "zb_h2", "zbv", "zb_auto", "v_half", "v_min"} <= listed
    auto = next(line for line in out.splitlines() if line.startswith("zb_auto"))
    assert float(auto.split()[3]) == pytest.approx(0.0, abs=1e-4)  # cap 7 = 2p-1: no bubble


@pytest.mark.parametrize("argv,needle", [
    (["plan", "nope", "--pp", "2", "-m", "2"], "unknown schedule 'nope' (valid: "),
    (["plan", "1f1b", "--pp", "0", "-m", "2"], "--pp: expected a positive integer"),
    (["plan", "1f1b", "-m", "2"], "--pp is required"),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--f", "x"], "--f: expected a number"),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--f", "1,2,3"], "--f needs 1 value"),
    # a V rank's cap holds at least one microbatch of both its stages (--mem-f's units).
    (["simulate", "v_half", "--pp", "4", "-m", "8", "--memory-cap", "0.9"], "v_half needs memory_cap >= 1 on rank 0"),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--memory-cap", "0"], "expected a positive number"),
    (["plan", "zb_auto", "--pp", "2", "-m", "2", "--memory-cap", "inf"], "expected a positive number"),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--mem-f", "1,2,3"], "--mem-f needs 1 value"),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--mem-w", "2"], "mem_w"),
    (["frobnicate"], "invalid choice"),
    (["draw", "1f1b", "--pp", "2", "-m", "2"], "-o/--output"),
    (["draw", "--trace", "/nonexistent/trace.json", "-o", "x.png"], "cannot read trace"),
    (["simulate", "zbv", "--pp", "2", "-m", "4", "--f", "inf"], "--f: costs must be finite"),
    (["simulate", "zbv", "--pp", "2", "-m", "4", "--b", "1,nan"], "--b: costs must be finite"),
    (["simulate", "zbv", "--pp", "2", "-m", "4", "--comm", "inf"], "--comm: costs must be finite"),
    (["draw", "1f1b", "--pp", "2", "-m", "2", "-o", "/nonexistent/x.png"],
     "cannot write '/nonexistent/x.png': no directory '/nonexistent'"),
    (["draw", "1f1b", "--pp", "2", "-m", "2", "-o", "x.notaformat"], "cannot write 'x.notaformat'"),
    (["plan", "PipelineScheduleSingle", "--pp", "2", "-m", "2"], "is a base class, not a schedule"),
    (["plan", "v_min", "--pp", "4", "-m", "8", "--memory-cap", "0.5"], "v_min needs memory_cap >= 1 on rank 0"),
])
def test_user_errors_are_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zbpipe: error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_plan_takes_a_memory_cap(capsys):
    code, capped, _ = run(capsys, "plan", "zb_auto", "--pp", "4", "-m", "8", "--memory-cap", "4")
    assert code == 0
    _, free, _ = run(capsys, "plan", "zb_auto", "--pp", "4", "-m", "8", "--memory-cap", "7")
    peaks = list(zbpipe.simulate(zbpipe.compile("zb_auto", 4, 8, memory_cap=4)).peak_activations)
    assert max(peaks) <= 4 and f"peak activations per rank: {peaks}" in capped
    assert capped != free  # the cap reached the compiler


def peak_memory_line(out):
    return next(line for line in out.splitlines() if line.startswith("peak memory per rank: "))


def test_simulate_takes_the_memory_model(capsys):
    # --mem-f (per stage) and --mem-w reach the simulator: F holds mem_f, I frees mem_f - mem_w.
    argv = ("simulate", "zb_h1", "--pp", "4", "-m", "8", "--mem-f", "2,1,1,1", "--mem-w", "0.5")
    code, out, _ = run(capsys, *argv)
    assert code == 0
    res = zbpipe.simulate(zbpipe.compile("zb_h1", 4, 8), mem_f=[2, 1, 1, 1], mem_w=0.5)
    assert peak_memory_line(out) == f"peak memory per rank: {list(res.peak_memory)} (--mem-f's units)"
    # Rank 1 holds 3 forwards, its first I frees half of one, its fourth F comes: 3.5, not 4.
    assert list(res.peak_memory) == [8.0, 3.5, 3.0, 2.5]
    _, whole, _ = run(capsys, *argv[:-2])  # no --mem-w: I frees nothing
    assert peak_memory_line(whole) == "peak memory per rank: [8.0, 4.0, 4.0, 4.0] (--mem-f's units)"


def test_memory_cap_is_in_mem_f_units_and_the_model_reaches_the_compiler(capsys):
    # zb_auto under a cap of 6 at mem_f=2: 3 forwards; with I freeing 3/4 of each (mem_w=0.5),
    # the same cap holds a fourth, and the bubble drops.
    base = ("plan", "zb_auto", "--pp", "4", "-m", "8", "--mem-f", "2", "--memory-cap", "6")
    code, capped, _ = run(capsys, *base)
    assert code == 0
    prog = zbpipe.compile("zb_auto", 4, 8, mem_f=2.0, memory_cap=6)
    res = zbpipe.simulate(prog, mem_f=2.0)
    assert max(res.peak_activations) == 3 and f"bubble rate: {res.bubble_rate:.4f}" in capped
    assert peak_memory_line(capped) == f"peak memory per rank: {list(res.peak_memory)} (--mem-f's units)"
    _, split, _ = run(capsys, *base, "--mem-w", "0.5")
    freed = zbpipe.compile("zb_auto", 4, 8, mem_f=2.0, mem_w=0.5, memory_cap=6)
    res = zbpipe.simulate(freed, mem_f=2.0, mem_w=0.5)
    assert max(res.peak_activations) == 4 and max(res.peak_memory) <= 6
    assert f"bubble rate: {res.bubble_rate:.4f}" in split and res.bubble_rate < 0.25 - 0.02
    assert peak_memory_line(split) == f"peak memory per rank: {list(res.peak_memory)} (--mem-f's units)"
    # A V schedule's mem_f is split over its two stages: v_half's cap at pp=4 is 3 1F1B
    # microbatches of --mem-f, 6 with it per schedule stage (--raw-costs).
    assert run(capsys, "simulate", "v_half", "--pp", "4", "-m", "8", "--memory-cap", "3")[0] == 0
    assert run(capsys, "simulate", "v_half", "--pp", "4", "-m", "8", "--memory-cap", "6",
               "--raw-costs")[0] == 0


def test_the_paper_cell_of_docs_cli(capsys):
    # docs/cli.md: the Zero Bubble paper's 1.5B costs and memory model (M_B = 34h + 5as,
    # M_W = 32h, h=2304, a=24, s=1024) at cap 2p * M_B give Table 5's ZB-2p figure.
    code, out, _ = run(capsys, "simulate", "zb_auto", "--pp", "8", "-m", "24", "--f", "18.522",
                       "--b", "18.086", "--w", "9.337", "--comm", "0.601", "--mem-f", "201216",
                       "--mem-w", "73728", "--memory-cap", "3219456")
    assert code == 0 and "bubble rate: 0.0433 " in out


def test_compare_and_draw_take_the_memory_model(tmp_path, capsys):
    code, out, _ = run(capsys, "simulate", "--compare", "--pp", "4", "-m", "8", "--mem-w", "0.5")
    assert code == 0 and "mem_f=[1.0] mem_w=[0.5]" in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.startswith("zb_h1 "))
    res = zbpipe.simulate(zbpipe.compile("zb_h1", 4, 8), mem_w=0.5)
    assert float(row.split()[-1]) == pytest.approx(max(res.peak_memory), abs=5e-3)
    png = tmp_path / "v.png"
    code, out, _ = run(capsys, "draw", "zb_auto", "--pp", "4", "-m", "8", "--mem-f", "2",
                       "--mem-w", "0.5", "--memory-cap", "6", "-o", str(png), "--size", "300x200")
    assert code == 0 and png_size(png) == (300, 200)
    prog = zbpipe.compile("zb_auto", 4, 8, mem_f=2.0, mem_w=0.5, memory_cap=6)
    peaks = list(zbpipe.simulate(prog, mem_f=2.0, mem_w=0.5).peak_memory)
    assert peak_memory_line(out) == f"peak memory per rank: {peaks} (--mem-f's units)"


@pytest.mark.parametrize("torch_name,ours", [("ZBVZeroBubble", "zbv"), ("ScheduleInterleaved1F1B", "interleaved_1f1b"),
                                             ("1F1B", "1f1b"), ("DualPipeV", "dualpipev")])
def test_pytorch_schedule_names_are_accepted(capsys, torch_name, ours):
    argv = ["--pp", "2", "-m", "4"]
    code, out, err = run(capsys, "plan", torch_name, *argv)
    assert code == 0, err
    assert out == run(capsys, "plan", ours, *argv)[1]
    code, out, _ = run(capsys, "simulate", torch_name, *argv, "--f", "2")
    assert code == 0 and out == run(capsys, "simulate", ours, *argv, "--f", "2")[1]


def test_train_errors_and_help(capsys):
    code, _, err = run(capsys, "train", "--batch-size", "0")
    assert code == 2 and "--batch-size must be >= 1" in err
    assert "Traceback" not in err
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0
    text = " ".join(out.split())  # argparse wraps lines
    for name in ("zb_auto", "v_half", "v_min"):
        assert name in text.split("--schedule {")[1].split("}")[0]
    for default in ("pipeline schedule (default: zbv)", "microbatches per step (default: 8)",
                    "(whole batch) (default: 32)", "training steps (default: 300)", "(default: 0.003)"):
        assert default in text, default


def test_unknown_schedule_lists_all_valid_names(capsys):
    _, _, err = run(capsys, "simulate", "zb_h3", "--pp", "2", "-m", "2")
    for name in zbpipe.schedule_names():
        assert name in err


def test_draw_schedule_png(tmp_path, capsys):
    out = tmp_path / "sched.png"
    code, stdout, _ = run(capsys, "draw", "zbv", "--pp", "4", "-m", "8", "--comm", "0.1",
                          "-o", str(out), "--size", "900x300")
    assert code == 0 and f"wrote {out}" in stdout
    assert png_size(out) == (900, 300)
    assert out.stat().st_size > 5000  # drawn, not blank


def test_draw_trace_png(tmp_path, capsys):
    # The runtime's format: complete events named by action strings, us, pid/tid = rank.
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}]
    t = 0.0
    for mb in range(3):
        for rank, act, dur in ((0, f"0F{mb}", 10), (0, f"0SEND_F{mb}", 2), (1, f"1RECV_F{mb}", 2),
                               (1, f"1F{mb}", 10), (1, f"1B{mb}", 20), (0, f"0B{mb}", 20)):
            events.append({"name": act, "ph": "X", "ts": t, "dur": dur, "pid": rank, "tid": rank})
            t += dur
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "trace.png"
    code, _, _ = run(capsys, "draw", "--trace", str(trace), "-o", str(out))
    assert code == 0
    assert png_size(out) == (1600, 120 + 60 * 2)
    # A file with no action-named events is a user error.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "step", "ph": "X", "ts": 0, "dur": 1, "pid": 0}]))
    code, _, err = run(capsys, "draw", "--trace", str(bad), "-o", str(out))
    assert code == 2 and "no events named by schedule actions" in err


def test_draw_runtime_trace_lanes(tmp_path, capsys):
    # zbpipe's runtime: pid = rank, tid 0 host / tid 1 device (different time bases), comm
    # batches named "A+B". The host lane is drawn unless --trace-tid picks another.
    events = []
    for rank in range(3):
        t = 1e6 + 10 * rank  # host clock: large absolute microseconds
        for name, dur in ((f"{rank}F0", 5), (f"{rank}SEND_F0+{rank}RECV_B0", 1), (f"{rank}B0", 9)):
            events.append({"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": t, "dur": dur})
            events.append({"name": name, "ph": "X", "pid": rank, "tid": 1, "ts": t - 1e6, "dur": dur})
            t += dur
    trace = tmp_path / "runtime.json"
    trace.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    from zbpipe import plot

    host = plot.load_trace(str(trace))
    assert {b.rank for b in host} == {0, 1, 2} and len(host) == 9
    assert max(b.end for b in host) == pytest.approx((20 + 15) / 1e3)  # ms from the first event
    assert sorted({b.kind for b in host}) == ["B", "COMM", "F"]
    device = plot.load_trace(str(trace), lane=1)
    assert len(device) == 9
    out = tmp_path / "lane1.png"
    code, _, _ = run(capsys, "draw", "--trace", str(trace), "--trace-tid", "1", "-o", str(out))
    assert code == 0 and png_size(out) == (1600, 120 + 60 * 3)
    code, _, err = run(capsys, "draw", "--trace", str(trace), "--trace-tid", "7", "-o", str(out))
    assert code == 2 and "on tid 7" in err


def test_train_is_absent_or_forwarded(capsys):
    from zbpipe import cli

    code, _, err = run(capsys, "train", "--help")
    if cli._has_train():
        assert "invalid choice" not in err
    else:
        assert code == 2 and "invalid choice: 'train'" in err


def test_python_dash_m_subprocess():
    env, neutral = child_env(), NEUTRAL_CWD
    ok = subprocess.run([sys.executable, "-m", "zbpipe", "plan", "zb_h1", "--pp", "3", "-m", "4"],
                        capture_output=True, text=True, env=env, cwd=neutral, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"^rank 2 ", ok.stdout, re.M)
    bad = subprocess.run([sys.executable, "-m", "zbpipe", "plan", "nope", "--pp", "2", "-m", "2"],
                         capture_output=True, text=True, env=env, cwd=neutral, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.startswith("zbpipe: error: unknown schedule 'nope'")
    assert "Traceback" not in bad.stderr


def test_bench_is_listed_and_forwarded(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "bench" in out and "emulated devices" in " ".join(out.split())
    code, out, _ = run(capsys, "bench", "--help")
    assert code == 0 and "--microbatches" in out and "--draw PATH" in out and "torchrun" in out
    code, _, err = run(capsys, "bench", "--pp", "2", "--i", "0")  # refused before any process starts
    assert code == 2 and err.startswith("zbpipe bench: error: --i: every time must be a positive number")
    assert "Traceback" not in err


def test_the_schedule_picture_names_both_shades_of_a_v_and_keeps_its_text_apart():
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from zbpipe.plot import figure, program_boxes

    for name, shaded in (("zbv", True), ("1f1b", False)):
        prog = zbpipe.compile(name, 4, 8)
        boxes, arrows = program_boxes(prog, zbpipe.simulate(prog, comm=0.1), 0.1)
        fig = figure(boxes, arrows, 4, title=name)
        renderer = FigureCanvasAgg(fig).get_renderer()
        legend, ax = fig.legends[0], fig.axes[0]
        labels = [t.get_text() for t in legend.get_texts()]
        shades = ["dark: the rank's first stage", "light: its second stage"]
        assert (labels[-3:-1] == shades) if shaded else not set(shades) & set(labels), (name, labels)
        a, b = legend.get_window_extent(renderer), ax.xaxis.get_tightbbox(renderer)
        assert not (a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1), name


def test_one_parser_tree_one_error_class(capsys):
    """Every subcommand is a module's add_arguments + run_command in zbpipe.cli's one tree, and
    every user error is a CliError: one line, the train's too (its own argparse parser printed
    the usage first)."""
    import zbpipe.bench.command as bench_command
    import zbpipe.schedule_commands as schedule_commands
    from zbpipe import cli
    from zbpipe.bench import BenchError

    tree = cli.build_parser()._subparsers._group_actions[0].choices
    commands = cli.subcommands()
    assert list(tree) == list(commands) and {"plan", "simulate", "draw", "bench"} <= set(tree)
    assert commands["bench"].run_command is bench_command.run_command
    assert commands["plan"].add_arguments is schedule_commands.add_plan_arguments
    assert issubclass(BenchError, cli.CliError)
    if "train" in commands:
        import importlib

        train_main = importlib.import_module("zbpipe.train.main")  # zbpipe.train.main is also its main()
        assert commands["train"].run_command is train_main.run_command
        code, _, err = run(capsys, "train", "--batch-size", "0")
        assert code == 2 and err == "zbpipe train: error: --pp, --dp, --microbatches, --steps and --batch-size " \
                                    "must be >= 1\n", err
    for argv, prog in ((["bench", "--bogus"], "zbpipe bench"), (["plan", "zb_h1", "--bogus"], "zbpipe")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and err == f"{prog}: error: unrecognized arguments: --bogus\n", err


def test_the_launcher_is_zbpipe_launch_and_its_old_path_works():
    import zbpipe.launch
    import zbpipe.train.launcher

    for name in ("LocalWorld", "RankFailure", "rank_device", "run_local"):
        assert getattr(zbpipe.train.launcher, name) is getattr(zbpipe.launch, name)
    assert zbpipe.launch.LocalWorld.__module__ == "zbpipe.launch"
