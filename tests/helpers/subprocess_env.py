"""Environment for tests that run zbpipe in a child process: the child must import the same
zbpipe this test process imported (the installed package in CI, a developer's PYTHONPATH=.
tree with its built _C), from a neutral folder so a source tree without _C cannot shadow it;
and a free port for a child that rendezvous over TCP."""

from __future__ import annotations

import os
import socket
import tempfile
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
