"""StageInterface: what the C++ runtime calls on a stage, as a typing.Protocol. PyStage
(csrc/python/py_stage.cpp) looks each name up on the Python object it wraps and calls it
with the GIL; zbpipe.PipelineStage implements them (zbpipe/stage.py), and a front end that
routes its own values (zbpipe.pipeline) inherits them. The C++ side is runtime::StageHandle
(csrc/runtime/stage_handle.h); `step` is the running step's zbpipe.step_data.StepData.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .step_data import StepData

# (shape, dtype) of one tensor crossing a stage boundary.
Spec = tuple[tuple[int, ...], torch.dtype]


@runtime_checkable
class StageInterface(Protocol):
    """The twelve names PyStage reads: two properties, read once when the executor is built, and
    ten methods it calls in program order."""

    @property
    def _zb_queues_weight_work(self) -> bool:
        """W runs _zb_weight_work (deferred_linear, dw_builder) instead of the graph split."""

    @property
    def _zb_syncs_gradients(self) -> bool:
        """The stage is data-parallel: _zb_grad_sync_begin/_end bracket its last backward."""

    def _zb_forward(self, step: StepData, mb: int, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any, Any]:
        """F of microbatch `mb` on the received `inputs`: (flat outputs, or [loss] on a training
        last stage; the detached loss or None; the kept output or None)."""

    def _zb_weight_work(self, step: StepData, mb: int) -> None:
        """W of a stage that queues its weight work."""

    def _zb_weight_work_queued(self, step: StepData, mb: int) -> None:
        """Right after microbatch mb's backward (B or I)."""

    def _zb_backward_input_done(self, step: StepData, mb: int) -> None:
        """Right after microbatch mb's I, on a step that probes memory."""

    def _zb_before_backward_on_worker(self, step: StepData, mb: int) -> None:
        """Right before microbatch mb's backward goes to the OVERLAP_F_B worker: its
        checkpointed regions recompute here, on the thread that owns the RNG."""

    def _zb_split_fell_back(self, reason: str) -> None:
        """The split backward could not take this stage's graph: it runs fused from now on."""

    def _zb_grad_sync_begin(self, roots: list[torch.Tensor]) -> None:
        """Before the stage's last backward action of the step (its roots)."""

    def _zb_grad_sync_end(self) -> None:
        """After it."""

    def _zb_use_inputs(self, structure: str) -> None:
        """The input structure (zbpipe/_tree.py's string) of a signature agreed earlier."""

    def _zb_infer_outputs(self, step: StepData, specs: list[Spec], structure: str) -> tuple[list[Spec], str]:
        """The handshake: this stage's output signature for the input signature given."""
