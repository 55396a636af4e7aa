"""A/B of two builds of the repository: ``python benchmarks/ab.py REV [--
BENCH ARGS]``.

Builds revision REV (any name ``git rev-parse`` takes) into a folder of its
own under ``--cache`` (its sources from ``git archive``, its CMake build
directory kept there, so a second run rebuilds nothing), and the working
tree (or ``--against REV2``) the same way; then runs one benchmark script
(``--bench``, default ``benchmarks/ps_bench.py --skip-naive``; the working
tree's copy for both builds, so both print the same keys) against each
build in turn for ``--rounds`` rounds, the order swapped every round (A B,
B A, ...) so that the machine's drift falls on both alike. Each run's last
line is its JSON (nested objects' keys joined with dots); for every numeric
key both builds print the script gives
the median of each build, their spread (lowest and highest) and B's median
over A's. Rates swing with the machine; keys ending in ``cpu_ns_per_key``
(``ps_bench.py`` prints them: the process's CPU time over the keys of the
best pass) are steadier on a shared machine.

Last line: JSON ``{"a": REV, "b": ..., "rounds": N, "keys": {key: {...}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wuliang-ab"


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def sources(rev: str | None, cache: Path) -> tuple[str, Path]:
    """(a name, the source folder) of a revision, unpacked once into the
    cache; the working tree itself for None."""
    if rev is None:
        return "working tree", REPO
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    folder = cache / f"src-{sha[:12]}"
    if not (folder / "pyproject.toml").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as archive:
            subprocess.run(["git", "-C", str(REPO), "archive", sha], stdout=archive, check=True)
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(folder, filter="data")
    return f"{rev} ({sha[:12]})", folder


def build(source: Path, site: Path) -> None:
    """Installs the package of ``source`` (without its dependencies: the
    running environment has them) into ``site``; the source's CMake build
    folder keeps what was compiled."""
    print(f"building {source} into {site}", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
         "--target", str(site), str(source)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"building {source} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def environment(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def check_import(site: Path) -> None:
    """The build's wuliang is the one a run imports (not the environment's)."""
    code = "import wuliang.ps_server._engine as e; print(e.__file__)"
    done = subprocess.run([sys.executable, "-c", code], env=environment(site),
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip().startswith(str(site)):
        raise SystemExit(
            f"{site}: its build is not what Python imports: {done.stdout}{done.stderr}"
        )


def run(bench: list[str], site: Path) -> dict[str, Any]:
    """One run of the benchmark against a build: its last line's JSON."""
    done = subprocess.run([sys.executable, *bench], env=environment(site), capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(bench)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return flat(json.loads(lines[-1]))


def flat(result: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects' keys joined with dots (``train_bench.py`` prints
    ``{"adagrad": {"step_vs_bound": ...}}``: ``adagrad.step_vs_bound``)."""
    out: dict[str, Any] = {}
    for key, value in result.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def summary(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) \
        if "--" in argv else (argv, None)  # fmt: skip
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev", help="revision A (a commit, tag or branch)")
    p.add_argument("--against", help="revision B (default: the working tree)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--bench", default="benchmarks/ps_bench.py", help="the script, from the tree")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = p.parse_args(ours)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if bench_args is None:
        bench_args = ["--skip-naive"] if args.bench.endswith("ps_bench.py") else []
    script = (REPO / args.bench).resolve()
    if not script.is_file():
        p.error(f"--bench {args.bench}: no such script in the working tree")
    sides = []
    for rev, label in ((args.rev, "a"), (args.against, "b")):
        name, source = sources(rev, args.cache)
        site = args.cache / ("site-" + (source.name if rev is not None else "working-tree"))
        build(source, site)
        check_import(site)
        sides.append((label, name, site))
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    bench = [str(script), *bench_args]
    for r in range(args.rounds):
        for label, name, site in sides if r % 2 == 0 else sides[::-1]:
            result = run(bench, site)
            runs[label].append(result)
            shown = {k: v for k, v in result.items() if "per_s" in k or "per_key" in k}
            print(f"round {r + 1} {label} ({name}): {json.dumps(shown)}", flush=True)
    keys = [
        k for k, v in runs["a"][0].items()
        if isinstance(v, int | float) and not isinstance(v, bool)
        and all(isinstance(x.get(k), int | float) for x in runs["a"] + runs["b"])
    ]  # fmt: skip
    compared = {}
    for key in keys:
        a, b = summary(runs["a"], key), summary(runs["b"], key)
        ratio = b["median"] / a["median"] if a["median"] else None
        compared[key] = {**{f"a_{k}": v for k, v in a.items()},
                         **{f"b_{k}": v for k, v in b.items()},
                         "b_vs_a": None if ratio is None else round(ratio, 3)}  # fmt: skip
    width = max(len(k) for k in keys) if keys else 10
    print(f"{'key':<{width}}  {'A median':>14} {'(low-high)':>25}  {'B median':>14} "
          f"{'(low-high)':>25}  B/A")  # fmt: skip
    for key, c in compared.items():
        print(f"{key:<{width}}  {c['a_median']:>14.6g} ({c['a_low']:.4g}-{c['a_high']:.4g})"
              f"{'':>6}  {c['b_median']:>14.6g} ({c['b_low']:.4g}-{c['b_high']:.4g}){'':>6}  "
              f"{c['b_vs_a']}")  # fmt: skip
    print(json.dumps({"a": sides[0][1], "b": sides[1][1], "rounds": args.rounds,
                      "bench": [args.bench, *bench_args], "keys": compared}))  # fmt: skip


if __name__ == "__main__":
    main()
