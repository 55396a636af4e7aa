"""A training cluster next to one process: ``train_bench.py --cluster SxW``.

The model (``bench_model.py``) and data of ``train_bench.py`` (26
Criteo-like embeddings of dim 16, 13 dense features, a Keras MLP
512-256-128-1; Adagrad(0.05) on the tables, Adagrad(0.01) on the tower;
batches of ``--batch``), trained

* by one process with the embedded engine (the baseline), for ``W + 1``
  times ``--steps`` steps;
* by a job of ``S`` servers, a chief and ``W`` workers under ``wuliang
  launch`` (every process on this machine), each trainer ``--steps`` steps
  of its own shard of the files, the tower shared through the servers.

Each trainer times its steps after ``--warmup`` untimed ones, and where a
step's time goes: the TensorFlow step (``compute``), the tower's pull and
push (``tower_pull``, ``tower_push``: synchronous calls to the servers), and
the rest (the embedding pull and push the pipeline did not hide, the job
board, hooks). The job's samples/s is every trainer's timed samples over
the span from the first timed step's start to the last one's end.

``--kill-auc N``: the cost in AUC of one server killed with SIGKILL and
restored from the newest checkpoint (partial recovery): the MovieLens job
of ``examples/movielens_cluster.py`` (2 servers, a chief, 2 workers) run N
times undisturbed and N times with server 1 killed 30 job steps after the
first checkpoint past a third of the run (checkpoints every 60 steps), seeds
alternating; the mean AUC of each
and their difference.

``--sync-auc 1,4,16``: the same job with the tower synced every k steps
(``Context(tower_sync_steps=k)``, GEO mode), ``--runs`` seeds each.

``--gpu-cache-rows R``: every trainer of the job keeps a hot cache of R
rows per table (``Context(gpu_cache_rows=R)``; with several trainers, caches
of shared rows merged every ``--cache-sync-steps`` steps, Geo-SGD); the job
then runs with and without the caches, alternated ``--rounds`` times
(``cache_on_vs_off``: the medians' ratio). ``--cache-auc N``: the MovieLens
job's AUC with caches on and off, N seeds each, and one job with caches on
whose worker 0 is killed with SIGKILL mid-way (it must finish with status 0).

On one machine of 2 cores the cluster is slower than one process: every
process shares the same cores. ``docs/cluster.md`` models samples/s for W
workers and S servers on separate machines from the per-step costs printed
here and the per-call costs of ``ps_bench.py --remote``. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def trainer(args: argparse.Namespace) -> None:
    """One trainer (of the job, or the baseline): trains and writes its timings."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info lines
    from bench_model import DIM, make_tower, tower_optimizer  # benchmarks/, the script's folder

    import wuliang as wl
    from wuliang import dense
    from wuliang.embedding import bridge, concat
    from wuliang.optimizers import Adagrad
    from wuliang.reader import ParquetReader
    from wuliang.reader.datagen import DENSE, LABEL, SINGLE

    spent: dict[str, float] = {"compute": 0.0, "tower_pull": 0.0, "tower_push": 0.0}
    timing = [False]

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if timing[0]:
                    spent[name] += time.perf_counter() - start

        return run

    bridge.StepFunctions.train = timed("compute", bridge.StepFunctions.train)  # type: ignore[method-assign]
    dense.SharedTower.pull = timed("tower_pull", dense.SharedTower.pull)  # type: ignore[method-assign]
    dense.SharedTower.push = timed("tower_push", dense.SharedTower.push)  # type: ignore[method-assign]

    model = make_tower(0)
    context = wl.Context(gpu_cache_rows=args.gpu_cache_rows, cache_sync_steps=args.cache_sync_steps)
    tables = {n: wl.EmbeddingTable(n, DIM, optimizer=Adagrad(0.05)) for n in SINGLE}
    features: list[Any] = [wl.SparseFeature(n, tables[n]) for n in SINGLE]
    features += [wl.DenseFeature(n) for n in DENSE]

    def tower(embeddings: dict, dense_in: dict) -> Any:
        return model(concat([embeddings[n] for n in SINGLE] + [dense_in[n] for n in DENSE]))

    session = wl.Session(tower, features, context, optimizer=tower_optimizer("adagrad"))
    marks: dict[str, float] = {}

    class Clock(wl.hooks.SessionRunHook):
        def __init__(self) -> None:
            self.done = 0

        def after_run(self, run_context: Any, run_values: Any) -> None:
            self.done += 1
            if self.done == args.warmup:
                marks["start"] = time.time()
                timing[0] = True

    steps = args.warmup + args.steps
    reader = ParquetReader(args.files, args.batch, [*SINGLE, *DENSE], label=LABEL, epochs=None)
    session.train(reader, steps=steps, hooks=[Clock()])
    marks["end"] = time.time()
    job = context.job
    if job is not None:
        job.finish()
    out = {
        "steps": args.steps,
        "samples": args.steps * args.batch,
        "start": marks["start"],
        "end": marks["end"],
        **{k: v / args.steps * 1e3 for k, v in spent.items()},  # ms per step
    }
    name = "single" if job is None else f"trainer-{job.trainer}"
    Path(args.out, f"{name}.json").write_text(json.dumps(out))
    if job is not None and job.is_chief:
        job.wait_finished(timeout=600)
    context.close()


def cache_args(rows: int | None, sync_steps: int) -> list[str]:
    if rows is None:
        return []
    return ["--gpu-cache-rows", str(rows), "--cache-sync-steps", str(sync_steps)]


def run_job(
    args: argparse.Namespace, files: list[str], out: Path, cache_rows: int | None = None
) -> dict[str, Any]:
    servers, workers = args.servers, args.workers
    trainer_cmd = [sys.executable, str(Path(__file__).resolve()), "--trainer", "--out", str(out),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--batch", str(args.batch), *cache_args(cache_rows, args.cache_sync_steps),
                   "--files", *files]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    launch = [sys.executable, "-m", "wuliang", "launch", "--ps", str(servers),
              "--workers", str(workers), "--", *trainer_cmd]  # fmt: skip
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the job failed:\n{done.stdout[-4000:]}")
    results = [json.loads(p.read_text()) for p in sorted(out.glob("trainer-*.json"))]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    samples = sum(r["samples"] for r in results)
    mean = {k: sum(r[k] for r in results) / len(results)
            for k in ("compute", "tower_pull", "tower_push")}  # fmt: skip
    step_ms = sum((r["end"] - r["start"]) / r["steps"] * 1e3 for r in results) / len(results)
    return {"samples_per_s": samples / span, "trainers": len(results), "step_ms": step_ms,
            **{f"{k}_ms": v for k, v in mean.items()}}  # fmt: skip


def run_single(args: argparse.Namespace, files: list[str], out: Path, steps: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trainer", "--out", str(out),
           "--steps", str(steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--files", *files]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the single process failed:\n{done.stderr[-4000:]}")
    r = json.loads((out / "single.json").read_text())
    return {"samples_per_s": r["samples"] / (r["end"] - r["start"]),
            "step_ms": (r["end"] - r["start"]) / r["steps"] * 1e3,
            "compute_ms": r["compute"]}  # fmt: skip


def movielens_job(
    data: Path,
    work: Path,
    seed: int,
    kill: bool | str,
    sync_steps: int = 1,
    cache: list[str] | None = None,
    pause: float = 0.1,
) -> dict[str, Any]:
    """One MovieLens job under wuliang launch; with kill, server 1 (or the
    role ``kill`` names) is killed with SIGKILL once a checkpoint past a
    third of the run exists. ``cache``: the example's cache options."""
    import signal

    role = "ps-1" if kill is True else kill
    model, out = work / "model", work / "out.json"
    job = [sys.executable, str(HERE.parent / "examples" / "movielens_cluster.py"),
           "--prepare", str(data), "--model-dir", str(model), "--out", str(out),
           "--batch-size", "1024", "--epochs", "4", "--seed", str(seed),
           "--checkpoint-steps", "60", "--step-pause", str(pause),
           "--tower-sync-steps", str(sync_steps), *(cache or [])]  # fmt: skip
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    launch = [sys.executable, "-m", "wuliang", "launch", "--ps", "2", "--workers", "2",
              "--model-dir", str(model), "--", *job]  # fmt: skip
    proc = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    killed_at = None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        step = line.rsplit(" step ", 1)[1].strip() if " step " in line else ""
        if kill and killed_at is None and step.isdigit():
            done = [int(p.name[5:]) for p in model.glob("ckpt-*") if (p / "manifest.json").exists()]
            # halfway between checkpoints past a third of the run: 30 steps of updates lost
            if done and max(done) >= 100 and int(step) >= max(done) + 30:
                pid = next(int(x.split("(pid ")[1].rstrip(")\n"))
                           for x in reversed(lines) if f"started {role} (pid" in x)  # fmt: skip
                os.kill(pid, signal.SIGKILL)
                killed_at = int(step)
    if proc.wait(timeout=1800) != 0:
        raise RuntimeError("the job failed:\n" + "".join(lines[-60:]))
    lost = [line for line in lines if "the updates of" in line]
    return {**json.loads(out.read_text()), "killed_at": killed_at, "lost_lines": len(lost),
            "seconds": time.monotonic() - start}  # fmt: skip


def kill_auc(runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "data")
        plain, killed = [], []
        for i in range(runs):
            for kill, into in ((False, plain), (True, killed)):
                work = Path(tmp, f"{'kill' if kill else 'plain'}-{i}")
                work.mkdir()
                r = movielens_job(data, work, 42 + i, kill)
                print(f"seed {42 + i} {'killed' if kill else 'undisturbed'}: AUC "
                      f"{r['auc']:.4f} (killed at step {r['killed_at']})", flush=True)  # fmt: skip
                into.append(r)
    mean = lambda rs: sum(r["auc"] for r in rs) / len(rs)  # noqa: E731
    return {
        "runs": runs,
        "auc_undisturbed": [round(r["auc"], 4) for r in plain],
        "auc_server_killed": [round(r["auc"], 4) for r in killed],
        "killed_at_step": [r["killed_at"] for r in killed],
        "auc_cost_of_a_kill": round(mean(plain) - mean(killed), 4),
    }


def sync_auc(every: list[int], runs: int) -> dict[str, Any]:
    """The MovieLens job with the tower synced every k steps (GEO mode), for
    each k, ``runs`` seeds; the mean AUC of each k."""
    aucs: dict[int, list[float]] = {k: [] for k in every}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "data")
        for i in range(runs):
            for k in every:
                work = Path(tmp, f"k{k}-{i}")
                work.mkdir()
                auc = movielens_job(data, work, 42 + i, False, k)["auc"]
                print(f"seed {42 + i}, tower synced every {k} steps: AUC {auc:.4f}", flush=True)
                aucs[k].append(round(auc, 4))
    return {
        "runs": runs,
        "auc": {str(k): v for k, v in aucs.items()},
        "mean_auc": {str(k): round(sum(v) / len(v), 4) for k, v in aucs.items()},
    }


def cache_auc(runs: int, rows: int, sync_steps: int) -> dict[str, Any]:
    """The MovieLens job (2 servers, a chief, 2 workers) with every
    trainer's cache on and off, ``runs`` seeds each, alternated; then one
    with caches on whose worker 0 is killed with SIGKILL mid-way."""
    options = cache_args(rows, sync_steps)
    aucs: dict[str, list[float]] = {"off": [], "on": []}
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "data")
        for i in range(runs):
            for name, cache in (("off", []), ("on", options)):
                work = Path(tmp, f"{name}-{i}")
                work.mkdir()
                r = movielens_job(data, work, 42 + i, False, cache=cache, pause=0.0)
                print(f"seed {42 + i}, caches {name}: AUC {r['auc']:.4f} in {r['seconds']:.0f} s",
                      flush=True)  # fmt: skip
                aucs[name].append(round(r["auc"], 4))
                seconds[name].append(round(r["seconds"], 1))
        work = Path(tmp, "killed")
        work.mkdir()
        killed = movielens_job(data, work, 42, "worker-0", cache=options)
        print(f"caches on, worker-0 killed at step {killed['killed_at']}: AUC "
              f"{killed['auc']:.4f}", flush=True)  # fmt: skip
    mean = {k: sum(v) / len(v) for k, v in aucs.items()}
    return {
        "runs": runs,
        "cache_rows": rows,
        "cache_sync_steps": sync_steps,
        "auc_caches_off": aucs["off"],
        "auc_caches_on": aucs["on"],
        "auc_on_minus_off": round(mean["on"] - mean["off"], 4),
        "job_seconds_off": seconds["off"],
        "job_seconds_on": seconds["on"],
        "trainer_killed_at_step": killed["killed_at"],
        "trainer_killed_auc": round(killed["auc"], 4),
        "trainer_killed_status": 0,  # movielens_job raises on any other
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", default="2x2", help="SERVERSxWORKERS (and a chief)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per trainer")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--kill-auc", type=int, metavar="N", help="instead: the AUC cost of a kill")
    p.add_argument(
        "--sync-auc",
        metavar="K,K",
        help="instead: the MovieLens job's AUC with the tower synced every K steps "
        "(GEO mode), --runs seeds each",
    )
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--gpu-cache-rows", type=int, help="a hot cache of R rows per table per trainer")
    p.add_argument("--cache-sync-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="alternated job runs with caches on/off")
    p.add_argument(
        "--cache-auc",
        type=int,
        metavar="N",
        help="instead: the MovieLens job's AUC with caches on and off, and a kill",
    )
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--files", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.trainer:
        trainer(args)
        return
    if args.sync_auc:
        print(json.dumps(sync_auc([int(k) for k in args.sync_auc.split(",")], args.runs)))
        return
    if args.kill_auc:
        print(json.dumps(kill_auc(args.kill_auc)))
        return
    if args.cache_auc:
        rows = args.gpu_cache_rows or 4096
        print(json.dumps(cache_auc(args.cache_auc, rows, args.cache_sync_steps)))
        return
    servers, _, workers = args.cluster.partition("x")
    args.servers, args.workers = int(servers), int(workers)
    from bench_data import cores, parquet_files

    data = Path(tempfile.gettempdir()) / f"wuliang-bench-{args.rows}"
    files = [str(f) for f in parquet_files(data / "parquet", args.rows)[0]]
    trainers = args.workers + 1
    with tempfile.TemporaryDirectory() as tmp:
        single_dir, job_dir = Path(tmp, "single"), Path(tmp, "job")
        single_dir.mkdir()
        job_dir.mkdir()
        print(f"one process: {trainers * args.steps} steps of {args.batch}", flush=True)
        single = run_single(args, files, single_dir, trainers * args.steps)
        print(f"  {single['samples_per_s']:,.0f} samples/s", flush=True)
        print(f"job: {args.servers} servers, a chief and {args.workers} workers", flush=True)
        job = run_job(args, files, job_dir)
        print(f"  {job['samples_per_s']:,.0f} samples/s", flush=True)
        cached = cache_rounds(args, files, Path(tmp), job) if args.gpu_cache_rows else {}
    result = {
        "cluster": args.cluster,
        "cores": cores(),
        "batch": args.batch,
        "steps_per_trainer": args.steps,
        "single_samples_per_s": round(single["samples_per_s"]),
        "single_step_ms": round(single["step_ms"], 1),
        "single_compute_ms": round(single["compute_ms"], 1),
        "cluster_samples_per_s": round(job["samples_per_s"]),
        "cluster_vs_single": round(job["samples_per_s"] / single["samples_per_s"], 3),
        "cluster_step_ms": round(job["step_ms"], 1),
        "cluster_compute_ms": round(job["compute_ms"], 1),
        "cluster_tower_pull_ms": round(job["tower_pull_ms"], 1),
        "cluster_tower_push_ms": round(job["tower_push_ms"], 1),
        **cached,
    }
    print(json.dumps(result))


def cache_rounds(
    args: argparse.Namespace, files: list[str], tmp: Path, first_off: dict[str, Any]
) -> dict[str, Any]:
    """The job with every trainer's cache on and off, alternated
    ``--rounds`` times (the first run without caches is the one above)."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [first_off], "on": []}
    for i in range(args.rounds):
        for name, rows in (("on", args.gpu_cache_rows), ("off", None)):
            if name == "off" and i == args.rounds - 1:
                break  # as many runs of each
            out = tmp / f"job-{name}-{i}"
            out.mkdir()
            r = run_job(args, files, out, rows)
            print(f"  caches {name}: {r['samples_per_s']:,.0f} samples/s", flush=True)
            runs[name].append(r)
    rate = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()}
    return {
        "cache_rows": args.gpu_cache_rows,
        "cache_sync_steps": args.cache_sync_steps,
        "cache_off_samples_per_s": [round(r["samples_per_s"]) for r in runs["off"]],
        "cache_on_samples_per_s": [round(r["samples_per_s"]) for r in runs["on"]],
        "cache_on_vs_off": round(rate["on"] / rate["off"], 3),
        "cache_on_step_ms": round(statistics.median(r["step_ms"] for r in runs["on"]), 1),
    }


if __name__ == "__main__":
    main()
