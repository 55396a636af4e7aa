"""What the serving benchmarks share (``serving_bench.py``,
``fleet_bench.py``, ``overload_bench.py``): the benchmark model (shaped like
the MovieLens example: ``user_id``, ``item_id``, ``genres``, ``age``; a Keras
MLP 64-32-1) exported as version 1, its requests (predictions as wuliang's
client and as TensorFlow Serving's send them), the name of a failed call's
kind, and the processes (``wuliang serve``, ``redis-server``) with their CPU
and memory read from /proc.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import zipf_keys  # benchmarks/, the scripts' folder

DIM = 16
KEYS_PER_LOOKUP = 1000
PREDICT_ROWS = 100
HOT = 50_000  # item rows every delta rewrites
USERS = 100_000
GENRES = 30


# -- the model and its export --------------------------------------------------------


def build_model(rows: int, export_dir: Path) -> Any:
    """A session with the tables filled (row i of ``item``: [1, f(i), ...]),
    exported as version 1; returns the session."""
    import keras

    import wuliang as wl

    keras.utils.set_random_seed(0)
    tables = {
        "user": wl.EmbeddingTable("user", DIM, optimizer=wl.optimizers.SGD()),
        "item": wl.EmbeddingTable("item", DIM, optimizer=wl.optimizers.SGD()),
        "genre": wl.EmbeddingTable("genre", DIM, optimizer=wl.optimizers.SGD()),
    }
    features = [
        wl.SparseFeature("user_id", tables["user"]),
        wl.SparseFeature("item_id", tables["item"]),
        wl.SparseFeature("genres", tables["genre"], combiner="mean"),
        wl.DenseFeature("age"),
    ]
    tower = keras.Sequential(
        [
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    session = wl.Session(tower, features, wl.Context(num_shards=2))
    ps = session.context.ps
    for name, n in (("user", USERS), ("item", rows), ("genre", GENRES)):
        for start in range(0, n, 500_000):
            keys = np.arange(start, min(n, start + 500_000), dtype=np.uint64)
            ps.load(name, keys, signed_rows(keys, 1))
    session.export(export_dir, kind="full")
    return session


def signed_rows(keys: np.ndarray, version: int) -> np.ndarray:
    """Rows whose first weight is ``version`` (the rest small, from the key)."""
    rows = np.empty((len(keys), DIM), np.float32)
    rows[:, 0] = version
    rows[:, 1:] = ((keys[:, None] % 97).astype(np.float32) - 48.0) / 480.0
    return rows


def write_delta(session: Any, export_dir: Path, version: int) -> None:
    keys = np.arange(HOT, dtype=np.uint64)
    session.context.ps.load("item", keys, signed_rows(keys, version))
    result = session.export(export_dir)
    if result.version != version:
        raise RuntimeError(f"wrote export {result.version}, expected {version}")


# -- requests -----------------------------------------------------------------------


def predict_batch(rng: np.random.Generator, rows: int) -> dict[str, Any]:
    lengths = rng.integers(1, 4, PREDICT_ROWS)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {
        "user_id": rng.integers(0, USERS, PREDICT_ROWS).astype(np.uint64),
        "item_id": zipf_keys(rng, rows, PREDICT_ROWS),
        "genres": (rng.integers(0, GENRES, offsets[-1]).astype(np.uint64), offsets),
        "age": rng.random((PREDICT_ROWS, 1), dtype=np.float32),
    }


def tfs_request(batch: dict[str, Any], model: str) -> Any:
    """A batch as a TensorFlow Serving client sends it: ``TensorProto`` s of
    int64 ids (lists padded with -1) and float32 features."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    keys, offsets = batch["genres"]
    lengths = np.diff(offsets)
    genres = np.full((PREDICT_ROWS, int(lengths.max())), -1, np.int64)
    for row in range(PREDICT_ROWS):
        genres[row, : lengths[row]] = keys[offsets[row] : offsets[row + 1]]
    inputs = {
        "user_id": batch["user_id"].astype(np.int64),
        "item_id": batch["item_id"].astype(np.int64),
        "genres": genres,
        "age": batch["age"],
    }
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    return request


def failure(error: Exception) -> str:
    """The kind of a call that raised ``error``: its gRPC status name (of a
    ``grpc.RpcError``, or ``ServingClientError`` 's ``code``), ``redis
    <exception>`` for redis-py's errors, otherwise the exception's type name."""
    import grpc

    from wuliang.serving.client import ServingClientError

    if isinstance(error, ServingClientError):
        return error.code
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        return error.code().name
    if type(error).__module__.partition(".")[0] == "redis":
        return f"redis {type(error).__name__}"
    return type(error).__name__


# -- processes ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    export_dir: Path,
    gpu_cache_rows: int = 0,
    model_config: Path | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 300.0,
) -> tuple[subprocess.Popen, int, int]:
    """``wuliang serve`` of the export (or ``model_config``) with
    ``extra_args``; (process, gRPC port, HTTP port) once it listens (killed
    if it has not said so within ``timeout`` seconds)."""
    script = Path(sys.executable).parent / "wuliang"
    if model_config is None:
        args = [str(script), "serve", "--exports", str(export_dir), "--model", "bench"]
    else:
        args = [str(script), "serve", "--model-config", str(model_config)]
    args += ["--port", "0", "--http-port", "0", "--poll-secs", "0.2"]
    args += ["--gpu-cache-rows", str(gpu_cache_rows), *extra_args]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    if not select.select([child.stdout], [], [], timeout)[0]:
        child.kill()
        child.wait(timeout=30)
        raise RuntimeError(f"wuliang serve did not start in {timeout:g} s")
    line = child.stdout.readline()
    match = re.search(r"grpc [\d.]+:(\d+), http [\d.]+:(\d+)$", line.strip())
    if not match:
        child.kill()
        raise RuntimeError(f"wuliang serve did not start: {line!r}")
    return child, int(match[1]), int(match[2])


def start_redis() -> tuple[subprocess.Popen, int]:
    import redis

    port = free_port()
    child = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    db = redis.Redis(port=port)
    for _ in range(100):
        try:
            db.ping()
            return child, port
        except redis.ConnectionError:
            time.sleep(0.05)
    child.kill()
    raise RuntimeError("redis-server did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (and its reaped children: none)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """The resident memory of a process (``VmRSS``), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def stop(child: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 30 s."""
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=30)
