"""The README stays true: its first two commands are the fresh-machine commands CI runs
(`.ci/run`), its links into docs/ (and the docs' own links, anchors included) resolve, every
test or benchmark file the docs (and CHANGELOG.md) cite exists, docs/development.md's layout
map names every directory, and its example runs on two Gloo processes and prints the loss of
one process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.subprocess_env import NEUTRAL_CWD, child_env, free_port


def _repo_root() -> Path:
    """The checkout this test file lives in (found upwards, so the file may move inside tests/)."""
    here = Path(__file__).resolve().parent
    for d in (here, *here.parents):
        if (d / ".ci" / "run").is_file() and (d / "README.md").is_file():
            return d
    raise FileNotFoundError(f"no README.md and .ci/run above {here}")


ROOT = _repo_root()
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Files of other projects the docs name (PyTorch's pipelining tests, ported in test_torch_ports.py).
FOREIGN = {"test_schedule_multiproc.py", "test_schedule.py", "test_pipe.py"}
EXAMPLE_TIMEOUT_S = 240  # about 20 s on a loaded 2-core machine


def _fresh_machine_commands(text: str) -> list[str]:
    """The README's first two code lines (indented blocks), checking nothing code-like precedes them."""
    found = []
    for line in text.splitlines():
        assert not line.startswith("```"), f"a fenced block comes before the two commands: {found}"
        if line.startswith("    ") and line.strip():
            found.append(line.strip())
            if len(found) == 2:
                return found
    raise AssertionError(f"the README has fewer than two indented command lines: {found}")


def test_readme_starts_with_the_two_commands_ci_runs():
    train, test = _fresh_machine_commands(README.read_text())
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if "pip install" in line]
    assert ci == [test], f".ci/run runs {ci}, the README's test command is {test!r}"
    install = test.removesuffix(" && pytest tests")
    assert install != test and train == install + " && zbpipe train", (train, test)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ +(.+)$", text, re.M)}


@pytest.mark.parametrize("page", [README, CHANGELOG, *DOCS], ids=lambda p: p.name)
def test_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.is_file():
            broken.append(f"{target}: no file {dest}")
        elif anchor and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    assert DOCS and not [p.name for p in DOCS if p.resolve() not in linked]


def test_cited_tests_and_benchmarks_exist():
    names = {p.name for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*") if p.is_file()}
    missing = []
    for page in (README, CHANGELOG, *DOCS):
        text = page.read_text()
        for name in set(re.findall(r"\b((?:test|bench)_\w+\.py|nccl_model\w*\.py|gpu_check\.sh)\b", text)):
            if name not in names and name not in FOREIGN:
                missing.append(f"{page.name}: {name}")
        for path in set(re.findall(r"\b((?:tests|benchmarks)/[\w./-]*\w)", text)):
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
    assert not missing, missing


def test_the_development_layout_names_every_directory_and_only_paths_that_exist():
    """docs/development.md's layout map: each path in its first column exists, and it names
    every package of zbpipe/ and every tracked top-level directory."""
    text = (ROOT / "docs" / "development.md").read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    column = [line[4:38] for line in text.splitlines() if line.startswith("    ") and line[4:5].strip()]
    named = {tok.rstrip("/") for entry in column for tok in entry.split() if tok != "+"}
    assert [p for p in named if not list(ROOT.glob(p))] == [], named
    packages = {f"zbpipe/{p.parent.name}" for p in (ROOT / "zbpipe").glob("*/__init__.py")}
    assert packages and packages <= named, packages - named
    try:
        tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked directories are unknown")
    top = {f.split("/")[0] for f in tracked.stdout.splitlines() if "/" in f}
    assert [d for d in top if not any(n == d or n.startswith(d + "/") for n in named)] == [], (top, named)


def _readme_example() -> str:
    section = README.read_text().split("\n## Example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_and_matches_one_process(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_readme_example())
    # Its own session, so the ranks it spawns go down with it on a timeout.
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=NEUTRAL_CWD, env=dict(child_env(), MASTER_PORT=str(free_port())),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the README example ran past {EXAMPLE_TIMEOUT_S} s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
    m = re.search(r"pipelined loss (\S+), one process (\S+)", out)
    assert m, out
    piped, single = float(m.group(1)), float(m.group(2))
    assert 0.0 < single and abs(piped - single) <= 2e-6, (piped, single)
