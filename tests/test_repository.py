"""The repository stands on its own: runs from a clone with nothing beside it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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
