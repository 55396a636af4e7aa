"""The installed command line and package layout, run as a user would (subprocesses)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_data import REPO

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


# -- user errors: a message naming the bad value, never a traceback -------------------

BAD_ARGUMENTS = [
    (["demo", "--steps", "0"], "demo", "--steps", "'0'"),
    (["demo", "--steps", "-3"], "demo", "--steps", "'-3'"),
    (["demo", "--batch", "-1"], "demo", "--batch", "'-1'"),
    (["demo", "--batch", "0"], "demo", "--batch", "'0'"),
    (["demo", "--shards", "0"], "demo", "--shards", "'0'"),
    (["demo", "--shards", "5000"], "demo", "--shards", "'5000'"),
    (["datagen", "out", "--rows", "0"], "datagen", "--rows", "'0'"),
    (["datagen", "out", "--rows", "-5"], "datagen", "--rows", "'-5'"),
    (
        ["datagen", "out", "--rows", "9", "--rows-per-file", "0"],
        "datagen",
        "--rows-per-file",
        "'0'",
    ),
    (["datagen", "out", "--rows", "9", "--alpha", "1"], "datagen", "--alpha", "'1'"),
    (["datagen", "out", "--rows", "9", "--alpha", "nan"], "datagen", "--alpha", "'nan'"),
    (["datagen", "out", "--rows", "9", "--alpha", "x"], "datagen", "--alpha", "'x'"),
    (
        ["datagen", "out", "--rows", "9", "--ids-per-field", "0"],
        "datagen",
        "--ids-per-field",
        "'0'",
    ),
    (["datagen", "out", "--rows", "9", "--seed", "-1"], "datagen", "--seed", "'-1'"),
    (
        ["convert", "criteo", "in.tsv", "out", "--rows-per-file", "0"],
        "convert criteo",
        "--rows-per-file",
        "'0'",
    ),
    (
        ["convert", "csv", "in.csv", "out", "--schema", "s.yaml", "--rows-per-file", "-2"],
        "convert csv",
        "--rows-per-file",
        "'-2'",
    ),
    (
        ["convert", "csv", "in.csv", "out", "--schema", "s.yaml", "--delimiter", ";;"],
        "convert csv",
        "--delimiter",
        "';;'",
    ),
]


# -- exit status: 2 for a usage error, 1 for a failure, for every command ---------------

USAGE_ERRORS = [  # (arguments, command, a part of the message)
    (["demo", "--steps", "x"], "demo", "--steps"),
    (["datagen", "out"], "datagen", "--rows"),
    (["convert", "criteo", "in.tsv"], "convert criteo", "out_dir"),
    (["convert", "movielens"], "convert movielens", "input, out_dir"),
    (["convert", "csv", "in.csv", "out"], "convert csv", "--schema"),
    (["export", "--export-dir", "e"], "export", "--model-dir (or --compact)"),
    (["export", "--export-dir", "e", "--full", "--compact"], "export", "not allowed"),
    (["serve"], "serve", "--exports is required (or --redis, or --model-config)"),
    (["serve", "--exports", "e", "--tls-key", "k.pem"], "serve", "--tls-cert and --tls-key"),
    (["serve", "--exports", "e", "--missing", "maybe"], "serve", "--missing"),
    (["ps"], "ps", "--port"),
    (["ps", "--port", "1", "--tls-cert", "c.pem"], "ps", "--tls-cert and --tls-key"),
    (["ps", "--port", "70000"], "ps", "--port"),
    (["publish", "--export-dir", "e"], "publish", "--redis"),
    (["publish", "--export-dir", "e", "--redis", "redis://x", "--retention", "0"], "publish",
     "--retention"),
]  # fmt: skip
FAILURES = [  # (arguments, command, a part of the message): the arguments are fine
    (["datagen", "/dev/null/out", "--rows", "5", "--quiet"], "datagen", "/dev/null/out"),
    (["convert", "criteo", "none.tsv", "out"], "convert criteo", "none.tsv does not exist"),
    (["convert", "movielens", "none", "out"], "convert movielens", "none does not exist"),
    (["convert", "csv", "in.csv", "out", "--schema", "none.yaml"], "convert csv",
     "schema file none.yaml does not exist"),
    (["export", "--model-dir", "none", "--export-dir", "e"], "export",
     "model directory none does not exist"),
    (["ps", "--port", "1", "--token-file", "none"], "ps", "token file none cannot be read"),
    (["serve", "--exports", "none"], "serve", "export directory none does not exist"),
    (["publish", "--export-dir", "none", "--redis", "redis://127.0.0.1:1/0"], "publish",
     "export directory none does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "command", "named"), USAGE_ERRORS, ids=[" ".join(a[0]) for a in USAGE_ERRORS]
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], command: str, named: str) -> None:
    done = run([str(SCRIPT), *args], cwd=str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "usage: wuliang" in done.stderr
    assert_user_error(done, command, named)


@pytest.mark.parametrize(
    ("args", "command", "named"), FAILURES, ids=[" ".join(a[0]) for a in FAILURES]
)
def test_failures_exit_1_with_one_line(
    tmp_path: Path, args: list[str], command: str, named: str
) -> None:
    done = run([str(SCRIPT), *args], cwd=str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert_user_error(done, command, named)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def readme_commands() -> dict[str, str]:
    """The README's command-line summary: the text of each command's entries."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Command line\s+```\n(.*?)```", text, flags=re.S)
    assert block, "the README lost its command-line summary"
    entries: dict[str, str] = {}
    current = ""
    for line in block[1].splitlines():
        if line.startswith("wuliang "):
            words = line.split()
            current = " ".join(words[1:3] if words[1] == "convert" else words[1:2])
        entries[current] = entries.get(current, "") + " " + line
    return entries


def test_the_readme_lists_every_option_of_every_command() -> None:
    from wuliang.cli import build_parser

    entries = readme_commands()
    parser = build_parser()
    commands: dict[str, argparse.ArgumentParser] = {}
    for action in parser._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        name, sub = action
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            for inner, parser_ in nested[0].choices.items():
                commands[f"{name} {inner}"] = parser_
        else:
            commands[name] = sub
    assert set(commands) <= set(entries), set(commands) - set(entries)
    for name, sub in commands.items():
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert re.search(rf"{re.escape(option)}\b", entries[name]), (name, option)
    assert "--version" in entries["--version"]


def assert_user_error(done: subprocess.CompletedProcess[str], command: str, *named: str) -> None:
    """A clean error: non-zero exit, one ``wuliang <command>: error:`` line
    naming what is wrong, no traceback."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"wuliang {command}: error: "), done.stderr
    for text in named:
        assert text in last, done.stderr


@pytest.mark.parametrize(
    ("args", "command", "option", "value"),
    BAD_ARGUMENTS,
    ids=[" ".join(a[0]) for a in BAD_ARGUMENTS],
)
def test_bad_option_values_are_usage_errors(
    tmp_path: Path, args: list[str], command: str, option: str, value: str
) -> None:
    done = run([str(SCRIPT), *args], cwd=str(tmp_path))
    assert done.returncode == 2, done.stderr  # as argparse exits on usage errors
    assert_user_error(done, command, f"argument {option}:", value)
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_datagen_into_an_existing_file_is_an_error(tmp_path: Path) -> None:
    target = tmp_path / "data"
    target.write_text("not a folder")
    done = run([str(SCRIPT), "datagen", str(target), "--rows", "10", "--quiet"])
    assert done.returncode == 1
    assert_user_error(done, "datagen", str(target), "not a directory")
    assert target.read_text() == "not a folder"


def test_datagen_rerun_leaves_no_stale_parts(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "data"
    first = run(
        [str(SCRIPT), "datagen", str(out), "--rows", "50", "--rows-per-file", "10", "--quiet"]
    )
    assert first.returncode == 0, first.stderr
    assert len(list(out.glob("part-*.parquet"))) == 5
    (out / "README.txt").write_text("mine")  # not a name the generator writes
    (out / "part-7.parquet").write_text("not the generator's pattern")
    again = run(
        [str(SCRIPT), "datagen", str(out), "--rows", "30", "--rows-per-file", "15", "--quiet"]
    )
    assert again.returncode == 0, again.stderr
    assert "wrote 30 rows in 2 files" in again.stdout
    parts = sorted(p.name for p in out.glob("part-?????.parquet"))
    assert parts == ["part-00000.parquet", "part-00001.parquet"]  # 00002 ... 00004 removed
    assert sum(pq.read_metadata(out / p).num_rows for p in parts) == 30
    assert (out / "README.txt").read_text() == "mine"
    assert (out / "part-7.parquet").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporaries


def test_export_compact_of_a_missing_folder_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "exports"
    done = run([str(SCRIPT), "export", "--compact", "--export-dir", str(missing)])
    assert done.returncode == 1
    assert_user_error(done, "export", str(missing), "has no export", "no such folder")
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run([str(SCRIPT), "export", "--compact", "--export-dir", str(empty)])
    assert_user_error(done, "export", str(empty), "has no export")
    assert list(empty.iterdir()) == []  # not even a lock file


def test_export_without_a_checkpoint_is_a_clean_error(tmp_path: Path) -> None:
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    model_dir.mkdir()  # a folder without checkpoints (a missing one is named as such)
    done = run([str(SCRIPT), "export", "--model-dir", str(model_dir), "--export-dir", str(exports)])
    assert_user_error(done, "export", "no checkpoint", str(model_dir))
    assert not exports.exists()


HELP_COMMANDS = [
    [],
    ["demo"],
    ["datagen"],
    ["convert"],
    ["convert", "criteo"],
    ["convert", "movielens"],
    ["convert", "csv"],
    ["export"],
    ["serve"],
    ["ps"],
    ["publish"],
]


@pytest.mark.parametrize(
    "command", HELP_COMMANDS, ids=[" ".join(c) or "wuliang" for c in HELP_COMMANDS]
)
def test_help_shows_defaults_and_no_rest_markup(command: list[str]) -> None:
    done = run([str(SCRIPT), *command, "--help"])
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for markup in ("``", ":func:", ":class:", ":meth:", ":mod:", "::"):
        assert markup not in text, f"{markup!r} in the help of {command}:\n{text}"
    defaults = {
        "demo": ["(default: 40)", "(default: 100000)", "(default: 2)"],
        "datagen": ["(default: 100000)", "(default: 1.1)", "(default: 0)"],
        "criteo": ["(default: 1000000)"],
        "csv": ["(default: 1000000)", "(default: ',')"],
        "serve": ["(default: 8500)", "(default: 8501)", "(default: 16777216)"],
        "publish": ["(default: 2)"],
    }.get(command[-1] if command else "", [])
    for default in defaults:
        assert default in " ".join(text.split()), f"{default} missing:\n{text}"
    assert "(default: None)" not in text and "(default: False)" not in text
