"""The serving device cache (``wuliang.serving.device_cache``,
``ModelStore(gpu_cache_rows=N)``, ``wuliang serve --gpu-cache-rows N``).

Versions are written directly (``VersionWriter``) with known rows and shows.
Table ``t`` (dim 4): key k at version v reads ``[v, k, w, 0]`` (w random,
kept from the last version that wrote it); table ``u`` (dim 3) is smaller
than the cache. Every test compares a cached store with a store without the
cache (or with the engine it serves from), exactly: the rows predictions
read (``predict_rows``) after a full version, deltas that change, add and
remove rows (cached and not), and a new full version; in fp32, fp16 and
int8. Also: lookups never read the cache, the cache holds the top N keys by
shows, its counters for a known key set, ``/metrics``, reads while versions
switch (never a mix), the CLI flag end to end, and its checks.
The cupy variants run where there is a GPU (``needs_gpu``)."""

from __future__ import annotations

import http.client
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from serve_cli import running, serve_fails

from wuliang.ps_server import SGD, RowChunk, TableSpec
from wuliang.ps_server.storage import VersionWriter
from wuliang.serving.device_cache import DeviceCache
from wuliang.serving.errors import VersionMoved
from wuliang.serving.store import ModelStore

XPS = ["numpy", pytest.param("cupy", marks=pytest.mark.needs_gpu)]
N = 40  # cached rows per table


class Versions:
    """An export directory written version by version, and what each table
    holds at the newest version (``rows``, ``shows`` per key)."""

    def __init__(self, root: Path, seed: int = 0, tower: Path | None = None) -> None:
        self.root = root
        self.tower = tower  # a SavedModel copied into each version (wuliang serve loads it)
        self.rng = np.random.default_rng(seed)
        self.tables: dict[str, dict[int, tuple[np.ndarray, float]]] = {"t": {}, "u": {}}
        self.number = 0

    def write(
        self,
        full: bool,
        t_keys: np.ndarray,
        t_removed: np.ndarray | None = None,
        u_keys: np.ndarray | None = None,
        u_removed: np.ndarray | None = None,
    ) -> int:
        """Version number+1: ``t_keys`` (and ``u_keys``) written with fresh
        rows and shows, the removed keys removed (a delta of the previous
        version unless ``full``)."""
        v = self.number + 1
        parent = None if full else self.number
        dims = {"t": 4, "u": 3}
        written = {"t": t_keys, "u": np.zeros(0, np.uint64) if u_keys is None else u_keys}
        removed = {"t": t_removed, "u": u_removed}
        with VersionWriter(self.root, str(v), "full" if full else "delta") as writer:
            for table, keys in written.items():
                keys = np.asarray(keys, np.uint64)
                if full:
                    self.tables[table] = {}
                rows = np.zeros((len(keys), dims[table]), np.float32)
                rows[:, 0] = v
                rows[:, 1] = keys.astype(np.float32)
                rows[:, 2:] = self.rng.normal(size=(len(keys), dims[table] - 2))
                # distinct shows (a ranking without ties), some keys very hot
                shows = self.rng.permutation(len(keys)).astype(np.float32) * 3 + 0.5
                for k, row, s in zip(keys.tolist(), rows, shows.tolist(), strict=True):
                    self.tables[table][k] = (row, s)
                chunk = RowChunk(
                    keys=keys,
                    weights=rows,
                    state=np.zeros((len(keys), 0), np.float32),
                    counts=np.ones(len(keys), np.uint32),
                    steps=np.full(len(keys), v, np.uint64),
                    times=np.zeros(len(keys), np.uint32),
                    versions=np.full(len(keys), v, np.uint64),
                    shows=shows,
                )
                spec = TableSpec(table, dims[table], optimizer=SGD())
                writer.write_table(spec, [chunk], state=False)
                gone = np.zeros(0, np.uint64) if removed[table] is None else removed[table]
                if not full:
                    writer.write_removed(table, np.asarray(gone, np.uint64))
                for k in np.asarray(gone).tolist():
                    self.tables[table].pop(k, None)
            if self.tower is not None:
                shutil.copytree(self.tower, writer.path("serving"), dirs_exist_ok=True)
                writer.add_tree("serving")
            writer.commit(number=v, parent=parent, engine_version=v, step=10 * v)
        (self.root / "LATEST").write_text(f"{v}\n")
        self.number = v
        return v

    def top(self, table: str, n: int) -> set[int]:
        """The n keys of a table with the most shows."""
        ranked = sorted(self.tables[table].items(), key=lambda kv: (-kv[1][1], kv[0]))
        return {k for k, _ in ranked[:n]}


def keys_of(*ranges: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.arange(a, b, dtype=np.uint64) for a, b in ranges])


PROBE = keys_of((0, 400))  # every key the versions write, and some never written


def store(root: Path, rows: int = 0, xp: str = "numpy", **kwargs: object) -> ModelStore:
    return ModelStore(
        root,
        "m",
        poll_secs=0,
        load_towers=False,
        gpu_cache_rows=rows,
        gpu_cache_xp=xp,
        **kwargs,  # type: ignore[arg-type]
    )


def assert_cache_is_the_engines(cached: ModelStore) -> None:
    """Every cached row equals the engine's row of the snapshot's version."""
    cache = cached.device_cache
    assert cache is not None
    for table in cached.tables():
        snap = cache.snapshot(table)
        assert snap is not None, table
        assert (snap.keys[1:] > snap.keys[:-1]).all()  # sorted, distinct
        engine = cached.ps.lookup(table, snap.keys)
        assert engine.version == snap.version
        assert engine.found.all()
        np.testing.assert_array_equal(cache.kernels.to_host(snap.rows), engine.rows)


def assert_same_lookups(cached: ModelStore, plain: ModelStore, version: int) -> None:
    """The rows a prediction reads through the cache, and lookups, are the
    store's without it; lookups leave the cache's counters alone."""
    cache = cached.device_cache
    assert cache is not None
    for table in ("t", "u"):
        for keys in (PROBE, PROBE[::-1].astype(np.int64), PROBE[:7], np.zeros(0, np.uint64)):
            want = plain.lookup(table, keys)
            before = cache.stats().get(table)
            got = cached.lookup(table, keys)
            assert cache.stats().get(table) == before  # the engine alone
            assert got.version == want.version == version
            np.testing.assert_array_equal(got.rows, want.rows)
            got = cached.predict_rows(table, keys)
            assert got.version == want.version == version
            np.testing.assert_array_equal(got.found, want.found)
            rows = cache.kernels.to_host(got.rows)
            np.testing.assert_array_equal(rows, want.rows)
            assert rows.dtype == np.float32 and rows.flags.c_contiguous


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize(
    ("precision", "missing"), [("fp32", "zeros"), ("fp16", "initial"), ("int8", "zeros")]
)
def test_cached_lookups_equal_uncached_ones_across_versions(
    tmp_path: Path, xp: str, precision: str, missing: str
) -> None:
    versions = Versions(tmp_path / "m")
    versions.write(True, keys_of((1, 201)), u_keys=keys_of((1, 21)))
    options = {"precision": precision, "missing": missing}
    with store(versions.root, N, xp, **options) as cached, store(versions.root, **options) as plain:
        assert cached.device_cache is not None
        cached.device_cache.rerank_every = 3  # deltas patched twice, then ranked
        assert_same_lookups(cached, plain, 1)
        assert_cache_is_the_engines(cached)
        top = versions.top("t", N)
        # deltas: change hot and cold rows, add rows, remove cached and uncached ones
        steps = [
            (keys_of((1, 60), (250, 270)), np.array([*sorted(top)[:5], 150, 151], np.uint64)),
            (keys_of((100, 140), (270, 300)), np.array([*sorted(top)[5:9], 10, 275], np.uint64)),
            (keys_of((1, 5)), np.zeros(0, np.uint64)),  # the third: ranked afresh
            (np.zeros(0, np.uint64), keys_of((30, 40))),
        ]
        for t_keys, t_removed in steps:
            v = versions.write(False, t_keys, t_removed, keys_of((5, 10)), keys_of((15, 17)))
            assert cached.refresh() == plain.refresh() == [v]
            assert_same_lookups(cached, plain, v)
            assert_cache_is_the_engines(cached)
        v = versions.write(True, keys_of((100, 390)), u_keys=keys_of((1, 10)))
        assert cached.refresh() == plain.refresh() == [v]
        assert_same_lookups(cached, plain, v)
        assert_cache_is_the_engines(cached)
        snap = cached.device_cache.snapshot("t")
        assert snap is not None and snap.deltas == 0
        assert {int(k) for k in snap.keys} == versions.top("t", N)


@pytest.mark.parametrize("xp", XPS)
def test_the_cache_holds_the_top_keys_by_shows(tmp_path: Path, xp: str) -> None:
    versions = Versions(tmp_path / "m", seed=1)
    versions.write(True, keys_of((1, 301)), u_keys=keys_of((1, 21)))
    with store(versions.root, N, xp) as cached:
        cache = cached.device_cache
        assert cache is not None
        cache.rerank_every = 1  # every delta ranks afresh
        for table, n in (("t", N), ("u", 20)):  # u: smaller than the cache
            snap = cache.snapshot(table)
            assert snap is not None and snap.size == n and snap.version == 1
            assert {int(k) for k in snap.keys} == versions.top(table, N)
            # the engine kept the exported shows
            shows = {
                int(k): float(s)
                for c in cached.ps.export(table)
                for k, s in zip(c.keys, c.shows, strict=True)
            }
            assert shows == {k: s for k, (_, s) in versions.tables[table].items()}
        # a delta writes new shows (and hot new keys); ranked afresh
        v = versions.write(False, keys_of((200, 400)), keys_of((1, 11)))
        cached.refresh()
        snap = cache.snapshot("t")
        assert snap is not None and snap.version == v
        assert {int(k) for k in snap.keys} == versions.top("t", N)
        shows = {
            int(k): float(s)
            for c in cached.ps.export("t")
            for k, s in zip(c.keys, c.shows, strict=True)
        }
        assert shows == {k: s for k, (_, s) in versions.tables["t"].items()}


def test_hits_misses_and_bytes_are_counted_exactly(tmp_path: Path) -> None:
    from wuliang.serving.service import Service  # grpc and prometheus: not on a GPU check's machine

    versions = Versions(tmp_path / "m", seed=2)
    versions.write(True, keys_of((1, 201)), u_keys=keys_of((1, 21)))
    with store(versions.root, N) as cached:
        cache = cached.device_cache
        assert cache is not None
        hot = np.array(sorted(versions.top("t", N)), np.uint64)
        cold = np.setdiff1d(keys_of((1, 201)), hot)[:25]
        unknown = keys_of((1000, 1005))
        cached.predict_rows("t", hot[:10])  # all hits
        cached.predict_rows("t", cold)  # all misses
        cached.lookup("t", hot)  # lookups read the engine alone
        mixed = np.concatenate([hot[10:30], cold[:7], unknown, hot[10:13]])  # repeats count
        got = cached.predict_rows("t", mixed)
        np.testing.assert_array_equal(got.found, ~np.isin(mixed, unknown))
        misses = 25 + 7 + 5
        stats = cache.stats()["t"]
        assert stats == {
            "hits": 10 + 20 + 3,
            "misses": misses,
            "copied_bytes": (7 + 5) * 4 * 4,  # miss rows of the mixed lookup, dim 4
            "rows": N,
            "bytes": N * 4 * 4,
            "version": 1,
        }
        assert cache.stats()["u"]["rows"] == 20 and cache.stats()["u"]["hits"] == 0

        service = Service([cached])
        text = service.metrics.text().decode()
        labels = '{model="m",table="t"}'
        for line in (
            f"wuliang_device_cache_hits_total{labels} 33.0",
            f"wuliang_device_cache_misses_total{labels} {float(misses)}",
            f"wuliang_device_cache_copied_bytes_total{labels} 192.0",
            f"wuliang_device_cache_rows{labels} 40.0",
            f"wuliang_device_cache_bytes{labels} 640.0",
            f"wuliang_device_cache_version{labels} 1.0",
            'wuliang_device_cache_rows{model="m",table="u"} 20.0',
        ):
            assert line in text, line
        service.close()


def test_without_the_cache_nothing_changes(tmp_path: Path) -> None:
    from wuliang.serving.service import Service

    versions = Versions(tmp_path / "m")
    versions.write(True, keys_of((1, 51)), u_keys=keys_of((1, 5)))
    with store(versions.root) as plain:
        assert plain.device_cache is None
        service = Service([plain])
        assert "wuliang_device_cache" not in service.metrics.text().decode()
        service.close()


def test_a_table_a_full_version_drops_leaves_the_cache(tmp_path: Path) -> None:
    versions = Versions(tmp_path / "m")
    versions.write(True, keys_of((1, 51)), u_keys=keys_of((1, 5)))
    with store(versions.root, N) as cached:
        assert cached.device_cache is not None
        assert cached.device_cache.snapshot("u") is not None
        v = 2
        with VersionWriter(versions.root, str(v), "full") as writer:
            keys = keys_of((1, 10))
            rows = np.ones((len(keys), 4), np.float32)
            chunk = RowChunk(
                keys, rows, np.zeros((len(keys), 0), np.float32), np.ones(len(keys), np.uint32),
                np.full(len(keys), v, np.uint64), np.zeros(len(keys), np.uint32),
                np.full(len(keys), v, np.uint64),
            )  # fmt: skip
            writer.write_table(TableSpec("t", 4, optimizer=SGD()), [chunk], state=False)
            writer.commit(number=v, parent=None, engine_version=v, step=20)
        assert cached.refresh() == [2]
        assert cached.device_cache.snapshot("u") is None
        assert set(cached.tables()) == {"t"}
        got = cached.predict_rows("t", keys_of((0, 12)))
        assert got.version == 2 and got.found.sum() == 9
        np.testing.assert_array_equal(cached.device_cache.kernels.to_host(got.rows)[got.found], 1)


@pytest.mark.parametrize("xp", XPS)
def test_reads_while_versions_switch_never_mix_versions(tmp_path: Path, xp: str) -> None:
    """Readers read hot and cold keys for predictions while deltas and full
    versions land; every row found carries the version its answer names
    (every version rewrites every row), and a read at a snapshot reads that
    version or raises VersionMoved."""
    versions = Versions(tmp_path / "m", seed=3)
    every = keys_of((1, 301))
    versions.write(True, every, u_keys=keys_of((1, 21)))
    with store(versions.root, N, xp) as cached:
        cache = cached.device_cache
        assert cache is not None
        cache.rerank_every = 4
        stop = threading.Event()
        seen: list[set[int]] = []
        errors: list[str] = []
        moved = [0]

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            versions_seen: set[int] = set()
            seen.append(versions_seen)
            while not stop.is_set():
                keys = rng.choice(every, size=int(rng.integers(1, 80)))
                at = cached.served() if rng.random() < 0.5 else None
                try:
                    got = cached.predict_rows("t", keys, at=at)
                except VersionMoved:
                    moved[0] += 1
                    continue
                rows = cache.kernels.to_host(got.rows)
                versions_seen.add(got.version)
                if at is not None and got.version != at.number:
                    errors.append(f"asked for {at.number}, got {got.version}")
                if not got.found.all() or (rows[:, 0] != got.version).any():
                    errors.append(f"a mix: version {got.version}, rows {set(rows[:, 0])}")
                np.testing.assert_array_equal(rows[:, 1], keys.astype(np.float32))

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(12):  # every version rewrites every row of t
                versions.write(i % 5 == 4, every, u_keys=keys_of((1, 21)))
                cached.refresh()
                time.sleep(0.01)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[:5]
        assert len(set().union(*seen)) > 1
        assert_cache_is_the_engines(cached)
        stats = cached.device_cache.stats()["t"]
        assert stats["hits"] > 0 and stats["misses"] > 0


def test_the_cache_size_is_checked() -> None:
    from wuliang.serving.run import ServeOptions, check_options

    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")):
            check_options(ServeOptions(Path("."), gpu_cache_rows=bad))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="gpu_cache_rows must be an int >= 0"):
            ModelStore(Path("."), gpu_cache_rows=bad)  # type: ignore[arg-type]
    redis = "redis://127.0.0.1:1/0"
    with pytest.raises(ValueError, match="--gpu-cache-rows 5 needs an export directory"):
        check_options(ServeOptions(None, redis=redis, model="m", gpu_cache_rows=5))
    check_options(ServeOptions(None, redis=redis, model="m", gpu_cache_rows=0))
    with pytest.raises(ValueError, match="xp must be one of"):
        ModelStore(Path("."), gpu_cache_rows=3, gpu_cache_xp="gpu")
    with pytest.raises(ValueError, match="rerank_every must be an int >= 1, got 0"):
        DeviceCache(None, 3, xp="numpy", rerank_every=0)  # type: ignore[arg-type]


# -- wuliang serve --gpu-cache-rows ---------------------------------------------------


def metrics(http_port: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        connection.close()


def saved_model(folder: Path) -> Path:
    """A SavedModel with a ``serve`` function (never called here)."""
    import tensorflow as tf

    class Tower(tf.Module):
        @tf.function(input_signature=[{"x": tf.TensorSpec([None, 1], tf.float32)}])
        def serve(self, inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
            return {"predictions": inputs["x"][:, 0]}

    tf.saved_model.save(Tower(), str(folder))
    return folder


def test_wuliang_serve_with_a_device_cache(tmp_path: Path) -> None:
    from wuliang.serving.client import Client

    versions = Versions(tmp_path / "m", seed=4, tower=saved_model(tmp_path / "tower"))
    versions.write(True, keys_of((1, 201)), u_keys=keys_of((1, 21)))
    hot = np.array(sorted(versions.top("t", 30)), np.uint64)
    cold = np.setdiff1d(keys_of((1, 201)), hot)[:10]
    args = ["--exports", str(versions.root), "--model", "m", "--gpu-cache-rows", "30"]
    with running(tmp_path, *args, "--poll-secs", "0.1") as server:
        grpc_port, http_port, log = server.grpc, server.http, server.log
        client = Client(f"127.0.0.1:{grpc_port}")
        try:
            keys = np.concatenate([hot[:12], cold])
            got = client.lookup("t", keys)
            assert got.version == 1 and got.found.all()
            want = np.stack([versions.tables["t"][int(k)][0] for k in keys])
            np.testing.assert_array_equal(got.rows, want)
            text = metrics(http_port)
            labels = '{model="m",table="t"}'
            assert f"wuliang_device_cache_hits_total{labels} 0.0" in text  # lookups: the engine
            assert f"wuliang_device_cache_misses_total{labels} 0.0" in text
            assert f"wuliang_device_cache_rows{labels} 30.0" in text
            assert f"wuliang_device_cache_version{labels} 1.0" in text
            # a delta is served, cached rows switched with it
            v = versions.write(False, hot[:5], hot[5:7])
            deadline = time.monotonic() + 60
            switched = f"wuliang_device_cache_version{labels} {float(v)}"
            # lookups read the engine, which has the delta before the cache switches
            while client.lookup("t", hot[:1]).version != v or switched not in metrics(http_port):
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            got = client.lookup("t", hot[:8])
            assert got.version == v
            np.testing.assert_array_equal(got.found, [True] * 5 + [False] * 2 + [True])
            want = np.stack([versions.tables["t"][int(k)][0] for k in hot[[0, 1, 2, 3, 4, 7]]])
            np.testing.assert_array_equal(got.rows[got.found], want)
        finally:
            client.close()
    assert "device cache: the 30 hottest rows of each table on" in log.read_text()


def test_wuliang_serve_refuses_a_bad_cache_size(tmp_path: Path) -> None:
    for args, named in (
        (["--exports", str(tmp_path), "--gpu-cache-rows", "-1"], "--gpu-cache-rows"),
        (["--exports", str(tmp_path), "--gpu-cache-rows", "many"], "'many'"),
        (["--redis", "redis://127.0.0.1:1/0", "--model", "m", "--gpu-cache-rows", "5"],
         "--gpu-cache-rows 5 needs an export directory"),
    ):  # fmt: skip
        done = serve_fails(*args)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert named in done.stderr.strip().splitlines()[-1], done.stderr
