"""Access to torch.distributed.pipelining's schedule machinery without processes: mock stages
the way its own _schedule_visualizer does, so tests and benchmarks can compare programs."""

from __future__ import annotations

from unittest import mock

from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import PipelineStage


def mock_stages(pp: int, stages_per_rank: int):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = pp
    stage.submod = None
    stage.num_stages = pp * stages_per_rank
    return [stage for _ in range(stages_per_rank)]


def load_csv_lowered(path: str, pp: int, stages_per_rank: int, microbatches: int,
                     fmt: str = "compute_only") -> list[list[str]]:
    """PyTorch's own CSV loader (+ its lowering for compute_only); actions per rank as strings."""
    runtime = _PipelineScheduleRuntime(mock_stages(pp, stages_per_rank), microbatches)
    runtime._load_csv(path, format=fmt)
    return [[str(a) for a in runtime.pipeline_order_with_comms[r]] for r in range(pp)]
