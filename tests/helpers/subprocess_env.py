"""Environment for tests that run zbpipe in a child process: the child must import the same
zbpipe this test process imported (the installed package in CI, a developer's PYTHONPATH=.
tree with its built _C), from a neutral folder so a source tree without _C cannot shadow it;
a free port for a child that rendezvous over TCP; one worker process per rank, and a wait for
a file one of them writes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zbpipe


def child_env() -> dict:
    pkg_parent = str(Path(zbpipe.__file__).resolve().parent.parent)
    return dict(os.environ, PYTHONPATH=pkg_parent)


NEUTRAL_CWD = tempfile.gettempdir()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a child that rendezvous through MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rank_workers(script_text: str, tmp_path: Path, ranks: int, *args: str):
    """One child process per rank running `script_text` (written to tmp_path/worker.py) with
    argv [rank, tmp_path, *args], under child_env() from NEUTRAL_CWD; yields the processes and
    kills those still running when the block ends."""
    script = Path(tmp_path) / "worker.py"
    script.write_text(script_text)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path), *args], env=child_env(),
                              cwd=NEUTRAL_CWD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(ranks)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for_file(path: Path, procs, deadline: float) -> None:
    """Until `path` exists: AssertionError past `deadline` (time.monotonic()) or once one of
    `procs` crashed (a worker that finished, exit 0, is fine)."""
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear (ranks: {[p.poll() for p in procs]})"
        assert all(p.poll() in (None, 0) for p in procs), [p.poll() for p in procs]
        time.sleep(0.02)
