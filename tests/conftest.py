"""Shared pytest setup: zbpipe imported once (a missing build fails loudly and early), and the
spawned worlds of the multi-process tests.

Layout (after torch's test/distributed/pipelining): core/ the torch-free schedule core (IR,
builders, passes, simulator), runtime/ the C++ executor over c10d, frontend/ the Python API
(schedule classes, stages, torch's own tests ported), tools/ the CLI, the trainer, the launcher,
the benchmarks and the docs; helpers/ holds what they share (model_registry, schedule_registry,
asserts, ...), imported as `helpers.<name>` (this folder is on sys.path under pytest).
"""

from __future__ import annotations

import pytest

import zbpipe  # noqa: F401
from zbpipe.train.launcher import LocalWorld

WORLD_PG_TIMEOUT_S = 60.0  # a collective of a test waits at most this long


@pytest.fixture(scope="module")
def spawn_world():
    """world(size, gloo_devices=1) -> this module's LocalWorld of `size` ranks (Gloo on
    127.0.0.1, one torch thread each), started by its first run and shared by the module's
    tests: world.run(fn, *args, timeout_s=...) calls fn(rank, size, *args) on every rank and
    returns their results. A run that fails stops the world and the next run starts a new one.
    Every world of the module is stopped after its last test."""
    worlds: dict[tuple[int, int], LocalWorld] = {}

    def world(size: int, gloo_devices: int = 1) -> LocalWorld:
        key = (size, gloo_devices)
        if key not in worlds:
            worlds[key] = LocalWorld(size, gloo_devices=gloo_devices, pg_timeout_s=WORLD_PG_TIMEOUT_S)
        return worlds[key]

    yield world
    for w in worlds.values():
        w.close()
