"""Environment for tests that run zbpipe in a child process: the child must import the same
zbpipe this test process imported (the installed package in CI, a developer's PYTHONPATH=.
tree with its built _C), from a neutral folder so a source tree without _C cannot shadow it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import zbpipe


def child_env() -> dict:
    pkg_parent = str(Path(zbpipe.__file__).resolve().parent.parent)
    return dict(os.environ, PYTHONPATH=pkg_parent)


NEUTRAL_CWD = tempfile.gettempdir()
