"""Component boundaries: no component imports another's private extension,
the generic modules load without TensorFlow, and the installed package
carries the extensions' stubs but not the benchmark-only naive engine."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_data import REPO

# folder -> the sub-package it installs as (pyproject.toml)
COMPONENTS = {
    "src/wuliang": "wuliang",
    "ps_server": "wuliang.ps_server",
    "reader": "wuliang.reader",
    "embedding": "wuliang.embedding",
    "hooks": "wuliang.hooks",
}
# `from wuliang.x import _y`, `from wuliang.x._y import ...`, `import wuliang.x._y`
PRIVATE_IMPORT = re.compile(
    r"^\s*(?:from\s+(wuliang(?:\.\w+)*)\s+import\s+(_\w+)"
    r"|from\s+(wuliang(?:\.\w+)*)\.(_\w+)\s+import"
    r"|import\s+(wuliang(?:\.\w+)*)\.(_\w+))",
    re.MULTILINE,
)
# Importing these must not import TensorFlow.
TF_FREE = (
    "wuliang",
    "wuliang.pipeline",
    "wuliang.ps_server",
    "wuliang.reader",
    "wuliang.checkpoint",
    "wuliang.export",
    "wuliang.embedding",
    "wuliang.embedding.kernels",
)


def component_of(module: str) -> str:
    """The component package that a module belongs to (the longest match)."""
    return max(
        (p for p in COMPONENTS.values() if module == p or module.startswith(p + ".")), key=len
    )


def test_no_component_imports_another_components_private_modules() -> None:
    offenders = []
    for folder, package in COMPONENTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            for match in PRIVATE_IMPORT.finditer(path.read_text(encoding="utf-8")):
                groups = [g for g in match.groups() if g]
                owner, private = groups[0], groups[1]
                if component_of(owner) != package:
                    offenders.append(f"{path.relative_to(REPO)}: {owner}.{private}")
    assert not offenders, "private modules of another component:\n" + "\n".join(offenders)


@pytest.mark.parametrize("module", TF_FREE)
def test_module_imports_without_tensorflow(module: str) -> None:
    code = f"import sys, {module}\nassert 'tensorflow' not in sys.modules, sorted(sys.modules)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO / "tests"
    )
    assert done.returncode == 0, f"{module} imports TensorFlow:\n{done.stderr[-2000:]}"


@pytest.mark.parametrize(
    "extension",
    ["wuliang.ps_server._engine", "wuliang.reader._reader", "wuliang.embedding._embedding"],
)
def test_extensions_are_installed_with_their_stubs(extension: str) -> None:
    path = Path(importlib.import_module(extension).__file__)
    assert (path.parent / (extension.rsplit(".", 1)[1] + ".pyi")).is_file(), path


def test_the_engine_extension_has_no_naive_engine() -> None:
    from wuliang.ps_server import _engine

    assert not hasattr(_engine, "NaiveEngine")
