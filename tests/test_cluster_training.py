"""A training cluster as ``wuliang launch`` runs it: 2 parameter servers, a
chief and 2 workers (``examples/movielens_cluster.py``, the MovieLens example's
model) train to the AUC of one process; the tower is shared through the
servers; the chief's checkpoints name the job's step and hold every
trainer's reader position; and killing each role once with SIGKILL (a
server after a checkpoint, a worker, the chief) does not stop the job: the
server comes back with its part of the checkpoint and the log says how
many steps went back, the worker resumes its shard where the board has
it, the chief restores nothing and takes the tower from the servers. A
server that stays away longer than ``WULIANG_PS_RETRY_SECONDS`` fails the
call naming it. Every wait is bounded."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from repo_data import REPO
from test_launch import Launch, launches  # noqa: F401 - the fixture

from wuliang.ps_server import Engine
from wuliang.ps_server.remote.server import PsServer
from wuliang.ps_server.storage import Version, checkpoints

JOB = REPO / "examples" / "movielens_cluster.py"
# large batches, several epochs: the model converges to an AUC that a few
# steps of asynchrony barely move (with 256-row batches the AUC of one
# process varies by 0.015 from seed to seed)
TOWER = r"\[chief-0\] .*the tower's 6 variables are on the parameter servers \("
TRAIN = ["--batch-size", "1024", "--epochs", "4", "--shuffle", "20000"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """MovieLens split by time; the train part shuffled into 6 files (2 per trainer)."""
    spec = importlib.util.spec_from_file_location("movielens_cluster", JOB)
    job = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(job)  # type: ignore[union-attr]
    train, test = job.prepared(tmp_path_factory.mktemp("cluster"), True, job.movielens())
    return {"train": Path(train), "test": Path(test)}


def job_args(data: dict[str, Path], model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(JOB), "--train", str(data["train"]), "--test", str(data["test"]),
            "--model-dir", str(model_dir), "--out", str(out), *TRAIN, *extra]  # fmt: skip


def one_process(data: dict[str, Path], tmp: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTHONPATH")}
    out = tmp / "single.json"
    done = subprocess.run(
        job_args(data, tmp / "single", out), env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def wait_until(what: str, check: Any, run: Launch, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    shown = [line for line in run.lines if "I0000" not in line][-90:]
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(shown))


def pid_of(run: Launch, role: str) -> int:
    """The pid of the newest process of role (``ps-1``, ``worker-0``, ``chief-0``)."""
    found = [m for line in run.lines if (m := re.search(rf"started {role} \(pid (\d+)\)", line))]
    assert found, f"{role} never started"
    return int(found[-1].group(1))


def count(run: Launch, pattern: str) -> int:
    return sum(bool(re.search(pattern, line)) for line in list(run.lines))


def finish(run: Launch, timeout: float = 600) -> None:
    try:
        code = run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("the job did not end:\n" + "\n".join(run.lines[-60:])) from None
    run.reader.join(timeout=30)
    assert code == 0, "\n".join(run.lines[-80:])


def test_a_cluster_trains_movielens_as_one_process_does(
    data: dict[str, Path],
    tmp_path: Path,
    launches: list[Launch],  # noqa: F811
) -> None:
    model, out = tmp_path / "model", tmp_path / "cluster.json"
    run = Launch("--ps", "2", "--workers", "2", "--model-dir", str(model), "--",
                 *job_args(data, model, out, "--checkpoint-steps", "100"))  # fmt: skip
    launches.append(run)
    single = one_process(data, tmp_path)  # meanwhile
    finish(run)
    cluster = json.loads(out.read_text())
    trained = [re.search(r"trained (\d+) steps", line) for line in run.lines]
    steps = [int(m.group(1)) for m in trained if m]
    assert len(steps) == 3 and min(steps) > 50, steps
    assert cluster["step"] == sum(steps)  # the job's step: every trainer's steps
    assert count(run, r"\[worker-\d\] .*trainer \d joins the job") == 2
    assert count(run, TOWER + "filled") == 1
    # a cluster's asynchrony moves the AUC run to run by about +-0.004
    # (cluster_bench.py --cache-auc: 0.6748-0.6789 over seeds, 0.0016 apart
    # on one seed), so two runs can differ by 0.005; a bug moves it more
    assert abs(cluster["auc"] - single["auc"]) <= 0.01, (cluster, single)
    saved = checkpoints(model)
    assert len(saved) >= 2
    last = Version(saved[-1][1])
    assert last.step == cluster["step"]
    assert sorted(last.manifest.trainer_positions or {}) == ["0", "1", "2"]
    assert {"__tower__", "__tower_state__", "user", "movie"} <= set(last.tables)


def test_a_cache_per_trainer_trains_movielens_and_survives_a_killed_worker(
    data: dict[str, Path],
    tmp_path: Path,
    launches: list[Launch],  # noqa: F811
) -> None:
    """Every trainer with a hot cache of shared rows (Geo-SGD, merged every
    8 steps): the job trains to about the AUC of one process, checkpoints
    hold every trainer's changes, and a worker killed with SIGKILL mid-way
    (its unsent changes lost) leaves the job finishing with status 0."""
    model, out = tmp_path / "model", tmp_path / "cached.json"
    run = Launch("--ps", "2", "--workers", "2", "--model-dir", str(model), "--",
                 *job_args(data, model, out, "--checkpoint-steps", "60", "--step-pause", "0.05",
                           "--gpu-cache-rows", "4096", "--cache-sync-steps", "8"))  # fmt: skip
    launches.append(run)
    wait_until("worker-0 training", lambda: count(run, r"\[worker-0\] trainer 1 step") >= 3, run)
    os.kill(pid_of(run, "worker-0"), signal.SIGKILL)
    wait_until("worker-0 back", lambda: count(run, r"trainer 1 resumes its reader") >= 1, run)
    single = one_process(data, tmp_path)  # meanwhile
    finish(run)
    cached = json.loads(out.read_text())
    # the caches' staleness moved the AUC by -0.0018 on average over three
    # seeds (cluster_bench.py --cache-auc 3); a bug in the merge moves it more
    assert abs(cached["auc"] - single["auc"]) <= 0.01, (cached, single)
    last = Version(checkpoints(model)[-1][1])
    assert last.step == cached["step"]
    assert count(run, r"restarting \((1) of") == 1


def test_a_cluster_survives_killing_each_role(
    data: dict[str, Path],
    tmp_path: Path,
    launches: list[Launch],  # noqa: F811
) -> None:
    model, out = tmp_path / "model", tmp_path / "out.json"
    run = Launch("--ps", "2", "--workers", "2", "--model-dir", str(model), "--",
                 *job_args(data, model, out, "--checkpoint-steps", "30",
                           "--step-pause", "0.3"))  # fmt: skip
    launches.append(run)

    # a server, once a checkpoint exists: it comes back with its part of it
    wait_until("a checkpoint", lambda: checkpoints(model), run, timeout=300)
    ckpt = Version(checkpoints(model)[-1][1])
    os.kill(pid_of(run, "ps-1"), signal.SIGKILL)
    lost = wait_until(
        "a trainer telling the steps lost",
        lambda: next(
            (m for line in list(run.lines) if (m := re.search(
                r"came back with its part of the checkpoint of step (\d+); the job is at step "
                r"(\d+): the updates of (\d+) steps", line))),
            None,
        ),
        run,
    )  # fmt: skip
    assert int(lost.group(1)) >= ckpt.step and int(lost.group(3)) >= 0
    assert count(run, r"\[ps-1\] .*restored server 1 of 2 from checkpoint") == 1

    # a worker that has trained (its position is on the board) and the chief,
    # one after the other: the worker resumes its shard from the board, the
    # chief restores nothing (the servers hold the job) and trains on
    wait_until("worker-0 training", lambda: count(run, r"\[worker-0\] trainer 1 step") >= 2, run)
    os.kill(pid_of(run, "worker-0"), signal.SIGKILL)
    wait_until("worker-0 gone", lambda: count(run, r"worker-0 exited \(signal 9\)"), run)
    os.kill(pid_of(run, "chief-0"), signal.SIGKILL)
    wait_until("worker-0 back", lambda: count(run, r"trainer 1 resumes its reader") >= 1, run)
    wait_until(
        "the chief back",
        lambda: count(run, r"\[chief-0\] .*the job is running on the parameter servers") >= 1,
        run,
    )
    finish(run)
    result = json.loads(out.read_text())
    assert result["auc"] > 0.6, result  # a model, not noise
    trained = [re.search(r"\[worker-0\] trainer 1 trained (\d+) steps", line) for line in run.lines]
    again = [int(m.group(1)) for m in trained if m]
    full = [int(m.group(1)) for line in run.lines
            if (m := re.search(r"\[worker-1\] trainer 2 trained (\d+) steps", line))]  # fmt: skip
    assert len(again) == 1 and again[0] < full[0] - 15, (again, full)  # only what was left
    assert count(run, TOWER + "pulled") == 1
    assert count(run, r"restarting \((1) of") == 3  # ps-1, worker-0, chief-0 once each


def test_a_server_that_stays_away_fails_the_call_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import wuliang as wl

    monkeypatch.setenv("WULIANG_PS_RETRY_SECONDS", "1")
    server = PsServer(Engine(1), "127.0.0.1", 0, threads=4)
    address = f"127.0.0.1:{server.port}"
    context = wl.Context(ps=[address])
    context.create_table(wl.EmbeddingTable("t", dim=4))
    server.stop(grace=None)
    start = time.monotonic()
    with pytest.raises(Exception, match=re.escape(address)):
        context.ps.pull("t", np.arange(5, dtype=np.uint64))
    assert time.monotonic() - start < 30
    context.close()
    monkeypatch.setenv("WULIANG_PS_RETRY_SECONDS", "soon")
    with pytest.raises(ValueError, match="WULIANG_PS_RETRY_SECONDS must be"):
        wl.Context(ps=[address])
