"""PyTorch CSV layout: our programs round-trip, load in PyTorch, and PyTorch's load in ours."""

import pytest
from helpers.pytorch_peer import load_csv_lowered

import zbpipe
from zbpipe import Program, ScheduleError


def all_programs(pp=4, m=8):
    for name in zbpipe.schedule_names():
        try:
            yield name, zbpipe.compile(name, pp=pp, microbatches=m)
        except ScheduleError:
            pass


def test_round_trip_every_schedule(tmp_path):
    for name, prog in all_programs():
        path = tmp_path / f"{name}.csv"
        prog.to_csv(str(path))
        back = Program.from_csv(str(path))
        assert (back.pp, back.num_stages, back.microbatches) == (prog.pp, prog.num_stages, prog.microbatches)
        assert back.stage_to_rank == prog.stage_to_rank
        for r in range(prog.pp):
            assert back.actions(r) == prog.actions(r), name


def test_compute_only_csv_is_lowered(tmp_path):
    prog = zbpipe.compile("1f1b", pp=3, microbatches=5)
    path = tmp_path / "c.csv"
    path.write_text("\n".join(",".join(prog.compute_actions(r)) for r in range(3)) + "\n")
    back = Program.from_csv(str(path))
    assert [back.actions(r) for r in range(3)] == [prog.actions(r) for r in range(3)]


def test_ours_load_in_pytorch_with_identical_lowering(tmp_path):
    # Our compute-only rows load in PyTorch's runtime, and its own _add_send_recv lowers them to
    # the same comm placement. The runtime's full lowering also inserts FSDP bookkeeping
    # (UNSHARD/RESHARD/REDUCE_GRAD) that takes lock-step slots and so shifts some RECVs (full-B
    # multi-stage schedules); compare its compute order, and _add_send_recv's exact output.
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv

    fsdp = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
    for name, prog in all_programs():
        if any("OVERLAP" in a for r in range(prog.pp) for a in prog.actions(r)):
            continue  # PyTorch's compute_only CSV loader has no OVERLAP_F_B support
        spr = prog.num_stages // prog.pp
        if spr == 1:
            continue  # PyTorch's runtime loader needs >= 2 stages per rank (mock limitation)
        path = tmp_path / f"{name}.csv"
        path.write_text("\n".join(",".join(prog.compute_actions(r)) for r in range(prog.pp)) + "\n")
        theirs = load_csv_lowered(str(path), prog.pp, spr, prog.microbatches)
        theirs_compute = [[a for a in row if not any(k in a for k in fsdp) and "SEND" not in a
                           and "RECV" not in a] for row in theirs]
        assert theirs_compute == [prog.compute_actions(r) for r in range(prog.pp)], name
        rows = {r: [_Action.from_str(a) for a in prog.compute_actions(r)] for r in range(prog.pp)}
        lowered = _add_send_recv(rows, lambda s: prog.stage_to_rank[s], prog.num_stages)
        assert [[str(a) for a in lowered[r]] for r in range(prog.pp)] == [
            prog.actions(r) for r in range(prog.pp)], name


def test_lowered_csv_loads_in_pytorch_as_compute_comms(tmp_path):
    for name, prog in all_programs():
        spr = prog.num_stages // prog.pp
        if spr == 1:
            continue
        path = tmp_path / f"{name}.csv"
        prog.to_csv(str(path))
        theirs = load_csv_lowered(str(path), prog.pp, spr, prog.microbatches, fmt="compute_comms")
        assert theirs == [prog.actions(r) for r in range(prog.pp)], name


def test_pytorch_csv_loads_in_zbpipe(tmp_path):
    # A schedule written by PyTorch (its Interleaved1F1B, lowered by PyTorch) validates here.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops("Interleaved1F1B", 4, 8, num_stages_per_rank=2, with_comms=True)
    path = tmp_path / "theirs.csv"
    path.write_text("\n".join(",".join(str(a) for a in row if a is not None) for row in ops) + "\n")
    prog = Program.from_csv(str(path))
    assert (prog.pp, prog.num_stages, prog.microbatches) == (4, 8, 8)
    assert prog.stage_to_rank == [0, 1, 2, 3, 0, 1, 2, 3]
    fsdp = ("UNSHARD", "RESHARD", "REDUCE_GRAD")  # dropped on import: zbpipe does not shard
    expected = [str(a) for a in ops[2] if a is not None and not any(k in str(a) for k in fsdp)]
    assert prog.actions(2) == expected


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "no rows"),
        ("0F0,0B0\n0F1,0B1\n", "stage 0 appears on rank 0 and on rank 1"),
        ("0F0,0Q0\n", "CSV line 1"),
        ("0F0,2F0,2B0,0B0\n", "stage 1 never appears"),
    ],
)
def test_bad_csv(text, match):
    with pytest.raises(ScheduleError, match=match):
        Program.from_csv_text(text)
