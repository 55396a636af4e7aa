"""The repository stands on its own: runs from a clone with nothing beside it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from repo_data import MOVIELENS, REPO

# Paths that lead out of a clone: a sibling folder or one machine's layout.
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.~])/(?:work|home|root)/\w")
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".toml", ".txt", ".cc", ".h", ".yaml", ".cfg", ""}


def tracked_files() -> list[str]:
    done = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode == 0 and done.stdout:
        return done.stdout.split()
    skip = {".git", ".venv", "build", "runs", "__pycache__", ".ruff_cache", ".pytest_cache"}
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [os.path.relpath(os.path.join(root, f), REPO) for f in files]
    return found


def test_nothing_refers_to_a_path_outside_the_repository() -> None:
    offenders = []
    for name in tracked_files():
        path = REPO / name
        if path.suffix not in TEXT_SUFFIXES or not path.is_file() or name.endswith(".gz"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_movielens_ships_with_its_license() -> None:
    for name in ("ratings", "movies", "tags", "links"):
        assert (MOVIELENS / f"{name}.csv.gz").is_file(), name
    readme = (MOVIELENS / "README.txt").read_text(encoding="utf-8")
    assert "Usage License" in readme and "redistribute" in readme


def test_a_script_in_the_repository_root_imports_the_installed_package() -> None:
    # The interpreter puts the script's folder (here the repository root) first
    # on sys.path: no folder there may shadow the installed package.
    code = (
        "import wuliang.ps_server, wuliang.reader, wuliang.hooks, wuliang.embedding\n"
        "import wuliang.serving\n"
        "print(wuliang.ps_server.Engine.__module__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "wuliang.ps_server.engine"
    assert not (REPO / "wuliang").exists(), "a folder named wuliang/ shadows the package"


def test_the_image_ships_the_wheel_alone_with_pinned_dependencies() -> None:
    """The Dockerfile compiles in one stage and installs only the wheel in
    the next, under deploy/constraints.txt, which pins every dependency the
    tf and serving extras name (tools/pin_image.py writes it)."""
    stages = re.split(r"(?m)^FROM ", (REPO / "Dockerfile").read_text())[1:]
    assert len(stages) == 2, "a build stage and a runtime stage"
    runtime = stages[1]
    assert "g++" not in runtime and "COPY . " not in runtime, runtime
    assert "constraints.txt" in runtime and "COPY --from=build /wheels" in runtime
    pins = {}
    for line in (REPO / "deploy" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"not pinned: {line!r}"
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    named = list(extras["dependencies"])
    for extra in ("tf", "serving", "remote"):
        named += extras["optional-dependencies"][extra]
    for requirement in named:
        name = re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0]
        if name != "wuliang":
            assert re.sub(r"[-_.]+", "-", name.lower()) in pins, f"{name} is not pinned"
    for tool in ("scikit-build-core", "pybind11", "cmake", "ninja"):
        assert tool in pins, f"the build's {tool} is not pinned"
