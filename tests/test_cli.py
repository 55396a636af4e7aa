"""The installed command line and package layout, run as a user would (subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "wuliang"


def run(args: list[str], cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


@pytest.mark.parametrize("command", [[str(SCRIPT)], [sys.executable, "-m", "wuliang"]])
def test_demo_prints_json_summary(command: list[str]) -> None:
    assert SCRIPT.exists(), f"console script missing: {SCRIPT}"
    done = run([*command, "demo", "--steps", "3", "--batch", "2000"], cwd="/tmp")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"pull_keys_per_s", "push_keys_per_s", "rows"} <= set(summary)
    assert summary["pull_keys_per_s"] > 0 and summary["push_keys_per_s"] > 0
    assert summary["rows"] > 0
    assert (summary["steps"], summary["batch"]) == (3, 2000)


def test_cli_errors_and_version() -> None:
    done = run([str(SCRIPT), "--version"])
    assert done.returncode == 0 and done.stdout.strip() == "wuliang 0.1.0"
    done = run([str(SCRIPT)])
    assert done.returncode == 2 and "COMMAND" in done.stderr
    done = run([str(SCRIPT), "demo", "--steps", "many"])
    assert done.returncode == 2 and "invalid int value" in done.stderr


# An editable install (`make dev`) puts the source tree on sys.path (the build
# backend's .pth), where `ps_server` is a folder; `make test` installs for real.
@pytest.mark.skipif(
    importlib.util.find_spec("_editable_skbc_wuliang") is not None,
    reason="editable install: the source tree is on sys.path",
)
def test_components_import_only_under_the_wuliang_namespace() -> None:
    code = (
        "import wuliang.ps_server as ps\n"
        "assert ps.Engine.__module__ == 'wuliang.ps_server.engine', ps.Engine.__module__\n"
        "import wuliang, wuliang.optimizers, wuliang.initializers\n"
        "assert wuliang.optimizers.Adam is ps.Adam\n"
        "try:\n"
        "    import ps_server\n"
        "except ModuleNotFoundError as error:\n"
        "    print('missing', error.name)\n"
        "else:\n"
        "    print('found', ps_server.__file__)\n"
    )
    done = run([sys.executable, "-c", code], cwd="/tmp")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "missing ps_server"
