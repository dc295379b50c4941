"""Build-time metadata provider (scikit-build-core's [[tool.dynamic-metadata]]): pins the wheel to
the torch it is compiled against, `Requires-Dist: torch==X.Y.Z`.

zbpipe._C links torch's C++ libraries, whose ABI changes with every release, so a wheel is only
good for the torch it was built against (torchvision and torchaudio pin theirs the same way).
The build runs without isolation (`pip wheel --no-build-isolation`), so the torch installed in
the building interpreter is the one CMake compiles against (CMakeLists.txt records the same
version for `import zbpipe` to check). The sdist pins nothing: a wheel built from it pins the
torch of the machine that builds it, so the field is marked Dynamic there (METADATA 2.2).
"""

from __future__ import annotations

from importlib import metadata


def public_version(version: str) -> str:
    """X.Y.Z of a torch version, without the local label (2.13.0+cpu -> 2.13.0): pip's
    `torch==2.13.0` accepts every local build of that release (+cpu, +cu126, ...)."""
    return version.split("+", 1)[0]


class TorchPin:
    """The provider object: scikit-build-core reports the build state, then asks for the fields."""

    def __init__(self) -> None:
        self._state = "wheel"

    def build_state(self, state: str) -> None:
        self._state = state

    def dynamic_metadata(self, settings, project) -> dict:
        if settings:
            raise RuntimeError(f"torch_pin takes no settings, got {sorted(settings)}")
        if self._state == "sdist":
            return {"dependencies": ["torch"]}
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise RuntimeError(
                "zbpipe compiles against the installed torch, and this interpreter has none: install "
                "torch first, then build with `pip install --no-build-isolation .` (an isolated build "
                "would compile against another torch than the one zbpipe runs with)") from None
        return {"dependencies": [f"torch=={public_version(version)}"]}

    def dynamic_wheel(self, settings) -> dict:
        return {"dependencies": True}  # the sdist's torch is whichever its builder has
