"""`import zbpipe` under another torch than the one its build recorded raises ImportError naming
both versions and the command that rebuilds zbpipe, before it loads _C (which may not even load
under another torch's libraries); a local label (+cpu, +cu126) alone is no mismatch, as for pip's
`torch==X.Y.Z` pin. A zbpipe without its build record says it was not built."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.subprocess_env import NEUTRAL_CWD, child_env

import zbpipe
from zbpipe._build_check import built_torch, check_torch

# Imports zbpipe with its build record replaced (a module in sys.modules wins over the file),
# then reports what the import raised and whether _C was loaded.
FAKED_IMPORT = """
import sys, types
record = {record!r}
if record is None:
    sys.modules["zbpipe._build_info"] = None  # as if the file were missing
else:
    sys.modules["zbpipe._build_info"] = types.SimpleNamespace(TORCH_VERSION=record)
try:
    import zbpipe
    print("imported")
except ImportError as e:
    print("ImportError:", e)
print("_C loaded:", "zbpipe._C" in sys.modules)
"""


def _import_with_record(record: str | None) -> str:
    proc = subprocess.run([sys.executable, "-c", FAKED_IMPORT.format(record=record)], cwd=NEUTRAL_CWD,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_the_build_recorded_the_torch_it_runs_with():
    assert built_torch() == torch.__version__
    assert zbpipe.__version__ == "0.1.0"


def test_another_torch_release_raises_naming_both_and_the_rebuild_command():
    with pytest.raises(ImportError) as e:
        check_torch("2.12.1+cpu", "2.13.0+cu126", "0.1.0")
    text = str(e.value)
    assert "built against torch 2.12.1+cpu" in text and "torch 2.13.0+cu126 is installed" in text, text
    assert "`pip install --no-build-isolation --no-deps --no-binary zbpipe --force-reinstall zbpipe==0.1.0`" in text
    assert "install torch==2.12.1" in text


@pytest.mark.parametrize("built,installed", [("2.13.0+cpu", "2.13.0+cu126"), ("2.13.0", "2.13.0+cpu"),
                                             ("2.14.0.dev20260101+cpu", "2.14.0.dev20260101")])
def test_the_same_release_passes_whatever_its_local_label(built, installed):
    check_torch(built, installed, "0.1.0")


def test_import_under_a_faked_record_fails_before_loading_C():
    other = "2.9.1+cpu"
    out = _import_with_record(other)
    mismatch = f"ImportError: zbpipe was built against torch {other}, but torch {torch.__version__} is installed"
    assert mismatch in out, out
    assert "pip install --no-build-isolation" in out and "_C loaded: False" in out, out
    out = _import_with_record(torch.__version__.split("+")[0] + "+other")  # same release: imports
    assert "imported" in out and "_C loaded: True" in out, out


def test_import_without_a_build_record_says_zbpipe_was_not_built():
    out = _import_with_record(None)
    assert "ImportError: zbpipe/_build_info.py is missing: this zbpipe was not built" in out, out
    assert "_C loaded: False" in out, out
