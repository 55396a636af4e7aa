"""The online server over gRPC: lookups and predictions of an export equal the
trainer's, deltas are applied live, corrupt versions are refused, a restart
comes back on the newest version, tokens are checked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from small_model import batch_features, make_session, reader, trained_export

from wuliang.serving.client import Client, ServingClientError
from wuliang.serving.grpc import proto
from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore

SCRIPT = Path(sys.executable).parent / "wuliang"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A session trained 5 steps and exported (version 1), its files, a batch."""
    trained = trained_export(tmp_path_factory.mktemp("serving"))
    yield trained
    trained["session"].context.close()


def serve(exports: Path, token: str | None = None, **store: Any) -> tuple[Service, GrpcServer]:
    service = Service([ModelStore(exports, "m", poll_secs=0, **store).start()], token=token)
    return service, GrpcServer(service, port=0)


def test_lookup_and_predict_equal_the_trainer(trained: dict[str, Any]) -> None:
    session, batch = trained["session"], trained["batch"]
    service, server = serve(trained["exports"])
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            assert client.healthy()
            keys = np.array([*range(0, 300, 7), 10**12], np.uint64)
            rows, found, version = client.lookup("users", keys)
            assert version == 1
            want = session.context.ps.lookup("users", keys)
            np.testing.assert_array_equal(found, want.found)
            np.testing.assert_array_equal(rows, want.rows)
            assert not found[-1] and (rows[-1] == 0).all()  # never trained: zeros
            outputs, version = client.predict(batch_features(batch), rows=batch.size)
            assert version == 1
            expected = session.run(batch, "predictions", train=False)
            np.testing.assert_allclose(outputs["predictions"], expected, rtol=1e-5, atol=1e-6)
            (status,) = client.status()
            assert status["version"] == 1 and status["missing_keys"] == "zeros"
            assert {t["name"] for t in status["tables"]} == {"users", "items"}
    finally:
        server.stop()
        service.close()


def test_predictions_through_a_device_cache_equal_the_ones_without(
    trained: dict[str, Any],
) -> None:
    """With a device cache (numpy here: the same path as a GPU's) a
    prediction's rows come from the snapshot and are pooled by TensorFlow
    from where they are (DLPack): the same predictions as without the
    cache; lookups read the engine and never the cache."""
    session, batch = trained["session"], trained["batch"]
    services = [serve(trained["exports"], **cache) for cache in ({}, {"gpu_cache_rows": 16})]
    try:
        outputs = []
        for _, server in services:
            with Client(f"127.0.0.1:{server.port}") as client:
                outputs.append(client.predict(batch_features(batch), rows=batch.size)[0])
                keys = np.arange(0, 300, 7, dtype=np.uint64)
                rows, _, _ = client.lookup("users", keys)
                np.testing.assert_array_equal(rows, session.context.ps.lookup("users", keys).rows)
        np.testing.assert_array_equal(outputs[1]["predictions"], outputs[0]["predictions"])
        expected = session.run(batch, "predictions", train=False)
        np.testing.assert_allclose(outputs[1]["predictions"], expected, rtol=1e-5, atol=1e-6)
        cache = services[1][0].store("m").device_cache  # type: ignore[attr-defined]
        assert cache is not None
        counted = cache.stats()
        assert sum(c["hits"] for c in counted.values()) > 0  # predictions read the cache
        looked = counted["users"]["hits"] + counted["users"]["misses"]
        assert looked == len(np.unique(batch.sparse["user"].values))  # not the lookup's keys
    finally:
        for service, server in services:
            server.stop()
            service.close()


def test_missing_keys_can_read_as_their_initial_vectors(trained: dict[str, Any]) -> None:
    session = trained["session"]
    service, server = serve(trained["exports"], missing="initial")
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            keys = np.array([10**12, 10**12 + 1], np.uint64)
            rows, found, _ = client.lookup("users", keys)
            assert not found.any()
            np.testing.assert_array_equal(rows, session.context.ps.pull("users", keys, train=False))
            assert client.status()[0]["missing_keys"] == "initial"
    finally:
        server.stop()
        service.close()


def test_bad_requests_get_an_error_and_the_server_keeps_serving(trained: dict[str, Any]) -> None:
    service, server = serve(trained["exports"], token="s3cret")
    try:
        address = f"127.0.0.1:{server.port}"
        with Client(address) as anonymous:
            with pytest.raises(ServingClientError) as info:
                anonymous.lookup("users", np.array([1], np.uint64))
            assert info.value.code == "UNAUTHENTICATED"
        with Client(address, token="wrong") as wrong, pytest.raises(ServingClientError):
            wrong.lookup("users", np.array([1], np.uint64))
        with Client(address, token="s3cret") as client:
            cases = {
                "NOT_FOUND": lambda: client.lookup("nope", np.array([1], np.uint64)),
                "NOT_FOUND ": lambda: client.lookup("users", np.array([1], np.uint64), model="x"),
                "INVALID_ARGUMENT": lambda: client.predict({"user": np.array([1], np.uint64)}, 1),
                "INVALID_ARGUMENT ": lambda: client.predict(
                    {**batch_features(trained["batch"]), "x": np.zeros((3, 1), np.float32)},
                    trained["batch"].size,
                ),
            }
            for code, call in cases.items():
                with pytest.raises(ServingClientError) as info:
                    call()
                assert info.value.code == code.strip(), info.value
            assert client.lookup("users", np.array([1], np.uint64)).version == 1
    finally:
        server.stop()
        service.close()


def test_deltas_apply_live_and_corrupt_versions_are_refused(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    files = trained["files"]
    session = make_session()  # its own: the module's session stays as exported
    session.train(reader(files, 0), steps=5)
    exports = tmp_path / "exports"
    session.export(exports, kind="full")
    store = ModelStore(exports, "m", poll_secs=0).start()
    service = Service([store])
    server = GrpcServer(service, port=0)
    errors: list[str] = []
    stop = threading.Event()
    keys = np.arange(0, 300, dtype=np.uint64)

    features = batch_features(trained["batch"])

    def query(predicting: bool) -> None:
        with Client(f"127.0.0.1:{server.port}") as client:
            while not stop.is_set():
                try:
                    if predicting:  # every table and the tower at one version
                        outputs, version = client.predict(features, rows=trained["batch"].size)
                        assert np.isfinite(outputs["predictions"]).all()
                    else:
                        _, _, version = client.lookup("users", keys)
                    assert version >= 1
                except Exception as error:  # any failure fails the test
                    errors.append(repr(error))
                    return

    threads = [threading.Thread(target=query, args=(p,)) for p in (False, True)]
    for t in threads:
        t.start()
    try:
        base = store.version
        for _ in range(3):  # deltas while both query
            session.train(reader(files, 0), steps=1)
            session.export(exports)
            store.refresh()
        session.train(reader(files, 0), steps=3)
        session.export(exports, kind="full")  # a new base: every table replaced
        assert store.refresh() == [base + 4]
        base += 3
        assert store.version == base + 1
        want = session.context.ps.lookup("users", keys)
        got = store.lookup("users", keys)
        np.testing.assert_array_equal(got.rows, want.rows)
        # A corrupt version is refused; the previous one keeps serving.
        session.train(reader(files, 0), steps=2)
        result = session.export(exports)
        part = next((result.path / "tables" / "users").glob("part-*.arrow"))
        part.write_bytes(part.read_bytes()[:-10] + b"0123456789")
        assert store.refresh() == []
        assert store.version == base + 1 and store.counters.refused == 1
        time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.stop()
        service.close()
    assert not errors, errors
    # A restart comes back on the newest valid version.
    with ModelStore(exports, "m", poll_secs=0, load_towers=False) as again:
        assert again.version == base + 1 and again.counters.refused == 1
    session.context.close()


def test_status_of_the_manifest_model(trained: dict[str, Any]) -> None:
    manifest = json.loads((trained["exports"] / "1" / "manifest.json").read_text())
    assert manifest["tables"]["users"]["spec"]["initializer"]["kind"] == "TruncatedNormal"


def test_wuliang_serve_runs_until_sigterm(trained: dict[str, Any]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [str(SCRIPT), "serve", "--exports", str(trained["exports"]), "--model", "m"]
    args += ["--port", "0", "--http-port", "-1", "--poll-secs", "0.2"]
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as child:
        try:
            line = child.stdout.readline() if child.stdout else ""
            match = re.search(r"version (\d+) .* grpc 127\.0\.0\.1:(\d+)", line)
            assert match, line + (child.stderr.read() if child.stderr else "")
            assert match[1] == "1"
            with Client(f"127.0.0.1:{match[2]}", model="m") as client:
                assert client.lookup("users", np.array([1, 2], np.uint64)).version == 1
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=30) == 0
        finally:
            if child.poll() is None:
                child.kill()


def test_wuliang_serve_errors(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SCRIPT), "serve", "--exports", str(tmp_path / "none"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "wuliang serve: error: export directory" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run(
        [str(SCRIPT), "serve", "--exports", str(tmp_path), "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--port" in done.stderr


def test_serving_from_redis_equals_the_export(trained: dict[str, Any], redis_url: str) -> None:
    from wuliang.ps_server import parameter_server
    from wuliang.serving.redis.model import RedisModelStore
    from wuliang.serving.redis.publish import publish
    from wuliang.serving.versions import apply_chain

    exports = trained["exports"]
    publish(exports, redis_url, model="m")
    store = RedisModelStore(redis_url, "m", exports, poll_secs=0.2).start()
    service = Service([store])
    server = GrpcServer(service, port=0)
    try:
        with (
            parameter_server("embedded", 2) as engine,
            Client(f"127.0.0.1:{server.port}") as client,
        ):
            apply_chain(engine, exports)
            for table in ("users", "items"):
                keys = np.arange(0, 600, dtype=np.uint64)
                rows, found, version = client.lookup(table, keys)
                want = engine.lookup(table, keys)
                assert version == store.version
                np.testing.assert_array_equal(found, want.found)
                np.testing.assert_array_equal(rows, want.rows)
            batch = trained["batch"]
            outputs, _ = client.predict(batch_features(batch), rows=batch.size)
            expected = trained["session"].run(batch, "predictions", train=False)
            np.testing.assert_allclose(outputs["predictions"], expected, rtol=1e-5, atol=1e-6)
            with pytest.raises(ServingClientError) as info:
                client.lookup("nope", np.array([1], np.uint64))
            assert info.value.code == "NOT_FOUND"
    finally:
        server.stop()
        service.close()


def test_bytes_that_are_no_request_are_invalid_argument(trained: dict[str, Any]) -> None:
    """Garbled bytes are INVALID_ARGUMENT (not grpcio's INTERNAL), counted in
    the metrics; a huge name in an error message is cut to fit the trailers."""
    service, server = serve(trained["exports"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            lookup = channel.unary_unary(proto.method_path("Lookup"))  # bytes in and out
            for garbage in (b"\xff\xff\xff", b"\x0a\x02\xff\xfe", b"\x1a\xff\xff\xff\xff\x0f"):
                with pytest.raises(grpc.RpcError) as info:
                    lookup(garbage, timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid LookupRequest" in info.value.details()
        with Client(f"127.0.0.1:{server.port}") as client:
            with pytest.raises(ServingClientError) as error:
                client.status(model="é" * 20_000)
            assert error.value.code == "NOT_FOUND" and error.value.message.endswith("...")
            assert len(error.value.message.encode()) <= 2000
        text = service.metrics.text().decode()
        assert (
            'wuliang_requests_total{code="INVALID_ARGUMENT",endpoint="Lookup",transport="grpc"} 3.0'
            in text
        )
    finally:
        server.stop()
        service.close()


def test_every_answer_belongs_to_the_version_it_names(tmp_path: Path) -> None:
    """Clients query over gRPC while deltas land: each answer's rows carry the
    signature of the version it reports (first weight = the export version
    that last wrote the row), and no request fails."""
    import keras

    import wuliang as wl

    table = wl.EmbeddingTable("t", 4, optimizer=wl.optimizers.SGD())
    session = wl.Session(
        keras.Sequential([keras.layers.Dense(1)]),
        [wl.SparseFeature("k", table)],
        wl.Context(num_shards=2),
    )
    ps = session.context.ps
    keys = np.arange(2000, dtype=np.uint64)
    hot = keys[:500]  # every delta rewrites these

    def rows(version: int, which: np.ndarray) -> np.ndarray:
        out = np.full((len(which), 4), float(version), np.float32)
        out[:, 1] = which.astype(np.float32)
        return out

    ps.load("t", keys, rows(1, keys))
    exports = tmp_path / "exports"
    session.export(exports, kind="full")
    store = ModelStore(exports, "m", poll_secs=0.05, load_towers=False).start()
    service = Service([store])
    server = GrpcServer(service, port=0)
    stop = threading.Event()
    problems: list[str] = []
    seen: set[int] = set()

    def query() -> None:
        with Client(f"127.0.0.1:{server.port}", timeout=10) as client:
            while not stop.is_set():
                try:
                    got, found, version = client.lookup("t", keys)
                except ServingClientError as error:
                    problems.append(repr(error))
                    return
                want = np.where(keys < len(hot), version, 1).astype(np.float32)
                if not found.all() or (got[:, 0] != want).any() or (got[:, 1] != keys).any():
                    problems.append(f"rows not of version {version}")
                    return
                seen.add(version)

    threads = [threading.Thread(target=query) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for version in range(2, 8):
            ps.load("t", hot, rows(version, hot))
            assert session.export(exports).version == version
            deadline = time.monotonic() + 30
            while store.version != version and time.monotonic() < deadline:
                time.sleep(0.02)
            assert store.version == version
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.stop()
        service.close()
        session.context.close()
    assert not problems, problems[:3]
    assert len(seen) >= 3, seen
