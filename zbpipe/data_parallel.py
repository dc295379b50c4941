"""Data parallelism around a pipeline stage: DistributedDataParallel and FSDP2 (fully_shard).

The executor runs a stage's backward itself, one microbatch (and, split, one half) at a time,
so the wrappers' reduction at the end of every backward must wait for the step's last one. A
stage's forwards run with gradient sync off, and the executor calls ``sync_begin`` /
``sync_end`` around the stage's last backward action of the step (its last B or W, see
StageHandle.begin_gradient_sync in csrc/runtime/stage_handle.h):

- DDP: ``sync_begin`` arms the reducer (``prepare_for_backward``, what DDP's forward does when
  sync is on), so the reducer's hooks on the parameters' gradient accumulators reduce the
  accumulated gradients during that action and its final callback averages them at its end.
  With ``deferred_linear`` the Linear weight gradients bypass those accumulators (W writes
  ``.grad``), so the stage's gradients are instead all-reduced explicitly in ``sync_end``.
- FSDP2: the stage is unsharded when the step starts, with resharding and gradient sync off;
  ``sync_end`` runs every parameter group's post-backward with sync on (the reduce-scatter)
  and the root's final callback, then reshards -- what torch.distributed.pipelining does for
  its REDUCE_GRAD action. The stage module itself must be the ``fully_shard``-ed root.
  Under a MixedPrecisionPolicy whose reduce dtype differs from its param dtype (torchtitan's
  bf16 params, fp32 reduce), FSDP's post-backward moves each backward's low-precision gradient
  into a reduce-dtype accumulator. It runs when the module's input gradient is computed, which
  is I under a split schedule, before that microbatch's W: so the adapter moves the gradient at
  every accumulation (a post-accumulate-grad hook on each unsharded parameter), and W's
  gradients of successive microbatches are summed in the reduce dtype, as B's are, not in bf16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # a torch without FSDP2
    FSDPModule, fully_shard = (), None


def adapter_for(module: torch.nn.Module, deferred_linear: bool):
    """The data-parallel adapter of a stage module, or None for a plain module."""
    if isinstance(module, DistributedDataParallel):
        return _DDP(module, deferred_linear)
    if FSDPModule and isinstance(module, FSDPModule):
        return _FSDP(module)
    return None


class _DDP:
    def __init__(self, ddp: DistributedDataParallel, deferred_linear: bool):
        self.ddp = ddp
        self.deferred = deferred_linear
        self.shape_module = ddp.module  # shape inference: no buffer broadcast, no reducer
        self._saved_sync: bool | None = None

    def groups(self) -> list:
        """The process groups the gradient sync runs a collective on."""
        return [self.ddp.process_group]

    def check(self, stage_index: int, split_backward: bool) -> None:
        """Refuses what the reducer cannot do under a pipeline schedule (ValueError)."""
        if self.ddp.static_graph:
            raise ValueError(
                f"stage {stage_index}: DDP(static_graph=True) is not supported: its first "
                "iteration reduces at the end of every backward, and a pipeline step runs one "
                "per microbatch")
        if self.ddp.find_unused_parameters and split_backward and not self.deferred:
            raise ValueError(
                f"stage {stage_index}: DDP(find_unused_parameters=True) needs the stage outputs at "
                "its last backward, but this schedule splits it (the last is a W, run from "
                "captured gradients); use a full-backward schedule or find_unused_parameters=False")
        if self.deferred and self.ddp._comm_hooks:
            raise ValueError(
                f"stage {stage_index}: deferred_linear reduces the stage's gradients with one "
                "all-reduce of its own, so a DDP communication hook would be skipped; remove "
                "the hook or deferred_linear")

    def step_begin(self, training: bool) -> None:
        if training:
            self._saved_sync = self.ddp.require_backward_grad_sync
            self.ddp.require_backward_grad_sync = False  # no_sync's flag, for the forwards

    def step_end(self, failed: bool) -> None:
        if self._saved_sync is not None:
            self.ddp.require_backward_grad_sync = self._saved_sync
            self._saved_sync = None

    def sync_begin(self, roots: list[torch.Tensor]) -> None:
        if self.deferred:
            return
        from torch.nn.parallel.distributed import _find_tensors

        find = self.ddp.find_unused_parameters
        self.ddp.reducer.prepare_for_backward(list(_find_tensors(roots)) if find else [])

    def sync_end(self) -> None:
        if not self.deferred:
            return  # the reducer's final callback ran at the end of the action's backward
        params = [p for p in self.ddp.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        flat.div_(dist.get_world_size(self.ddp.process_group))  # DDP's mean over replicas
        dist.all_reduce(flat, group=self.ddp.process_group)
        for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
            if p.grad is not None:
                p.grad.copy_(g)


class _FSDP:
    def __init__(self, module):
        self.module = module
        self.shape_module = None  # shape inference runs the real (unsharded) module
        self._saved = None
        self._grad_hooks: list = []  # _hold_grads_in_reduce_dtype's, removed at the step's end

    def check(self, stage_index: int, split_backward: bool) -> None:
        pass

    def groups(self) -> list:
        """The process groups the gradient sync runs a collective on: every parameter group's
        shard group (and replicate group under HSDP), once each."""
        out = []
        for m in self._fsdp_modules():
            for pg in m._get_fsdp_state()._fsdp_param_groups:
                for name in ("shard_process_group", "replicate_process_group"):
                    g = getattr(pg.mesh_info, name, None)
                    if g is not None and all(g is not h for h in out):
                        out.append(g)
        return out

    def _fsdp_modules(self):
        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def step_begin(self, training: bool) -> None:
        if not training:
            return
        root = fully_shard.state(self.module)
        root._lazy_init()  # the root's own settings first (it keeps its params after forward)
        saved = {"last": root._state_ctx.is_last_backward, "groups": []}
        for m in self._fsdp_modules():
            state = m._get_fsdp_state()
            saved["groups"].append((state, state._auto_reshard_after_forward, [
                (pg, pg.post_forward_mesh_info, pg.reshard_after_backward, pg.reduce_grads,
                 pg.all_reduce_grads) for pg in state._fsdp_param_groups]))
        self._saved = saved
        self.module.set_reshard_after_forward(False)
        self.module.set_reshard_after_backward(False)
        self.module.set_requires_gradient_sync(False)
        self.module.set_is_last_backward(False)
        handles = [m.unshard(async_op=True) for m in self._fsdp_modules()]
        for h in handles:
            if h is not None:
                h.wait()
        self._hold_grads_in_reduce_dtype()

    def _hold_grads_in_reduce_dtype(self) -> None:
        """What FSDP's post-backward does with sync off (accumulate into the reduce-dtype
        gradient, or start it), after every accumulation into an unsharded parameter: a split
        schedule's W accumulates after the post-backward of its microbatch ran (in I)."""
        for m in self._fsdp_modules():
            for pg in m._get_fsdp_state()._fsdp_param_groups:
                for fp in pg.fsdp_params:
                    if fp.reduce_dtype is None:
                        continue  # no reduce dtype apart from the gradients': FSDP moves nothing

                    def to_reduce_dtype(_param, fp=fp):
                        fp.accumulate_unsharded_grad_if_needed()
                        fp.to_accumulated_grad_if_needed()

                    self._grad_hooks.append(fp.unsharded_param.register_post_accumulate_grad_hook(to_reduce_dtype))

    def _restore(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        saved, self._saved = self._saved, None
        if saved is None:
            return
        for state, auto, groups in saved["groups"]:
            state._auto_reshard_after_forward = auto
            for pg, mesh_info, after_bwd, reduce, all_reduce in groups:
                pg.post_forward_mesh_info = mesh_info
                pg.reshard_after_backward = after_bwd
                pg.reduce_grads, pg.all_reduce_grads = reduce, all_reduce
        fully_shard.state(self.module)._state_ctx.is_last_backward = saved["last"]

    def step_end(self, failed: bool) -> None:
        if failed and self._saved is not None:
            self.module.reset_iter_state()  # waits on pending collectives, reshards
        self._restore()

    def sync_begin(self, roots: list[torch.Tensor]) -> None:
        pass

    def sync_end(self) -> None:
        root = fully_shard.state(self.module)
        self.module.set_is_last_backward(True)
        self.module.set_reshard_after_backward(True)
        self.module.set_requires_gradient_sync(True)
        for state in root._state_ctx.all_states:
            for pg in state._fsdp_param_groups:
                pg.post_backward()  # reduce-scatter of the accumulated unsharded gradients
        root._root_post_backward_final_callback()
        self._restore()
