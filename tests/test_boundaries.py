"""Component boundaries: the floors (a component imports only its own
modules and those of lower floors, and no modules import each other in a
circle), no component imports another's private extension, the generic
modules load without TensorFlow, and the installed package carries the
extensions' stubs but not the benchmark-only naive engine."""

from __future__ import annotations

import ast
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
    "serving": "wuliang.serving",
}
# A component imports its own modules and those of lower floors only
# (docs/architecture.md, "Floors").
FLOORS = {
    "wuliang.ps_server": 0,  # the interface, the engine, the version format
    "wuliang.reader": 1,
    "wuliang.embedding": 2,
    "wuliang.serving": 3,
    "wuliang.hooks": 3,
    "wuliang": 4,  # the façade
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
    "wuliang.serving",
    "wuliang.serving.versions",
)


def component_of(module: str) -> str:
    """The component package that a module belongs to (the longest match)."""
    return max(
        (p for p in COMPONENTS.values() if module == p or module.startswith(p + ".")), key=len
    )


def modules() -> dict[str, Path]:
    """Every module of the components, by its installed name."""
    found: dict[str, Path] = {}
    for folder, package in COMPONENTS.items():
        for path in sorted((REPO / folder).rglob("*.py*")):
            if path.suffix not in (".py", ".pyi"):
                continue
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.setdefault(".".join([package, *parts]), path)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the wuliang modules it imports anywhere (at the top, inside
    functions, under TYPE_CHECKING); ``from package import name`` counts as
    importing the submodule when name is one, else the package."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in known else base)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def test_each_component_imports_only_its_own_floor_and_below() -> None:
    offenders = []
    for module, targets in sorted(import_graph().items()):
        floor = FLOORS[component_of(module)]
        for target in sorted(targets):
            owner = component_of(target)
            if owner != component_of(module) and FLOORS[owner] >= floor:
                offenders.append(f"{module} imports {target}")
    assert not offenders, "imports against the floors:\n" + "\n".join(offenders)


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = import_graph()
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph.get(module, ())):
            circle = visit(target)
            if circle:
                return circle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        circle = visit(module)
        assert circle is None, "modules import each other: " + " -> ".join(circle)


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


def test_the_parameter_server_imports_without_grpc() -> None:
    """grpcio is an extra: ``wuliang`` and ``wuliang.ps_server`` import
    without it, and asking for remote servers says what to install."""
    code = (
        "import sys\n"
        "class NoGrpc:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'grpc' or name.startswith(('grpc.', 'grpc_')):\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, NoGrpc())\n"
        "import wuliang, wuliang.ps_server\n"
        "assert not any(m.startswith('grpc') for m in sys.modules), sorted(sys.modules)\n"
        "try:\n"
        "    wuliang.ps_server.parameter_server(['127.0.0.1:7001'])\n"
        "except ImportError as error:\n"
        "    assert \"pip install 'wuliang[remote]'\" in str(error), error\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO / "tests"
    )
    assert done.returncode == 0, done.stderr[-2000:]
