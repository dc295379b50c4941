"""Data-parallel adapters for tests (zbpipe/data_parallel.py's interface, as its DDP and FSDP2
adapters implement it) whose gradient sync is a test's own: subclasses define sync_end."""

from __future__ import annotations


class CollectiveSync:
    """An adapter of `module` whose only data-parallel group is `group`; every hook but the
    gradient sync's end (sync_end, the subclass's) does nothing."""

    def __init__(self, module, group):
        self.shape_module, self._group, self._module = module, group, module

    def groups(self):
        return [self._group]

    def check(self, stage_index, split_backward):
        pass

    def step_begin(self, training):
        pass

    def step_end(self, failed):
        pass

    def sync_begin(self, roots):
        pass

    def sync_end(self):
        raise NotImplementedError
