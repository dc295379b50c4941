"""`import zbpipe` refuses a torch other than the one zbpipe._C was compiled against.

_C links torch's C++ libraries, whose ABI changes with every release: under another torch it
may fail to load, or load and fail later in ways that name neither version. The build records
its torch in zbpipe/_build_info.py (CMakeLists.txt); the wheel pins the same release
(`Requires-Dist: torch==X.Y.Z`, build_support/torch_pin.py). Releases are compared without
their local label (+cpu, +cu126), as pip's pin does.
"""

from __future__ import annotations

# What rebuilds zbpipe from source for the torch that is installed: pip builds the sdist against
# it (no build isolation: an isolated build would compile against another torch).
REBUILD = "pip install --no-build-isolation --no-deps --no-binary zbpipe --force-reinstall zbpipe=={version}"
REBUILD_CHECKOUT = "pip install --no-build-isolation --no-deps ."


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def check_torch(built: str, installed: str, zbpipe_version: str) -> None:
    """Raises ImportError naming both torch versions and the command that rebuilds zbpipe
    when `installed` is another release than `built`."""
    if _release(built) == _release(installed):
        return
    raise ImportError(
        f"zbpipe was built against torch {built}, but torch {installed} is installed: zbpipe's "
        f"compiled part only works with the torch it was compiled against. Rebuild zbpipe for "
        f"torch {installed} with `{REBUILD.format(version=zbpipe_version)}` (from a source "
        f"checkout: `{REBUILD_CHECKOUT}`), or install torch=={_release(built)}."
    )


def built_torch() -> str:
    """The torch version this zbpipe was compiled against (its build's record)."""
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:
        raise ImportError(
            "zbpipe/_build_info.py is missing: this zbpipe was not built (or was built before "
            f"builds recorded their torch). Build it with `{REBUILD_CHECKOUT}`, or for a "
            "development tree `cmake -S . -B build/dev -G Ninja && cmake --build build/dev` "
            "(docs/development.md)."
        ) from None
    return TORCH_VERSION
