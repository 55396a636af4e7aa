"""Conformance suite of the served-model protocol (``wuliang.serving.model.ServedModel``).

Both stores run every test here, through the ``harness`` fixture: a
``ModelStore`` over an export directory (an embedded engine) and a
``RedisModelStore`` over the same versions published to a real redis-server
(started on a free loopback port by ``conftest.redis_url``), with the towers
from that export directory. The versions are written directly
(``VersionWriter``), each with its own SavedModel, so that every part of an
answer names the version it came from:

* table ``t`` (dim 4): key k reads ``[v, 0, k, 0]`` at version v, and the key
  ``hash_strings(str(k), "k")`` reads ``[v, 1, k, 0]``; table ``u`` (dim 3,
  versions 1 and 2 only): key k reads ``[v, k, -k]``;
* the description: sparse feature ``k`` (table ``t``) whose ``hash_field`` is
  ``"k"`` at even versions and None (integer ids) at odd ones, and a dense
  feature ``x``;
* the tower of version w answers ``1000 w + 10 e0 + e1`` for the pooled ``k``
  row e.

So a prediction of the digit string "7" at version V answers ``1010 V``
(odd V: the key 7) or ``1010 V + 1`` (even V: the hashed key), and any mix of
rows, description and tower of different versions answers something else.

What passing guarantees, for both stores:

1. Before the first version: version 0, ``served()`` and lookups
   UNAVAILABLE, no tables; the first version is served once it lands.
2. Lookups equal the version's rows (int64 keys too); keys without a row
   read as zeros, not found; an unknown table is NOT_FOUND naming the tables.
3. Versions switch (deltas, a new full version dropping a table), and the
   snapshot, ``on_apply``, ``applied`` follow; a lookup at a snapshot answers
   that version's rows or raises ``VersionMoved``.
4. ``Service.status`` reports the same fields (version, step, tables, dims,
   rows, settings, counters).
5. A version whose SavedModel does not load is refused (``refused``,
   ``on_refuse``) and the previous one keeps serving.
6. Predictions over gRPC, HTTP and the ``Service`` while versions switch:
   every answer's rows, description and tower are of the version it names.
7. A store without towers answers predictions FAILED_PRECONDITION saying why.
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from row_chunks import version_rows

from wuliang.ps_server import SGD, TableSpec
from wuliang.ps_server.storage import (
    DenseInput,
    ModelDescription,
    SparseInput,
    Version,
    VersionWriter,
)
from wuliang.reader import hash_strings
from wuliang.serving.client import Client, ServingClientError
from wuliang.serving.errors import FailedPrecondition, NotFound, Unavailable, VersionMoved
from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.http.server import HttpServer
from wuliang.serving.model import ServedModel, ServedVersion
from wuliang.serving.predict import FeatureInput
from wuliang.serving.redis.model import RedisModelStore
from wuliang.serving.redis.publish import publish
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore

KEYS = np.arange(1, 101, dtype=np.uint64)
HASHED = np.asarray(hash_strings([str(k) for k in KEYS], "k"), np.uint64)
U_KEYS = np.arange(1, 51, dtype=np.uint64)
UNKNOWN = np.array([10**12, 2**64 - 1], np.uint64)
STORES = ["embedded", "redis"]


# -- versions -------------------------------------------------------------------------


def t_rows(v: int, keys: np.ndarray, hashed: bool) -> np.ndarray:
    rows = np.zeros((len(keys), 4), np.float32)
    rows[:, 0] = v
    rows[:, 1] = 1.0 if hashed else 0.0
    return rows


def t_expected(v: int, keys: np.ndarray) -> np.ndarray:
    """What table t reads at version v for keys (KEYS, HASHED or unknown)."""
    out = np.zeros((len(keys), 4), np.float32)
    plain = np.isin(keys, KEYS)
    hashed = np.isin(keys, HASHED)
    out[plain | hashed, 0] = v
    out[hashed, 1] = 1.0
    out[plain, 2] = keys[plain].astype(np.float32)
    index = {int(h): int(k) for h, k in zip(HASHED, KEYS, strict=True)}
    out[hashed, 2] = [index[int(h)] for h in keys[hashed]]
    return out


def u_rows(v: int, keys: np.ndarray) -> np.ndarray:
    k = keys.astype(np.float32)
    return np.stack([np.full(len(keys), v, np.float32), k, -k], axis=1)


def description(v: int) -> ModelDescription:
    return ModelDescription(
        sparse=(SparseInput("k", "t", "sum", None, "k" if v % 2 == 0 else None),),
        dense=(DenseInput("x", 1),),
    )


def expected_score(v: int) -> float:
    return 1010.0 * v + (1.0 if v % 2 == 0 else 0.0)


@pytest.fixture(scope="module")
def towers(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, bool], Path]:
    """tower(v, broken) -> a SavedModel folder answering 1000 v + 10 e0 + e1
    (broken: its saved_model.pb is garbage)."""
    import tensorflow as tf

    root = tmp_path_factory.mktemp("towers")
    made: dict[tuple[int, bool], Path] = {}

    def tower(v: int, broken: bool = False) -> Path:
        if (v, broken) in made:
            return made[v, broken]
        path = root / f"{v}{'-broken' if broken else ''}"
        if broken:
            path.mkdir()
            (path / "saved_model.pb").write_bytes(b"not a SavedModel")
        else:

            class Tower(tf.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.w = tf.Variable(1000.0 * v)

                @tf.function(
                    input_signature=[
                        {
                            "k": tf.TensorSpec([None, 4], tf.float32),
                            "x": tf.TensorSpec([None, 1], tf.float32),
                        }
                    ]
                )
                def serve(self, inputs: dict[str, Any]) -> dict[str, Any]:
                    e = inputs["k"]
                    score = self.w + 10.0 * e[:, 0] + e[:, 1] + 0.0 * inputs["x"][:, 0]
                    return {"predictions": score}

            tf.saved_model.save(Tower(), str(path))
        made[v, broken] = path
        return path

    return tower


def write_version(
    root: Path,
    v: int,
    tower: Path,
    parent: int | None = None,
    with_u: bool = True,
) -> Version:
    """Version v (full when parent is None, else a delta of parent rewriting
    every row); LATEST names it."""
    kind = "full" if parent is None else "delta"
    with VersionWriter(root, str(v), kind) as writer:
        keys = np.concatenate([KEYS, HASHED])
        weights = np.concatenate([t_rows(v, KEYS, False), t_rows(v, HASHED, True)])
        weights[:, 2] = np.concatenate([KEYS, KEYS]).astype(np.float32)
        writer.write_table(
            TableSpec("t", 4, optimizer=SGD()), [version_rows(keys, weights, v)], state=False
        )
        if parent is not None:
            writer.write_removed("t", np.zeros(0, np.uint64))
        if with_u:
            kept = U_KEYS if parent is None else U_KEYS[:40]  # a delta removes 41..50
            writer.write_table(
                TableSpec("u", 3, optimizer=SGD()),
                [version_rows(kept, u_rows(v, kept), v)],
                state=False,
            )
            if parent is not None:
                writer.write_removed("u", U_KEYS[40:])
        shutil.copytree(tower, writer.path("serving"), dirs_exist_ok=True)
        writer.add_tree("serving")
        path = writer.commit(
            number=v, parent=parent, engine_version=v, step=10 * v, model=description(v)
        )
    (root / "LATEST").write_text(f"{v}\n")
    return Version(path)


# -- the two stores ---------------------------------------------------------------------


class Harness:
    """Makes one kind of store over ``root`` and makes it serve new versions."""

    def __init__(self, kind: str, root: Path, redis_url: str, towers: bool = True) -> None:
        self.kind = kind
        self.root = root
        self.redis_url = redis_url
        self.towers = towers
        self.stores: list[ServedModel] = []

    def make(self) -> ServedModel:
        """A store of model "m", not started."""
        if self.kind == "embedded":
            store: ServedModel = ModelStore(self.root, "m", poll_secs=0, load_towers=self.towers)
        else:
            store = RedisModelStore(
                self.redis_url, "m", self.root if self.towers else None, poll_secs=0.1
            )
        self.stores.append(store)
        return store

    def write(self, v: int, tower: Path, parent: int | None = None, with_u: bool = True) -> None:
        """Writes version v into the export directory (``write_version``)
        and, for Redis, publishes it."""
        write_version(self.root, v, tower, parent, with_u)
        if self.kind == "redis":
            publish(self.root, self.redis_url, "m", v, retention=2)

    def land(self, store: ServedModel, v: int, refused: int | None = None) -> None:
        """Waits until the store serves version v (just written), or, given
        ``refused``, until it has refused that many versions."""
        if self.kind == "embedded":
            store.refresh()  # type: ignore[attr-defined]

        def done() -> bool:
            return store.version == v if refused is None else store.counters.refused == refused

        deadline = time.monotonic() + 60
        while not done() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert done(), (store.version, store.counters)

    def close(self) -> None:
        for store in self.stores:
            store.close()


@pytest.fixture(params=STORES)
def harness(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str) -> Iterator[Harness]:
    with redis.Redis.from_url(redis_url) as client:
        client.flushall()
    harness = Harness(request.param, tmp_path / "exports", redis_url)
    (tmp_path / "exports").mkdir()
    yield harness
    harness.close()


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- tests ------------------------------------------------------------------------------


def test_before_the_first_version_and_after(harness: Harness, towers: Any) -> None:
    store = harness.make()
    assert isinstance(store, ServedModel)
    applied: list[tuple[int, float]] = []
    store.on_apply.append(lambda served, seconds: applied.append((served.number, seconds)))
    store.start()
    service = Service([store])
    assert store.version == 0 and store.tables() == {} and not service.healthy()
    with pytest.raises(Unavailable, match="no version loaded yet"):
        store.served()
    with pytest.raises(Unavailable, match="no version loaded yet"):
        store.lookup("t", KEYS)
    (status,) = service.status()
    assert (status["version"], status["step"], status["tables"]) == (0, 0, [])
    harness.write(1, towers(1))
    harness.land(store, 1)
    served = store.served()
    assert isinstance(served, ServedVersion)
    assert (served.number, served.step, served.kind) == (1, 10, "full")
    assert served.model == description(1) and served.tower is not None
    assert store.counters.applied == 1 and [n for n, _ in applied] == [1]
    assert service.healthy() and store.tables() == {"t": 4, "u": 3}


def test_lookups_equal_the_versions_rows(harness: Harness, towers: Any) -> None:
    harness.write(1, towers(1))
    store = harness.make().start()
    keys = np.concatenate([KEYS, HASHED, UNKNOWN])
    for _ in range(2):  # Redis: cold, then from the cache
        got = store.lookup("t", keys)
        assert got.version == 1 and got.rows.dtype == np.float32
        np.testing.assert_array_equal(got.rows, t_expected(1, keys))
        np.testing.assert_array_equal(got.found, np.isin(keys, np.concatenate([KEYS, HASHED])))
    got = store.lookup("u", np.concatenate([U_KEYS, UNKNOWN]).astype(np.int64))
    np.testing.assert_array_equal(got.rows[:50], u_rows(1, U_KEYS))
    assert got.found[:50].all() and not got.found[50:].any() and not got.rows[50:].any()
    empty = store.lookup("u", np.zeros(0, np.uint64))
    assert empty.rows.shape == (0, 3) and empty.found.shape == (0,)
    with pytest.raises(NotFound, match=r"no table 'nope' \(tables: t, u\)"):
        store.lookup("nope", KEYS)


def test_versions_switch_and_snapshots_read_their_own(harness: Harness, towers: Any) -> None:
    harness.write(1, towers(1))
    store = harness.make().start()
    numbers: list[int] = []
    store.on_apply.append(lambda served, seconds: numbers.append(served.number))
    first = store.served()
    harness.write(2, towers(2), parent=1)
    harness.land(store, 2)
    second = store.served()
    assert (second.number, second.kind, second.model) == (2, "delta", description(2))
    got = store.lookup("u", U_KEYS, at=second)
    assert got.version == 2 and got.found.tolist() == [True] * 40 + [False] * 10
    np.testing.assert_array_equal(got.rows[:40], u_rows(2, U_KEYS[:40]))

    def at_or_moved(at: ServedVersion, table: str, keys: np.ndarray, want: np.ndarray) -> None:
        """The protocol: a lookup at a snapshot answers its rows or VersionMoved."""
        try:
            got = store.lookup(table, keys, at=at)
        except VersionMoved:
            return
        assert got.version == at.number
        np.testing.assert_array_equal(got.rows, want)

    at_or_moved(first, "t", KEYS, t_expected(1, KEYS))
    harness.write(3, towers(3), with_u=False)  # a new base without u
    harness.land(store, 3)
    assert store.tables() == {"t": 4}
    with pytest.raises(NotFound, match="no table 'u'"):
        store.lookup("u", U_KEYS)
    at_or_moved(second, "u", U_KEYS[:40], u_rows(2, U_KEYS[:40]))
    at_or_moved(second, "t", KEYS, t_expected(2, KEYS))
    assert store.lookup("t", KEYS, at=store.served()).version == 3
    assert numbers == [2, 3] and store.counters.applied == 3


def test_status_reports_the_same_fields(harness: Harness, towers: Any) -> None:
    harness.write(1, towers(1))
    store = harness.make().start()
    harness.write(2, towers(2), parent=1)
    harness.land(store, 2)
    (status,) = Service([store]).status()
    for table in status["tables"]:
        table.pop("bytes")  # Redis does not know its tables' memory
    (version,) = status.pop("versions")  # TensorFlow Serving's model status
    assert (version["version"], version["state"], version["error"]) == (2, "AVAILABLE", "")
    assert status == {
        "name": "m",
        "version": 2,
        "step": 20,
        "tables": [{"name": "t", "dim": 4, "rows": 200}, {"name": "u", "dim": 3, "rows": 40}],
        "missing_keys": "zeros",
        "precision": "fp32",
        "applied": 2,
        "refused": 0,
        "lookups_only": "",
    }


def test_a_version_whose_tower_does_not_load_is_refused(harness: Harness, towers: Any) -> None:
    harness.write(1, towers(1))
    store = harness.make().start()
    refused: list[int] = []
    store.on_refuse.append(lambda number, why: refused.append(number))
    harness.write(2, towers(2, broken=True))
    harness.land(store, 2, refused=1)
    assert store.version == 1 and store.counters.refused == 1 and refused == [2]
    assert store.lookup("t", KEYS).version == 1
    harness.write(3, towers(3))
    harness.land(store, 3)
    assert store.counters.refused == 1 and store.served().tower is not None


def test_predictions_are_of_one_version_while_versions_switch(
    harness: Harness, towers: Any
) -> None:
    """gRPC, HTTP and Service clients predict while deltas and full versions
    land: every answer's rows, description (string hashing) and tower are of
    the version it names."""
    for v in range(1, 9):
        towers(v)  # saved before the clock starts
    harness.write(1, towers(1))
    store = harness.make().start()
    service = Service([store])
    grpc_server = GrpcServer(service)
    http_server = HttpServer(service)
    rows = 8
    words = [str(k) for k in KEYS[:rows]]
    stop = threading.Event()
    problems: list[str] = []
    seen: dict[str, set[int]] = {"grpc": set(), "http": set(), "service": set()}

    def check(how: str, scores: Any, version: int) -> None:
        scores = np.asarray(scores, np.float32).reshape(-1)
        if not (scores == expected_score(version)).all():
            problems.append(f"{how}: version {version} answered {scores[:3]}")
        seen[how].add(version)

    def over_grpc() -> None:
        with Client(f"127.0.0.1:{grpc_server.port}", timeout=30) as client:
            while not stop.is_set():
                outputs, version = client.predict({"k": words, "x": [0.5] * rows})
                check("grpc", outputs["predictions"], version)

    def over_http() -> None:
        body = json.dumps({"instances": [{"k": w, "x": 0.5} for w in words]})
        while not stop.is_set():
            connection = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=30)
            connection.request("POST", "/v1/models/m:predict", body)
            answer = json.loads(connection.getresponse().read())
            connection.close()
            if "error" in answer:
                problems.append(f"http: {answer['error']}")
                return
            check("http", answer["predictions"], int(answer["model_version"]))

    def direct() -> None:
        while not stop.is_set():
            described: list[ModelDescription] = []

            def decode(
                model: ModelDescription, described: list[ModelDescription] = described
            ) -> tuple[dict[str, FeatureInput], int]:
                described.append(model)
                f = model.sparse_by_name["k"]
                keys = HASHED[:rows] if f.hash_field else KEYS[:rows]
                return {
                    "k": FeatureInput(keys),
                    "x": FeatureInput(np.zeros((rows, 1), np.float32)),
                }, rows

            answer = service.predict("m", decode)
            if described[-1] != description(answer.version):
                problems.append(f"service: version {answer.version} decoded with another's")
            check("service", answer.outputs["predictions"], answer.version)

    def safely(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except Exception as error:
                problems.append(f"{work.__name__}: {error!r}")

        return run

    threads = [threading.Thread(target=safely(w)) for w in (over_grpc, over_http, direct)]
    for t in threads:
        t.start()
    try:
        for v in range(2, 9):
            parent = None if v % 3 == 0 else v - 1  # deltas, and a new base now and then
            harness.write(v, towers(v), parent=parent)
            harness.land(store, v)
            time.sleep(0.15)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        http_server.stop()
        grpc_server.stop()
    assert not problems, problems[:5]
    for how, versions in seen.items():
        assert len(versions) >= 3, (how, versions)


def test_without_towers_predictions_are_failed_precondition(harness: Harness, towers: Any) -> None:
    harness.towers = False
    harness.write(1, towers(1))
    store = harness.make().start()
    service = Service([store])
    features = {"k": FeatureInput(KEYS[:2]), "x": FeatureInput(np.zeros((2, 1), np.float32))}
    with pytest.raises(FailedPrecondition, match="version 1 serves lookups only") as info:
        service.predict("m", features, 2)
    why = str(info.value).split("predictions: ", 1)[1]
    assert why in (
        "its towers are not loaded (load_towers=False)",
        "the replica has no export directory for its towers (serve --exports)",
    )
    assert service.status()[0]["lookups_only"] == why
    assert service.lookup("m", "t", KEYS).version == 1
    grpc_server = GrpcServer(service)
    http_server = HttpServer(service)
    try:
        with Client(f"127.0.0.1:{grpc_server.port}") as client:
            with pytest.raises(ServingClientError) as error:
                client.predict({"k": [1, 2], "x": [0.5, 0.5]})
            assert error.value.code == "FAILED_PRECONDITION" and why in error.value.message
            assert client.status()[0]["lookups_only"] == why
        connection = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=30)
        connection.request("POST", "/v1/models/m:predict", '{"instances": [{"k": 1, "x": 0}]}')
        response = connection.getresponse()
        assert response.status == 400 and why in json.loads(response.read())["error"]
        connection.close()
    finally:
        http_server.stop()
        grpc_server.stop()
