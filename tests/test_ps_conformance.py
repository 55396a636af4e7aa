"""Conformance suite of the parameter-server interface (``wuliang.ps_server.ParameterServer``).

Every implementation of the interface (the embedded engine; the remote
client over two parameter servers on threads of this process; the GPU hot
cache in front of an embedded engine, with numpy arrays and 16 rows per
table, so that rows come and go all the time) must pass this file unchanged.

How an implementation joins: add one entry to ``IMPLEMENTATIONS``, a name and
a function ``num_shards -> ParameterServer`` that returns a fresh, empty
server (typically ``parameter_server(address, num_shards=num_shards)``). The
``make_ps`` fixture is the only place implementations are named: every test
then runs against each one, at each shard count of ``SHARDS``, and every
server made is closed after its test (every one, also after a close that
fails). The tests use the ``ParameterServer`` interface and the public spec
classes only (no ``Engine`` attribute such as ``native``, the ``step``
setter or ``worker_thread_ids``), and are self-contained (no fixtures or
helpers of other test files; only the ``wuliang ps`` child processes are
started and stopped through ``tests/processes.py``, so that none outlives
the session whatever fails).

The remote client runs twice: over servers on threads of the test process
(every test) and over ``wuliang ps`` child processes (the tests named in
``PROCESS_TESTS``: each server made there costs two process starts).

What passing guarantees, for every implementation and shard count:

1. Optimizers: SGD, Adagrad, lazy Adam (per-row step count and bias
   correction) and FTRL-Proximal, with and without ``clip_norm``, follow the
   formulas of ``wuliang.ps_server.spec`` (a float64 numpy reference in this
   file) to float32 accuracy, over several pushes with keys repeated within a
   push (gradients summed) and across pushes; untouched keys keep no row and
   read their initial vector. The exported optimizer state has one layout
   everywhere (Adagrad ``[acc]``, Adam ``[m, v, t]``, FTRL ``[z, n]``, SGD
   none), so rows move between implementations.
2. Concurrency: many threads pulling and pushing at once, synchronously and
   through the ``*_async`` handles, lose no update and never see a torn row.
3. ``erase``: its count, ``contains``, initial vectors again, and the
   removal log with the version current at the erase.
4. ``export`` / ``load``: every column survives a round trip between servers
   of different shard counts, whatever the chunk size.
5. Deltas: ``export(since=v)`` and ``removed_log(since=v)`` give exactly what
   changed after ``advance_version``; ``trim_removed``; ``restore_version``.
6. Admission: rows on the ``min_count``-th training pull, earlier pushes
   dropped and counted, ``pending_counts`` / ``load_pending`` round trip.
7. Eviction while a table grows (``max_rows`` and TTL in steps): the bound
   holds after every ``evict``, recent and frequent rows stay, every evicted
   key is in the removal log.
8. Steps travel with the calls: rows carry the step of the call that wrote
   them; the server keeps no step of its own that a caller must set.
9. Bad input raises ``TypeError`` / ``ValueError`` / ``UnknownTableError``
   naming what is wrong, before anything changes; errors of async calls come
   out of ``wait()``.
10. Show and click statistics: pushes add their increments (repeated keys
   summed) after decaying a row's by ``stats_half_life`` from its last
   update; ``count`` is unchanged by them; ``top_keys`` orders keys by
   shows decayed to a step; export / load and part files carry them exactly.
11. ``read_rows``: for any keys (repeated, absent, none), exactly the rows
   ``export`` gives of them, every column, in the order of the keys, and
   which keys have one; it changes nothing. ``exchange_many`` (a hot
   cache's round: rows given back, misses pulled, incoming rows read)
   gives what those calls give one after the other.
12. The clock: with ``set_clock(T)`` every call that writes a row stamps T
   (``clock()`` reads it back), TTLs in seconds count back from T, so a
   trainer replaying month-old partitions evicts nothing live and one that
   resumes after days evicts nothing by the wall clock; ``None`` returns to
   the wall clock; a bad value raises ``ValueError`` naming it, and changes
   nothing.
13. Sized tables: an extension block (``TableSpec(grow=Grow(...))``) gets a
   key's row at the push that takes its base row's decayed score to
   ``promote`` (with that push's gradient), never at a pull; keys below read
   zeros and their pushes are dropped and counted; ``evict`` shrinks keys
   whose score fell below ``demote`` (logged as removals), not those between
   the thresholds; export / load of a block round-trips; the base cannot be
   dropped while a block grows from it.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from wuliang.ps_server import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Constant,
    Engine,
    Eviction,
    ExchangePart,
    Grow,
    Optimizer,
    ParameterServer,
    PullPart,
    PushPart,
    PushResult,
    RowChunk,
    TableSpec,
    TableUpdate,
    TruncatedNormal,
    Uniform,
    UnknownTableError,
    Zeros,
    parameter_server,
    server_of,
    shard_of,
)

MakeServer = Callable[[int], ParameterServer]


def remote_on_threads(shards: int, servers: int = 2) -> ParameterServer:
    """A RemoteServer over ``servers`` parameter servers running on threads
    of this process (each an engine of ``shards`` shards behind gRPC on a
    free loopback port); closing the client stops them."""
    from wuliang.ps_server import Engine
    from wuliang.ps_server.remote.client import RemoteServer
    from wuliang.ps_server.remote.server import PsServer

    running = [PsServer(Engine(shards), "127.0.0.1", 0, threads=8) for _ in range(servers)]
    client = RemoteServer([f"127.0.0.1:{s.port}" for s in running], timeout=30.0)
    close = client.close

    def close_all() -> None:
        close()
        for server in running:
            server.stop(grace=None)

    client.close = close_all  # type: ignore[method-assign]
    return client


def remote_processes(shards: int, servers: int = 2) -> ParameterServer:
    """A RemoteServer over ``servers`` ``wuliang ps`` child processes of
    ``shards`` shard threads each, on free loopback ports (read from their
    start lines, each waited for at most 60 s); closing the client stops
    them, and asserts that each exited 0 on SIGTERM. The processes come
    from ``tests/processes.py``: each in a process group of its own, killed
    when a stop times out, stopped at the session's end should nothing else
    stop them, and stopping by itself should this process die."""
    import re
    import subprocess
    import tempfile

    import processes

    from wuliang.ps_server.remote.client import RemoteServer

    command = processes.ps_command("--port", "0", "--threads", str(shards))
    logs = [tempfile.TemporaryFile() for _ in range(servers)]  # noqa: SIM115 (closed in stop)
    procs: list[subprocess.Popen[bytes]] = []

    def stop(check: bool = True) -> None:
        try:
            codes = processes.stop_each(procs)
        finally:
            said = []
            for log in logs:
                log.seek(0)
                said.append(log.read().decode(errors="replace")[-6000:])
                log.close()
        assert not check or codes == [0] * len(procs), (
            f"wuliang ps exit codes {codes} after SIGTERM; their stderr:\n" + "\n---\n".join(said)
        )

    try:
        for log in logs:
            procs.append(processes.spawn(command, stdout=subprocess.PIPE, stderr=log))
        addresses = []
        for proc in procs:
            line = processes.read_line(proc)
            match = re.search(r"listening on grpc (\S+):(\d+)", line)
            assert match, f"wuliang ps did not start: {line!r} (exit code {proc.poll()})"
            addresses.append(f"127.0.0.1:{match[2]}")
        client = RemoteServer(addresses, timeout=30.0)
    except BaseException:
        stop(check=False)  # one that had not started yet exits -15: the error is the start's
        raise
    close = client.close

    def close_all() -> None:
        try:
            close()
        finally:  # the servers stop even when the client's close fails
            stop()

    client.close = close_all  # type: ignore[method-assign]
    return client


# name -> a fresh, empty server with that many shards. One entry per implementation.
IMPLEMENTATIONS: dict[str, MakeServer] = {
    "embedded": lambda shards: parameter_server("embedded", num_shards=shards),
    "remote": remote_on_threads,
    "cached": lambda shards: parameter_server(
        "embedded?gpu_cache_rows=16&xp=numpy", num_shards=shards
    ),
    # a budget of one byte: after every call every row goes to disk, and the
    # next call reads back what it needs (docs/disk_tier.md)
    "tiered": lambda shards: Engine(shards, disk_dir=TIER_DIR, memory_bytes=1),
}
# Slower (two processes per server made), so only for the tests named here.
PROCESSES: dict[str, MakeServer] = {"remote-processes": remote_processes}
PROCESS_TESTS = {
    "test_optimizer_matches_numpy_reference",
    "test_concurrent_pulls_and_pushes_lose_no_update",
    "test_export_load_round_trip_across_shard_counts",
    "test_export_since_a_version",
    "test_admission_on_the_third_training_pull",
    "test_keys_grouped_by_cell_pull_and_push_as_ungrouped",
    "test_lookup_reads_rows_found_and_the_version_label",
    "test_apply_update_full_then_delta",
    "test_bad_keys_grads_and_out",
}
TIER_DIR = tempfile.mkdtemp(prefix="wuliang-tiered-")  # each engine makes its own folder in it
atexit.register(shutil.rmtree, TIER_DIR, True)
SHARDS = (1, 3)
OTHER_SHARDS = {1: 4, 3: 2}  # the shard count of a second server, for round trips

SEED = 20240611
F32 = np.float32
COLUMNS = ("keys", "weights", "state", "counts", "steps", "times", "versions")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test against every implementation; those of PROCESS_TESTS also
    against servers in processes of their own."""
    if "make_ps" in metafunc.fixturenames:
        kinds = sorted(IMPLEMENTATIONS)
        if metafunc.function.__name__ in PROCESS_TESTS:
            kinds += sorted(PROCESSES)
        metafunc.parametrize("make_ps", kinds, indirect=True)


@pytest.fixture
def make_ps(request: pytest.FixtureRequest) -> Iterator[MakeServer]:
    """Makes servers of one implementation (by shard count); closes them after the test."""
    servers: list[ParameterServer] = []

    def make(num_shards: int) -> ParameterServer:
        server = {**IMPLEMENTATIONS, **PROCESSES}[request.param](num_shards)
        servers.append(server)
        return server

    yield make
    close_servers(servers)


# A disk tier's traffic: reads move rows between RAM and disk, not their state.
TIER_MOVES = ("cold_reads", "demoted", "demoted_written", "files_compacted")


def unmoved(stats: dict[str, Any]) -> dict[str, Any]:
    """A table's stats without its disk tier's traffic counters."""
    return {k: v for k, v in stats.items() if k not in TIER_MOVES}


def close_servers(servers: list[ParameterServer]) -> None:
    """Closes every server, also those after one whose close raises; then
    raises the first error (naming how many closes failed)."""
    errors: list[BaseException] = []
    for server in servers:
        try:
            server.close()
        except BaseException as error:  # the others are closed all the same
            errors.append(error)
    if len(errors) > 1:
        raise RuntimeError(
            f"closing {len(errors)} of {len(servers)} servers failed: "
            + "; ".join(repr(error) for error in errors)
        ) from errors[0]
    if errors:
        raise errors[0]


@pytest.fixture(params=SHARDS, ids=lambda n: f"{n}shard")
def shards(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def ps(make_ps: MakeServer, shards: int) -> ParameterServer:
    """A fresh server of each implementation at each shard count."""
    return make_ps(shards)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


# --- helpers ------------------------------------------------------------------


def sgd_table(
    ps: ParameterServer,
    name: str = "t",
    dim: int = 4,
    lr: float = 1.0,
    admission: Admission | None = None,
    eviction: Eviction | None = None,
) -> str:
    """An SGD table with random (but fixed per key) initial vectors."""
    spec = TableSpec(
        name,
        dim=dim,
        optimizer=SGD(learning_rate=lr),
        initializer=TruncatedNormal(stddev=0.1),
        seed=11,
        admission=admission or Admission(),
        eviction=eviction or Eviction(),
    )
    ps.create_table(spec)
    return name


def full(n: int, dim: int = 4, value: float = 1.0) -> np.ndarray:
    return np.full((n, dim), value, F32)


def u64(keys: Any) -> list[int]:
    """Keys as Python ints of their uint64 values (int64 -1 is 2**64 - 1)."""
    return [int(k) % 2**64 for k in np.asarray(keys).tolist()]


def export_all(
    ps: ParameterServer, table: str, since: int = 0, chunk_rows: int = 65536
) -> RowChunk:
    """Every exported row in one ``RowChunk``, sorted by key; checks the chunks."""
    spec = ps.spec(table)
    chunks = list(ps.export(table, since=since, chunk_rows=chunk_rows))
    dtypes = {
        "keys": np.uint64,
        "weights": F32,
        "state": F32,
        "counts": np.uint32,
        "steps": np.uint64,
        "times": np.uint32,
        "versions": np.uint64,
    }
    for chunk in chunks:
        n = len(chunk)
        assert 0 < n <= chunk_rows
        for name, dtype in dtypes.items():
            assert getattr(chunk, name).dtype == dtype, name
        assert chunk.weights.shape == (n, spec.dim)
        assert chunk.state.shape == (n, spec.state_dim)
        for name in ("counts", "steps", "times", "versions"):
            assert getattr(chunk, name).shape == (n,), name
    if not chunks:
        empty = {name: np.zeros(0, dtype) for name, dtype in dtypes.items()}
        empty["weights"] = np.zeros((0, spec.dim), F32)
        empty["state"] = np.zeros((0, spec.state_dim), F32)
        return RowChunk(**empty)
    columns = {name: np.concatenate([getattr(c, name) for c in chunks]) for name in COLUMNS}
    order = np.argsort(columns["keys"], kind="stable")
    rows = RowChunk(**{name: values[order] for name, values in columns.items()})
    assert len(np.unique(rows.keys)) == len(rows), "a key exported twice"
    return rows


def assert_same_rows(a: RowChunk, b: RowChunk, columns: tuple[str, ...] = COLUMNS) -> None:
    for name in columns:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def load_rows(ps: ParameterServer, table: str, rows: RowChunk) -> None:
    ps.load(
        table,
        rows.keys,
        rows.weights,
        rows.state,
        rows.counts,
        rows.steps,
        rows.times,
        rows.versions,
    )


def removed(ps: ParameterServer, table: str, since: int = 0) -> dict[int, int]:
    """The removal log after ``since`` as {key: version}; checks its order and dtypes."""
    keys, versions = ps.removed_log(table, since)
    assert keys.dtype == np.uint64 and versions.dtype == np.uint64
    assert keys.shape == versions.shape
    assert (np.diff(versions.astype(np.int64)) >= 0).all(), "not oldest first"
    assert (versions > since).all()
    return dict(zip(keys.tolist(), versions.tolist(), strict=True))


# --- 1. optimizers against a numpy reference ------------------------------------------

OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": SGD(learning_rate=0.1),
    "sgd-clip": SGD(learning_rate=0.1, clip_norm=0.5),
    "adagrad": Adagrad(learning_rate=0.05, initial_accumulator=0.1, epsilon=1e-7),
    "adagrad-clip": Adagrad(learning_rate=0.05, initial_accumulator=0.2, clip_norm=0.7),
    "adam": Adam(learning_rate=0.01, beta1=0.9, beta2=0.999, epsilon=1e-7),
    "adam-clip": Adam(learning_rate=0.02, beta1=0.8, beta2=0.99, epsilon=1e-6, clip_norm=0.6),
    "ftrl": FTRL(learning_rate=0.05, l1=0.2, l2=0.1, beta=1.0, initial_accumulator=0.1),
    "ftrl-clip": FTRL(learning_rate=0.1, l1=0.05, l2=0.3, beta=0.5, clip_norm=0.8),
}


def reference_state(opt: Optimizer, dim: int) -> np.ndarray:
    """A new row's optimizer state (float64), in the exported layout."""
    if isinstance(opt, Adagrad):
        return np.full(dim, opt.initial_accumulator)
    if isinstance(opt, Adam):
        return np.zeros(2 * dim + 1)  # m, v, t
    if isinstance(opt, FTRL):
        return np.concatenate([np.zeros(dim), np.full(dim, opt.initial_accumulator)])  # z, n
    return np.zeros(0)


def reference_update(
    opt: Optimizer, w: np.ndarray, state: np.ndarray, g: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One update of one row by its summed gradient, in float64, as in spec.py's docstring."""
    dim = len(w)
    norm = float(np.sqrt(np.sum(g * g)))
    if 0 < opt.clip_norm < norm:
        g = g * (opt.clip_norm / norm)
    lr = opt.learning_rate
    if isinstance(opt, SGD):
        return w - lr * g, state
    if isinstance(opt, Adagrad):
        acc = state + g * g
        return w - lr * g / (np.sqrt(acc) + opt.epsilon), acc
    if isinstance(opt, Adam):
        m, v, t = state[:dim], state[dim : 2 * dim], state[2 * dim] + 1
        m = opt.beta1 * m + (1 - opt.beta1) * g
        v = opt.beta2 * v + (1 - opt.beta2) * g * g
        lr_t = lr * math.sqrt(1 - opt.beta2**t) / (1 - opt.beta1**t)
        return w - lr_t * m / (np.sqrt(v) + opt.epsilon), np.concatenate([m, v, [t]])
    if isinstance(opt, FTRL):  # McMahan et al. (2013), Algorithm 1, alpha = lr
        z, n = state[:dim], state[dim:]
        n_new = n + g * g
        sigma = (np.sqrt(n_new) - np.sqrt(n)) / lr
        z = z + g - sigma * w
        w = np.where(
            np.abs(z) <= opt.l1,
            0.0,
            -(z - np.sign(z) * opt.l1) / ((opt.beta + np.sqrt(n_new)) / lr + opt.l2),
        )
        return w, np.concatenate([z, n_new])
    raise AssertionError(f"no reference for {opt!r}")


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_optimizer_matches_numpy_reference(
    opt_name: str, ps: ParameterServer, rng: np.random.Generator
) -> None:
    """Each optimizer follows its formula to float32 accuracy over several
    pushes; duplicate keys in a push are summed and updated once; untouched
    keys keep no row; weights, state, counts and steps export as expected."""
    opt, dim = OPTIMIZERS[opt_name], 8
    init = TruncatedNormal(stddev=0.1)
    ps.create_table(TableSpec("t", dim=dim, optimizer=opt, initializer=init, seed=7))
    keys = rng.integers(0, 2**64 - 1, size=40, dtype=np.uint64, endpoint=True)
    keys[:2] = [0, 2**64 - 1]
    assert len(np.unique(keys)) == len(keys)
    pushed_keys = 32  # keys 32..39 are never pushed

    initial = ps.pull("t", keys, train=False)
    assert initial.shape == (len(keys), dim) and initial.dtype == F32
    assert not ps.contains("t", keys).any(), "a lookup created rows"
    assert np.abs(initial).max() > 0
    np.testing.assert_array_equal(ps.pull("t", keys, train=False), initial)

    weights = initial.astype(np.float64)
    state = np.tile(reference_state(opt, dim), (len(keys), 1))
    counts = np.zeros(len(keys), np.int64)
    last_step = np.zeros(len(keys), np.int64)
    norms: list[float] = []
    for step in range(1, 6):
        idx = rng.integers(0, pushed_keys, size=48)  # repeats within and across pushes
        grads = rng.standard_normal((len(idx), dim)).astype(F32)
        grads *= rng.uniform(0.05, 1.5, size=(len(idx), 1)).astype(F32)
        result = ps.push("t", keys[idx], grads, step=step * 10)

        unique = np.unique(idx)
        assert result == PushResult(len(unique), 0, 0, len(idx) - len(unique))
        for i in unique:
            g = grads[idx == i].astype(np.float64).sum(axis=0)
            norms.append(float(np.linalg.norm(g)))
            weights[i], state[i] = reference_update(opt, weights[i], state[i], g)
        counts[unique] += 1
        last_step[unique] = step * 10
        np.testing.assert_allclose(
            ps.pull("t", keys, train=False), weights, rtol=2e-5, atol=2e-6, err_msg=f"step {step}"
        )

    if opt.clip_norm:  # both sides of the clip threshold were exercised
        assert min(norms) < opt.clip_norm < max(norms)
    if isinstance(opt, FTRL):  # both branches of the l1 threshold were exercised
        assert (weights[:pushed_keys] == 0).any() and (weights[:pushed_keys] != 0).any()

    has_row = counts > 0
    np.testing.assert_array_equal(ps.contains("t", keys), has_row)
    np.testing.assert_array_equal(ps.pull("t", keys[~has_row], train=False), initial[~has_row])
    rows = export_all(ps, "t")
    order = np.argsort(keys[has_row])
    np.testing.assert_array_equal(rows.keys, keys[has_row][order])
    np.testing.assert_allclose(rows.weights, weights[has_row][order], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(rows.state, state[has_row][order], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(rows.counts, counts[has_row][order])
    np.testing.assert_array_equal(rows.steps, last_step[has_row][order])
    if isinstance(opt, Adam):  # lazy: t counts each row's own updates
        np.testing.assert_array_equal(rows.state[:, 2 * dim], counts[has_row][order])


def test_adam_bias_correction_is_per_row(ps: ParameterServer) -> None:
    """Lazy Adam: a row pushed for the first time after others were pushed
    many times moves exactly as a row's first update does (its own t = 1)."""
    opt = Adam(learning_rate=0.1)
    ps.create_table(TableSpec("t", dim=2, optimizer=opt, initializer=Zeros()))
    g = np.array([[0.5, -2.0]], F32)
    for _ in range(5):
        ps.push("t", [1], g)
    ps.push("t", [2], g)
    ps.push("t", [3], g)
    first = ps.pull("t", [2, 3], train=False)
    # Step 1 with bias correction: m/(1-b1) = g, v/(1-b2) = g², so w = -lr * sign(g).
    np.testing.assert_allclose(first, [[-0.1, 0.1], [-0.1, 0.1]], rtol=1e-5)
    t = export_all(ps, "t").state[:, 4]
    np.testing.assert_array_equal(t, [5, 1, 1])


# --- 2. many threads --------------------------------------------------------------


def test_concurrent_pulls_and_pushes_lose_no_update(ps: ParameterServer) -> None:
    """Eight threads pull and push two tables at once, half through the async
    handles (a pull and a push in flight together): with SGD, constant initial
    vectors and gradients exact in float32, every final row is exactly its
    initial row minus lr × its key's occurrences, no pulled row is torn, and
    the update counts and push results add up."""
    ps.create_table(
        TableSpec("a", dim=4, optimizer=SGD(learning_rate=0.5), initializer=Constant(2.0))
    )
    ps.create_table(TableSpec("b", dim=3, optimizer=SGD(learning_rate=0.25), initializer=Zeros()))
    pool = (np.arange(300, dtype=np.uint64) * np.uint64(2654435761)) ^ np.uint64(2**63 + 5)
    threads, iterations, batch = 8, 150, 128
    barrier = threading.Barrier(threads, timeout=60)

    def check_pulled(out_a: np.ndarray, out_b: np.ndarray) -> None:
        """Untorn rows of initial - 0.5 × (occurrences pushed so far)."""
        for out, init in ((out_a, 2.0), (out_b, 0.0)):
            np.testing.assert_array_equal(out, np.broadcast_to(out[:, :1], out.shape))
            pushed = (init - out) / 0.5
            np.testing.assert_array_equal(pushed, np.round(pushed))
            assert (pushed >= 0).all()

    def batch_of(rng: np.random.Generator) -> tuple[np.ndarray, list[PullPart], list[PushPart]]:
        idx = rng.integers(0, len(pool), size=batch)
        keys = pool[idx]
        pulls = [
            PullPart("a", keys, np.empty((batch, 4), F32)),
            PullPart("b", keys, np.empty((batch, 3), F32)),
        ]
        pushes = [
            PushPart("a", keys, full(batch, 4, 1.0)),
            PushPart("b", keys, full(batch, 3, 2.0)),
        ]
        return idx, pulls, pushes

    def work(worker: int) -> tuple[np.ndarray, np.ndarray, PushResult, PushResult]:
        rng = np.random.default_rng([SEED, worker])
        occurrences = np.zeros(len(pool), np.int64)
        updates = np.zeros(len(pool), np.int64)
        got, expected = PushResult(0, 0, 0, 0), PushResult(0, 0, 0, 0)
        barrier.wait()
        pending: tuple[np.ndarray, list[PushPart]] | None = None
        for step in range(1, iterations + 2):
            idx, pulls, pushes = batch_of(rng)
            if worker % 2 == 0:
                if step > iterations:
                    break
                ps.pull_many(pulls, step=step)
                check_pulled(pulls[0].out, pulls[1].out)
                done = [(idx, ps.push_many(pushes, step=step))]
            else:  # pull this step's rows while the previous step's push runs
                pull = ps.pull_many_async(pulls, step=step) if step <= iterations else None
                push = ps.push_many_async(pending[1], step=step - 1) if pending else None
                done = [(pending[0], push.wait())] if push and pending else []
                if pull is not None:
                    assert pull.wait() is None
                    check_pulled(pulls[0].out, pulls[1].out)
                pending = (idx, pushes)
            for pushed_idx, result in done:
                unique = len(np.unique(pushed_idx))
                got += result
                expected += PushResult(2 * unique, 0, 0, 2 * (batch - unique))
                np.add.at(occurrences, pushed_idx, 1)
                updates[np.unique(pushed_idx)] += 1
        return occurrences, updates, got, expected

    with ThreadPoolExecutor(threads) as executor:
        results = [f.result() for f in [executor.submit(work, i) for i in range(threads)]]

    occurrences = sum(r[0] for r in results)
    updates = sum(r[1] for r in results)
    assert occurrences.sum() == threads * iterations * batch
    for _, _, got, expected in results:
        assert got == expected
    a = ps.pull("a", pool, train=False)
    b = ps.pull("b", pool, train=False)
    np.testing.assert_array_equal(a, np.repeat(2.0 - 0.5 * occurrences[:, None], 4, axis=1))
    np.testing.assert_array_equal(b, np.repeat(-0.5 * occurrences[:, None], 3, axis=1))
    seen = occurrences > 0
    order = np.argsort(pool[seen])
    for table in ("a", "b"):
        rows = export_all(ps, table)
        np.testing.assert_array_equal(rows.keys, pool[seen][order])
        np.testing.assert_array_equal(rows.counts, updates[seen][order])
        assert ps.stats(table)["rows"] == seen.sum()


# --- 3. erase ---------------------------------------------------------------------


def test_erase(ps: ParameterServer) -> None:
    """``erase`` returns how many keys had a row, removes exactly those, logs
    each at the version current at the erase, and an erased key reads (and
    trains) from its initial vector again."""
    t = sgd_table(ps)
    keys = np.array([1, 2, 3, 4, 5, -7], np.int64)  # -7 is 2**64 - 7
    initial = ps.pull(t, keys, train=False)
    ps.push(t, keys, full(6), step=1)
    np.testing.assert_array_equal(ps.pull(t, keys, train=False), initial - 1)
    ps.advance_version()
    version = ps.version

    assert ps.erase(t, np.array([2, -7, 999], np.int64)) == 2  # 999 never had a row
    np.testing.assert_array_equal(ps.contains(t, keys), [True, False, True, True, True, False])
    assert ps.stats(t)["rows"] == 4
    lookup = ps.pull(t, keys, train=False)
    erased = np.array([False, True, False, False, False, True])
    np.testing.assert_array_equal(lookup[erased], initial[erased])
    np.testing.assert_array_equal(lookup[~erased], initial[~erased] - 1)
    assert removed(ps, t) == {2: version, 2**64 - 7: version}
    assert removed(ps, t, since=version) == {}
    assert removed(ps, t, since=version - 1) == {2: version, 2**64 - 7: version}
    np.testing.assert_array_equal(np.sort(ps.removed_keys(t)), u64([2, -7]))

    assert ps.erase(t, [2, 999]) == 0  # nothing left to erase: nothing logged
    assert ps.erase(t, np.zeros(0, np.uint64)) == 0
    assert removed(ps, t) == {2: version, 2**64 - 7: version}

    ps.push(t, [2], full(1, value=0.5), step=2)  # a new row, from the initial vector
    np.testing.assert_array_equal(ps.pull(t, [2], train=False), initial[1:2] - 0.5)
    rows = export_all(ps, t)
    assert rows.counts[rows.keys.tolist().index(2)] == 1


# --- 4. export / load round trip ------------------------------------------------------


def train_rows(ps: ParameterServer, table: str, rng: np.random.Generator) -> np.ndarray:
    """Varied rows: loaded with old times and counts, then trained over steps and versions."""
    dim = ps.spec(table).dim
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, size=150, dtype=np.int64))
    old = keys[:40]
    ps.load(
        table,
        old,
        rng.standard_normal((len(old), dim)).astype(F32),
        counts=rng.integers(0, 1000, len(old)).astype(np.uint32),
        steps=rng.integers(0, 50, len(old)).astype(np.uint64),
        times=rng.integers(1_600_000_000, 1_700_000_000, len(old)).astype(np.uint32),
        step=3,
    )
    for step in range(100, 106):
        idx = rng.integers(0, len(keys), size=len(keys) // 2)
        ps.pull(table, keys[idx], step=step)
        grads = rng.standard_normal((len(idx), dim)).astype(F32)
        ps.push(table, keys[idx], grads, step=step)
        if step % 2:
            ps.advance_version()
    return keys


def test_export_load_round_trip_across_shard_counts(
    ps: ParameterServer, make_ps: MakeServer, shards: int, rng: np.random.Generator
) -> None:
    """Every column (weights, state, counts, steps, times, versions) survives
    export → load into a server of another shard count → export → load back;
    the servers then read the same vectors for every key, trained or not."""
    spec = TableSpec(
        "emb", dim=5, optimizer=Adam(learning_rate=0.05), initializer=Uniform(), seed=9
    )
    ps.create_table(spec)
    keys = train_rows(ps, "emb", rng)
    source = export_all(ps, "emb")
    for name in ("counts", "steps", "times", "versions"):
        assert len(np.unique(getattr(source, name))) > 1, f"{name} should vary"
    assert source.state[:, 2 * spec.dim].max() > 1

    other = make_ps(OTHER_SHARDS[shards])
    other.create_table(spec)
    for chunk in ps.export("emb", chunk_rows=7):
        load_rows(other, "emb", chunk)
    assert other.stats("emb")["rows"] == ps.stats("emb")["rows"] == len(source)
    assert_same_rows(export_all(other, "emb", chunk_rows=3), source)

    back = make_ps(shards)
    back.create_table(spec)
    load_rows(back, "emb", export_all(other, "emb"))
    assert_same_rows(export_all(back, "emb"), source)

    probe = np.concatenate([keys, np.arange(1000, 1020, dtype=np.int64)])  # + untrained keys
    expected = ps.pull("emb", probe, train=False)
    np.testing.assert_array_equal(other.pull("emb", probe, train=False), expected)
    np.testing.assert_array_equal(back.pull("emb", probe, train=False), expected)


def test_export_chunking_gives_the_same_rows(ps: ParameterServer) -> None:
    """Any ``chunk_rows`` exports each row once, in chunks of at most that many."""
    t = sgd_table(ps)
    keys = np.arange(1, 101, dtype=np.int64) * 7919
    ps.push(t, keys, full(100), step=1)
    whole = export_all(ps, t)
    assert len(whole) == 100
    np.testing.assert_array_equal(whole.keys, np.sort(keys.astype(np.uint64)))
    for chunk_rows in (1, 7, 100, 101):
        assert_same_rows(export_all(ps, t, chunk_rows=chunk_rows), whole)
    empty = sgd_table(ps, "empty")
    assert list(ps.export(empty)) == []


def test_load_defaults_and_overwrites(ps: ParameterServer) -> None:
    """``load`` without columns gives the optimizer's initial state, count 0,
    the current version; a second load overwrites a row exactly."""
    ps.create_table(TableSpec("a", dim=2, optimizer=Adagrad(initial_accumulator=0.25)))
    version = ps.advance_version()
    ps.load("a", [2, 3], np.array([[1, 2], [3, 4]], F32), step=4)
    rows = export_all(ps, "a")
    np.testing.assert_array_equal(rows.weights, [[1, 2], [3, 4]])
    np.testing.assert_array_equal(rows.state, np.full((2, 2), 0.25, F32))
    np.testing.assert_array_equal(rows.counts, [0, 0])
    np.testing.assert_array_equal(rows.versions, [version, version])
    explicit = {
        "state": np.array([[5, 6]], F32),
        "counts": np.array([17], np.uint32),
        "steps": np.array([3], np.uint64),
        "times": np.array([1234], np.uint32),
        "versions": np.array([99], np.uint64),
    }
    ps.load("a", [3], np.array([[7, 8]], F32), **explicit, step=50)  # columns win over step
    row = export_all(ps, "a")
    np.testing.assert_array_equal(row.weights[1], [7, 8])
    for name, values in explicit.items():
        np.testing.assert_array_equal(getattr(row, name)[1:], values, err_msg=name)
    assert ps.stats("a")["rows"] == 2


# --- 5. deltas and versions -------------------------------------------------------


def test_export_since_a_version(ps: ParameterServer) -> None:
    """After ``advance_version``, ``export(since=)`` gives exactly the rows
    modified later (pushed, created, loaded; not read), each with the new
    version; ``removed_log(since=)`` the removals after it; ``trim_removed``
    forgets the records up to a version."""
    t = sgd_table(ps)
    old = np.arange(1, 21, dtype=np.int64)
    ps.push(t, old, full(20), step=1)
    since = ps.version
    v1 = ps.advance_version()
    assert v1 > since and ps.version == v1
    assert len(export_all(ps, t, since=since)) == 0

    ps.pull(t, old, step=2)  # reading rows does not modify them
    ps.pull(t, old, train=False)
    assert len(export_all(ps, t, since=since)) == 0
    ps.push(t, old[:3], full(3), step=2)
    ps.pull(t, [100, 101], step=2)  # created rows are modified rows
    ps.load(t, [200], np.zeros((1, 4), F32))
    assert ps.erase(t, old[15:]) == 5

    delta = export_all(ps, t, since=since, chunk_rows=2)
    assert delta.keys.tolist() == [1, 2, 3, 100, 101, 200]
    np.testing.assert_array_equal(delta.versions, v1)
    assert len(export_all(ps, t)) == 18
    assert set(export_all(ps, t).versions.tolist()) == {since, v1}
    assert removed(ps, t, since=since) == dict.fromkeys(range(16, 21), v1)

    v2 = ps.advance_version()
    assert v2 > v1
    ps.erase(t, [1])
    assert len(export_all(ps, t, since=v1)) == 0  # an erase exports no row
    assert removed(ps, t, since=v1) == {1: v2}
    assert removed(ps, t, since=v2) == {}
    order = list(removed(ps, t, since=since))  # oldest first
    assert sorted(order[:5]) == [16, 17, 18, 19, 20] and order[5:] == [1]
    ps.trim_removed(t, upto=v1)
    assert removed(ps, t) == {1: v2}
    ps.trim_removed(t, upto=v2)
    assert removed(ps, t) == {}


def test_versions_and_removal_records_restore(
    ps: ParameterServer, make_ps: MakeServer, shards: int
) -> None:
    """``restore_version`` only raises the version; ``load_removed`` restores
    records that ``removed_log`` then gives from any ``since`` above the floor."""
    start = ps.version
    ps.restore_version(start + 10)
    assert ps.version == start + 10
    ps.restore_version(start + 2)  # never lowers
    assert ps.version == start + 10
    assert ps.advance_version() == start + 11
    with pytest.raises(ValueError, match=r"version must be at most 2\*\*63 - 1, got 9223372036"):
        ps.restore_version(2**63)  # advancing from 2**64 - 1 would wrap to 0
    assert ps.version == start + 11

    t = sgd_table(ps)
    ps.pull(t, np.arange(10, dtype=np.int64), step=1)
    v1 = ps.version
    ps.erase(t, [1, 2])
    v2 = ps.advance_version()
    ps.erase(t, [3])
    keys, versions = ps.removed_log(t)
    assert sorted(keys[:2].tolist()) == [1, 2] and keys[2] == 3
    assert versions.tolist() == [v1, v1, v2]

    other = make_ps(OTHER_SHARDS[shards])
    sgd_table(other)
    other.load_removed(t, keys, versions, floor=v1 - 1)
    assert removed(other, t, since=v1) == {3: v2}
    assert sorted(removed(other, t)) == [1, 2, 3]
    assert other.stats(t)["removed_floor"] == v1 - 1


# --- 6. admission -----------------------------------------------------------------


def test_admission_on_the_third_training_pull(ps: ParameterServer) -> None:
    """With ``Admission(min_count=3)`` a key gets a row on its third training
    pull; until then it reads as its initial vector, lookups do not count,
    pushes to it are dropped and counted (``PushResult`` and ``stats``)."""
    t = sgd_table(ps, admission=Admission(min_count=3))
    keys = np.array([10, 20, -5], np.int64)
    initial = ps.pull(t, keys, train=False)

    for sighting in (1, 2):
        np.testing.assert_array_equal(ps.pull(t, keys, step=sighting), initial)
        assert not ps.contains(t, keys).any()
        pending_keys, pending = ps.pending_counts(t)
        assert pending_keys.dtype == np.uint64 and pending.dtype == np.uint32
        assert dict(zip(pending_keys.tolist(), pending.tolist(), strict=True)) == dict.fromkeys(
            u64(keys), sighting
        )
        result = ps.push(t, keys, full(3), step=sighting)
        assert result == PushResult(0, 0, 3, 0)
        assert ps.stats(t)["dropped_pending"] == 3 * sighting
        for _ in range(3):  # lookups are not sightings
            ps.pull(t, keys, train=False)
        np.testing.assert_array_equal(ps.pull(t, keys, train=False), initial)

    np.testing.assert_array_equal(ps.pull(t, keys, step=3), initial)  # admitted
    assert ps.contains(t, keys).all()
    assert len(ps.pending_counts(t)[0]) == 0
    assert ps.push(t, keys, full(3), step=3) == PushResult(3, 0, 0, 0)
    np.testing.assert_array_equal(ps.pull(t, keys, train=False), initial - 1)
    assert ps.stats(t)["dropped_pending"] == 6


def test_pending_counts_round_trip(ps: ParameterServer, make_ps: MakeServer, shards: int) -> None:
    """``pending_counts`` → ``load_pending`` into a server of another shard
    count carries the sightings on: the next training pull admits exactly the
    keys it completes; keys with a row are skipped; a count of 0 forgets."""
    t = sgd_table(ps, admission=Admission(min_count=4))
    for n in (30, 20, 10):  # keys 0-9 seen 3 times, 10-19 twice, 20-29 once
        ps.pull(t, np.arange(n, dtype=np.int64), step=1)
    ps.pull(t, np.arange(5, dtype=np.int64), step=2)  # 0-4 admitted
    keys, counts = ps.pending_counts(t)
    pending = dict(zip(keys.tolist(), counts.tolist(), strict=True))
    assert pending == {k: 3 if k < 10 else 2 if k < 20 else 1 for k in range(5, 30)}

    other = make_ps(OTHER_SHARDS[shards])
    sgd_table(other, admission=Admission(min_count=4))
    for step in range(4):
        other.pull(t, np.arange(5, dtype=np.int64), step=step)
    assert other.contains(t, np.arange(5, dtype=np.int64)).all()
    with_rows = np.arange(5, dtype=np.uint64)
    other.load_pending(
        t,
        np.concatenate([with_rows, keys]),
        np.concatenate([np.full(5, 9, np.uint32), counts]),
    )
    got_keys, got_counts = other.pending_counts(t)
    assert dict(zip(got_keys.tolist(), got_counts.tolist(), strict=True)) == pending
    other.load_pending(t, [25], np.array([0], np.uint32))
    assert 25 not in other.pending_counts(t)[0].tolist()

    other.pull(t, np.arange(30, dtype=np.int64), step=5)  # one more sighting each
    np.testing.assert_array_equal(other.contains(t, np.arange(30)), [True] * 10 + [False] * 20)


# --- 7. eviction while growing ------------------------------------------------------


@pytest.mark.parametrize("policy", ["max_rows", "ttl_steps"])
def test_eviction_while_the_table_grows(policy: str, ps: ParameterServer) -> None:
    """Rounds of new keys with an ``evict(step=)`` after each: the table never
    exceeds its bound after an evict, the rows updated every round and the
    newest rows stay, each evict's keys are in the removal log at that
    call's version, and an evicted key reads as its initial vector."""
    bound, hot_n, new_n, ttl = 40, 10, 25, 2
    eviction = Eviction(max_rows=bound) if policy == "max_rows" else Eviction(ttl_steps=ttl)
    t = sgd_table(ps, eviction=eviction)
    hot = np.arange(10_000, 10_000 + hot_n, dtype=np.int64)
    created: set[int] = set(u64(hot))
    batches: dict[int, np.ndarray] = {}
    for step in range(1, 9):
        new = np.arange(step * 100, step * 100 + new_n, dtype=np.int64)
        batches[step] = new
        keys = np.concatenate([hot, new])
        ps.pull(t, keys, step=step)
        assert ps.push(t, keys, full(len(keys)), step=step).applied == len(keys)
        created |= set(u64(new))

        before = ps.stats(t)["rows"]
        version = ps.advance_version()
        result = ps.evict(t, step=step)
        after = ps.stats(t)["rows"]
        assert result["total"] == before - after
        evicted = removed(ps, t, since=version - 1)
        assert len(evicted) == result["total"]
        assert set(evicted.values()) <= {version}
        assert not ps.contains(t, list(evicted)).any()

        assert ps.contains(t, hot).all(), "rows updated every round were evicted"
        assert ps.contains(t, new).all(), "the newest rows were evicted"
        if policy == "max_rows":
            assert after == min(bound, hot_n + new_n * step)
        else:  # rows not updated for more than ttl steps go, the rest stay
            for old_step, old in batches.items():
                alive = step - old_step <= ttl
                assert (ps.contains(t, old) == alive).all(), (step, old_step)
            assert after == hot_n + new_n * min(step, ttl + 1)

    alive = {k for k in created if ps.contains(t, [k])[0]}
    assert set(removed(ps, t)) == created - alive
    assert ps.stats(t)["rows"] == len(alive)
    gone = batches[1]
    fresh = sgd_table(ps, "fresh", eviction=eviction)  # same seed: same initial vectors
    np.testing.assert_array_equal(ps.pull(t, gone, train=False), ps.pull(fresh, gone, train=False))


def test_evict_every_table(ps: ParameterServer) -> None:
    """``evict()`` without a table applies every table's policy and sums the counts."""
    a = sgd_table(ps, "a", eviction=Eviction(ttl_steps=1))
    b = sgd_table(ps, "b", eviction=Eviction(max_rows=3))
    c = sgd_table(ps, "c")  # no policy: nothing goes
    for name in (a, b, c):
        ps.push(name, np.arange(10, dtype=np.int64), full(10), step=1)
    assert ps.evict(step=5)["total"] == 17
    assert [ps.stats(name)["rows"] for name in (a, b, c)] == [0, 3, 10]
    assert set(ps.stats()) == {"a", "b", "c"}


# --- 8. steps travel with the calls -------------------------------------------------


def test_rows_carry_the_step_of_the_call(ps: ParameterServer) -> None:
    """Rows carry the step of the call that last wrote them (``push``,
    ``push_many``, a training ``pull_many`` that creates them, ``load``);
    reading does not restamp; a server no caller gave a step of its own
    stamps 0 where a call gives none, however many calls passed steps."""
    t = sgd_table(ps)

    def steps_of(keys: list[int]) -> list[int]:
        rows = export_all(ps, t)
        where = {k: i for i, k in enumerate(rows.keys.tolist())}
        return [int(rows.steps[where[k]]) for k in keys]

    ps.push_many([PushPart(t, [1, 2], full(2))], step=5)
    ps.pull_many([PullPart(t, [3, 4], np.empty((2, 4), F32))], step=7)
    ps.push(t, [5], full(1), step=11)
    ps.push_many_async([PushPart(t, [6], full(1))], step=13).wait()
    ps.pull_many_async([PullPart(t, [7], np.empty((1, 4), F32))], step=17).wait()
    ps.load(t, [8], full(1), step=9)
    assert steps_of([1, 2, 3, 4, 5, 6, 7, 8]) == [5, 5, 7, 7, 11, 13, 17, 9]

    ps.pull(t, [1, 2, 3], step=30)  # existing rows: reading is not an update
    ps.pull(t, [1, 2, 3], train=False, step=31)
    assert steps_of([1, 2, 3]) == [5, 5, 7]
    ps.push(t, [3], full(1), step=20)
    assert steps_of([3]) == [20]

    ps.load(t, [9], full(1))  # no step given: the server's own, never set
    ps.push(t, [10], full(1))
    ps.pull(t, [11])
    assert steps_of([9, 10, 11]) == [0, 0, 0]


def test_ttl_counts_back_from_the_given_step(ps: ParameterServer) -> None:
    """``evict(step=s)`` removes rows last updated more than ``ttl_steps``
    before ``s``, whatever steps other calls passed before."""
    t = sgd_table(ps, eviction=Eviction(ttl_steps=10))
    ps.push(t, [1], full(1), step=5)
    ps.push(t, [2], full(1), step=50)
    assert ps.evict(t, step=15)["total"] == 0  # 10 steps old: not older than the TTL
    assert ps.contains(t, [1, 2]).all()
    assert ps.evict(t, step=16)["total"] == 1
    np.testing.assert_array_equal(ps.contains(t, [1, 2]), [False, True])


def test_push_of_a_step_leaves_rows_a_later_pull_admitted(ps: ParameterServer) -> None:
    """A trainer that pulls step s + 1 before pushing step s passes each call
    its step: a key a later step's pull admitted had no row at step s, so
    push s drops it as pending, as running the steps one by one would."""
    t = sgd_table(ps, admission=Admission(min_count=2))
    keys = np.array([1, 2, 3], np.int64)
    ps.pull_many([PullPart(t, keys, np.empty((3, 4), F32))], step=7)  # first sightings
    ps.pull_many([PullPart(t, keys[:2], np.empty((2, 4), F32))], step=8)  # 1, 2 admitted
    initial = ps.pull(t, keys, train=False)
    assert ps.push_many([PushPart(t, keys, full(3))], step=7) == PushResult(0, 0, 3, 0)
    np.testing.assert_array_equal(ps.pull(t, keys, train=False), initial)
    assert ps.push_many([PushPart(t, keys, full(3))], step=8) == PushResult(2, 0, 1, 0)
    np.testing.assert_array_equal(ps.pull(t, keys[:2], train=False), initial[:2] - 1)


@pytest.mark.parametrize(
    "admission",
    [
        pytest.param(1, id="admit-all"),
        pytest.param(2, id="min_count-2"),
    ],
)
def test_workers_at_different_steps_share_a_server(admission: int, ps: ParameterServer) -> None:
    """Two workers share a server, one a step behind the other: the lagging
    worker's push applies to rows that exist at its step, even when the
    leading worker updated them at a later step (the server keeps no step)."""
    t = sgd_table(ps, admission=Admission(min_count=admission))
    keys = np.array([1, 2], np.int64)
    for step in range(1, admission + 1):
        ps.pull(t, keys, step=step)
    assert ps.contains(t, keys).all()
    initial = ps.pull(t, keys, train=False)
    assert ps.push(t, keys, full(2), step=8).applied == 2  # the leading worker
    assert ps.push(t, keys, full(2), step=7).applied == 2  # the lagging worker
    np.testing.assert_array_equal(ps.pull(t, keys, train=False), (initial - 1) - 1)


# --- 9. bad input -----------------------------------------------------------------


def test_unknown_table_names_it_and_lists_the_tables(ps: ParameterServer) -> None:
    """Every call given an unknown table raises ``UnknownTableError`` (a
    ``KeyError``) naming it and listing the tables; ``export`` at the call."""
    sgd_table(ps, "alpha")
    sgd_table(ps, "beta")
    out = np.empty((1, 4), F32)
    calls: dict[str, Callable[[], object]] = {
        "pull": lambda: ps.pull("nope", [1]),
        "lookup": lambda: ps.pull("nope", [1], train=False),
        "push": lambda: ps.push("nope", [1], full(1)),
        "pull_many": lambda: ps.pull_many(
            [PullPart("alpha", [1], out), PullPart("nope", [1], out)]
        ),
        "push_many": lambda: ps.push_many([PushPart("nope", [1], full(1))]),
        "erase": lambda: ps.erase("nope", [1]),
        "contains": lambda: ps.contains("nope", [1]),
        "read_rows": lambda: ps.read_rows("nope", [1]),
        "evict": lambda: ps.evict("nope"),
        "stats": lambda: ps.stats("nope"),
        "export": lambda: ps.export("nope"),
        "load": lambda: ps.load("nope", [1], full(1)),
        "removed_log": lambda: ps.removed_log("nope"),
        "removed_keys": lambda: ps.removed_keys("nope"),
        "load_removed": lambda: ps.load_removed("nope", [1], np.array([1], np.uint64)),
        "trim_removed": lambda: ps.trim_removed("nope", 1),
        "pending_counts": lambda: ps.pending_counts("nope"),
        "load_pending": lambda: ps.load_pending("nope", [1], np.array([1], np.uint32)),
        "spec": lambda: ps.spec("nope"),
        "drop_table": lambda: ps.drop_table("nope"),
    }
    for name, call in calls.items():
        with pytest.raises(UnknownTableError) as info:
            call()
        assert isinstance(info.value, KeyError), name
        message = str(info.value)
        assert "'nope'" in message and "alpha" in message and "beta" in message, (name, message)
    assert ps.tables() == ["alpha", "beta"]
    assert ps.stats("alpha")["rows"] == 0  # the good part of pull_many did nothing either


def test_tables_create_drop_and_duplicates(ps: ParameterServer) -> None:
    """Tables are listed in creation order; a duplicate name is a ValueError
    naming it (the first table stays); a dropped table is unknown and its
    name free again, with no rows."""
    sgd_table(ps, "emb", dim=4)
    sgd_table(ps, "other", dim=3)
    assert ps.tables() == ["emb", "other"]
    assert ps.spec("emb").dim == 4 and ps.spec("emb").name == "emb"
    ps.push("emb", [1, 2], full(2), step=1)
    with pytest.raises(ValueError, match="'emb'"):
        sgd_table(ps, "emb", dim=2)
    assert ps.spec("emb").dim == 4 and ps.stats("emb")["rows"] == 2
    with pytest.raises(TypeError, match="TableSpec"):
        ps.create_table({"name": "x", "dim": 2})  # type: ignore[arg-type]

    ps.drop_table("emb")
    assert ps.tables() == ["other"]
    with pytest.raises(UnknownTableError, match="'emb'"):
        ps.drop_table("emb")
    with pytest.raises(UnknownTableError, match="other"):
        ps.pull("emb", [1])
    sgd_table(ps, "emb", dim=8)
    assert ps.stats("emb")["rows"] == 0
    assert ps.pull("emb", [1]).shape == (1, 8)


def test_bad_keys_grads_and_out(ps: ParameterServer) -> None:
    """Keys of a wrong dtype raise TypeError and not 1-D ValueError; grads of a
    wrong dtype TypeError and of a wrong shape ValueError (naming the table);
    an ``out`` of a wrong shape or dtype likewise; nothing is written."""
    t = sgd_table(ps)
    keys_calls: dict[str, Callable[[Any], object]] = {
        "pull": lambda k: ps.pull(t, k),
        "lookup": lambda k: ps.pull(t, k, train=False),
        "push": lambda k: ps.push(t, k, full(3)),
        "push_many": lambda k: ps.push_many([PushPart(t, k, full(3))]),
        "erase": lambda k: ps.erase(t, k),
        "contains": lambda k: ps.contains(t, k),
        "load": lambda k: ps.load(t, k, full(3)),
    }
    for name, call in keys_calls.items():
        for dtype in (np.float64, np.int32, np.uint32):
            with pytest.raises(TypeError, match=rf"keys.*int64 or uint64.*{np.dtype(dtype)}"):
                call(np.array([1, 2, 3]).astype(dtype))
        with pytest.raises(ValueError, match=r"keys.*1-D.*\(3, 1\)"):
            call(np.array([[1], [2], [3]], np.int64))
        assert ps.stats(t)["rows"] == 0, name

    for dtype in (np.float64, np.float16):
        with pytest.raises(TypeError, match=rf"float32.*{np.dtype(dtype)}"):
            ps.push(t, [1, 2], np.ones((2, 4), dtype))
    for shape in [(2, 5), (3, 4), (8,), (2, 4, 1)]:
        with pytest.raises(ValueError, match=r"grads for table 't'.*shape.*expected \(2, 4\)"):
            ps.push(t, [1, 2], np.ones(shape, F32))
        with pytest.raises(ValueError, match=r"grads for table 't'"):
            ps.push_many([PushPart(t, [1, 2], np.ones(shape, F32))])
    assert ps.stats(t)["rows"] == 0

    with pytest.raises(ValueError, match=r"out has shape \(3, 4\), expected \(2, 4\)"):
        ps.pull(t, [1, 2], out=np.zeros((3, 4), F32))
    with pytest.raises(ValueError, match="out has shape"):
        ps.pull_many([PullPart(t, [1, 2], np.zeros((2, 5), F32))])
    with pytest.raises(TypeError, match="out must be float32"):
        ps.pull(t, [1, 2], out=np.zeros((2, 4), np.float64))
    with pytest.raises(ValueError, match="out"):
        ps.pull_many([PullPart(t, [1, 2])])  # pull_many needs every part's out
    with pytest.raises(ValueError, match="weights has shape"):
        ps.load(t, [1, 2], np.zeros((3, 4), F32))
    assert ps.stats(t)["rows"] == 0


def test_bad_push_options_and_admin_arguments(ps: ParameterServer) -> None:
    """A bad ``only=``, ``only`` without ``unique``, a bad step, version or
    chunk size raise ValueError/TypeError naming the argument, at the call."""
    t = sgd_table(ps)
    part = PushPart(t, [1], full(1))
    with pytest.raises(ValueError, match=r"only must be one of all, updated, rest, got 'some'"):
        ps.push_many([part], unique=True, only="some")
    with pytest.raises(ValueError, match="needs unique=True"):
        ps.push_many([part], only="updated")
    for bad in (-1, 1.5, 2**64):
        with pytest.raises(ValueError, match="step"):
            ps.push_many([part], step=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step"):
            ps.pull_many([PullPart(t, [1], np.empty((1, 4), F32))], step=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step"):
            ps.evict(t, step=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_rows"):
        ps.export(t, chunk_rows=0)
    version_calls: dict[str, Callable[[Any], object]] = {
        "since": lambda v: ps.export(t, since=v),
        "since ": lambda v: ps.removed_log(t, since=v),
        "upto": lambda v: ps.trim_removed(t, upto=v),
        "floor": lambda v: ps.load_removed(t, [], np.zeros(0, np.uint64), floor=v),
        "version": lambda v: ps.restore_version(v),
    }
    for name, call in version_calls.items():
        for bad in (-1, 1.5, "3"):
            with pytest.raises(ValueError, match=rf"{name.strip()} must be a version >= 0"):
                call(bad)
    assert ps.stats(t)["rows"] == 0


def test_async_errors_come_out_of_wait(ps: ParameterServer) -> None:
    """An error inside ``pull_many_async`` / ``push_many_async`` is raised by
    ``wait()``, and the server goes on working."""
    t = sgd_table(ps)
    push = ps.push_many_async([PushPart(t, [1], np.ones((1, 5), F32))], step=1)
    with pytest.raises(ValueError, match=r"grads for table 't'"):
        push.wait(timeout=30)
    assert push.done()
    pull = ps.pull_many_async([PullPart("nope", [1], np.empty((1, 4), F32))], step=1)
    with pytest.raises(UnknownTableError, match=r"'nope'.*\bt\b"):
        pull.wait(timeout=30)
    bad_only = ps.push_many_async([PushPart(t, [1], full(1))], unique=True, only="x")
    with pytest.raises(ValueError, match="only"):
        bad_only.wait(timeout=30)
    assert ps.stats(t)["rows"] == 0

    assert ps.push_many_async([PushPart(t, [1], full(1))], step=1).wait(timeout=30).applied == 1
    out = np.empty((1, 4), F32)
    assert ps.pull_many_async([PullPart(t, [1], out)], train=False).wait(timeout=30) is None
    np.testing.assert_array_equal(out, ps.pull(t, [1], train=False))


# --- the rest of the data half ----------------------------------------------------


def test_push_reports_updated_rows_and_pushes_in_halves(ps: ParameterServer) -> None:
    """``updated`` receives each key's weights after the push (what a lookup
    reads next), at ``updated_rows`` where given; ``only="updated"`` then
    ``only="rest"`` apply what one push applies."""
    t = sgd_table(ps, lr=0.5)
    whole = sgd_table(ps, "whole", lr=0.5)
    keys = np.array([3, 1, 4, 5, 9], np.int64)
    grads = np.arange(20, dtype=F32).reshape(5, 4) / 8
    updated = np.zeros((5, 4), F32)
    ps.push(whole, keys, grads, updated=updated, step=1)
    np.testing.assert_array_equal(updated, ps.pull(whole, keys, train=False))

    rows = np.array([2, -1, 0, -1, 1], np.int32)
    shared = np.full((3, 4), np.nan, F32)
    part = PushPart(t, keys, grads, updated=shared, updated_rows=rows)
    first = ps.push_many([part], unique=True, only="updated", step=1)
    assert first.applied == 3
    np.testing.assert_array_equal(shared[[2, 0, 1]], ps.pull(t, keys[[0, 2, 4]], train=False))
    assert not ps.contains(t, keys[[1, 3]]).any()
    assert ps.push_many([part], unique=True, only="rest", step=1).applied == 2
    np.testing.assert_array_equal(ps.pull(t, keys, train=False), updated)


def test_pull_many_equals_pulls_one_by_one(ps: ParameterServer) -> None:
    """``pull_many`` over several tables (one key list shared, empty parts,
    int64 and uint64 keys) gives what ``pull`` gives table by table."""
    a, b = sgd_table(ps, "a", dim=4), sgd_table(ps, "b", dim=2)
    keys = np.array([7, -1, 7, 0], np.int64)
    ps.push(a, keys, full(4), step=1)
    out_a, out_b = np.empty((4, 4), F32), np.empty((4, 2), F32)
    empty = np.empty((0, 4), F32)
    ps.pull_many(
        [
            PullPart(a, keys, out_a),
            PullPart(b, keys.view(np.uint64), out_b),
            PullPart(a, [], empty),
        ],
        step=2,
    )
    np.testing.assert_array_equal(out_a, ps.pull(a, keys, train=False))
    np.testing.assert_array_equal(out_b, ps.pull(b, keys, train=False))
    np.testing.assert_array_equal(out_a[0], out_a[2])
    assert ps.contains(b, keys).all()  # the training pull created b's rows
    assert ps.pull(a, []).shape == (0, 4)
    assert ps.push(a, [], np.zeros((0, 4), F32)) == PushResult(0, 0, 0, 0)


# --- 10. keys grouped by (server, shard), lookups, versions applied --------------------


def grouped(ps: ParameterServer, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys sorted by (server, shard) cell as the key preparer groups them,
    and the cells' offsets (``num_servers * num_shards + 1``)."""
    n, s = ps.num_servers, ps.num_shards
    cells = server_of(keys, n).astype(np.int64) * s + shard_of(keys, s)
    order = np.argsort(cells, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(cells, minlength=n * s))])
    return keys[order], offsets.astype(np.int64)


def test_keys_grouped_by_cell_pull_and_push_as_ungrouped(ps: ParameterServer) -> None:
    """Pulls and pushes of keys grouped by (server, shard) cell with their
    offsets give what the same keys give ungrouped; offsets that do not fit
    the keys are a ValueError."""
    a = sgd_table(ps, "a", dim=4)
    keys, offsets = grouped(ps, np.unique(np.arange(0, 500, 7, dtype=np.uint64) * 977))
    out = np.empty((len(keys), 4), F32)
    ps.pull_many([PullPart(a, keys, out, offsets)], step=1)
    np.testing.assert_array_equal(out, ps.pull(a, keys, train=False))
    grads = np.arange(len(keys) * 4, dtype=F32).reshape(-1, 4) / 100
    before = ps.pull(a, keys, train=False)
    part = PushPart(a, keys, grads, offsets)
    assert ps.push_many([part], unique=True, step=1).applied == len(keys)
    np.testing.assert_allclose(ps.pull(a, keys, train=False), before - grads, rtol=1e-6)
    for bad in (offsets[:-1], offsets + 1, offsets[::-1].copy()):
        with pytest.raises(ValueError, match="offsets"):
            ps.pull_many([PullPart(a, keys, out, bad)])


def test_lookup_reads_rows_found_and_the_version_label(ps: ParameterServer) -> None:
    """``lookup`` gives each key's row and whether it has one; a key without a
    row reads as zeros (``missing="zeros"``) or its initial vector
    (``"initial"``); the label is the last applied version's (0 before)."""
    t = sgd_table(ps, dim=3)
    keys = np.array([1, 2, 3, -9], np.int64)
    ps.push(t, keys[:2], full(2, 3), step=1)
    rows, found, label = ps.lookup(t, keys)
    np.testing.assert_array_equal(found, [True, True, False, False])
    np.testing.assert_array_equal(rows[:2], ps.pull(t, keys[:2], train=False))
    np.testing.assert_array_equal(rows[2:], np.zeros((2, 3), F32))
    initial, _, _ = ps.lookup(t, keys, missing="initial")
    np.testing.assert_array_equal(initial[2:], ps.pull(t, keys[2:], train=False))
    assert label == 0
    assert not ps.contains(t, keys[2:]).any()  # a lookup creates nothing
    with pytest.raises(ValueError, match="missing"):
        ps.lookup(t, keys, missing="mean")


def rows_of(keys: np.ndarray, weights: np.ndarray, version: int = 1) -> RowChunk:
    n = len(keys)
    return RowChunk(
        keys=np.asarray(keys, np.uint64),
        weights=weights.astype(F32),
        state=np.zeros((n, 0), F32),
        counts=np.ones(n, np.uint32),
        steps=np.full(n, 5, np.uint64),
        times=np.full(n, 1_700_000_000, np.uint32),
        versions=np.full(n, version, np.uint64),
    )


def test_apply_update_full_then_delta(ps: ParameterServer) -> None:
    """A full version replaces a table (created from its spec when missing),
    a delta replaces or adds its rows and removes its keys; lookups then
    report each version's label."""
    spec = TableSpec("served", 2, optimizer=SGD(), initializer=Zeros(), serving=True)
    keys = np.arange(1, 201, dtype=np.uint64) * 31
    first = rows_of(keys, np.stack([keys.astype(F32), np.ones(len(keys), F32)], axis=1))
    ps.apply_update({"served": TableUpdate(spec, full=True, rows=[first])}, label=7)
    rows, found, label = ps.lookup("served", keys)
    assert found.all() and label == 7
    np.testing.assert_array_equal(rows, first.weights)
    changed, gone = keys[:50], keys[150:]
    new = np.arange(1, 11, dtype=np.uint64) * 1_000_003
    delta = rows_of(np.concatenate([changed, new]), np.full((60, 2), -1, F32), version=2)
    update = TableUpdate(spec, full=False, rows=[delta], removed=gone)
    ps.apply_update({"served": update}, label=8)
    rows, found, label = ps.lookup("served", np.concatenate([keys, new]))
    assert label == 8
    np.testing.assert_array_equal(found, np.concatenate([np.ones(150, bool), np.zeros(50, bool),
                                                         np.ones(10, bool)]))  # fmt: skip
    np.testing.assert_array_equal(rows[:50], np.full((50, 2), -1, F32))
    np.testing.assert_array_equal(rows[50:150], first.weights[50:150])
    assert ps.stats("served")["rows"] == 160
    with pytest.raises(ValueError, match="served"):
        ps.push("served", keys[:1], full(1, 2))  # a serving table takes versions only


# --- 10. show and click statistics -------------------------------------------------


def stats_table(ps: ParameterServer, name: str = "t", half_life: float = 10.0) -> str:
    ps.create_table(
        TableSpec(name, dim=2, optimizer=SGD(), initializer=Zeros(), stats_half_life=half_life)
    )
    return name


def push_stats(
    ps: ParameterServer,
    table: str,
    keys: Any,
    step: int,
    shows: Any = None,
    clicks: Any = None,
) -> None:
    keys = np.asarray(keys, np.int64)
    part = PushPart(
        table,
        keys,
        full(len(keys), 2, 0.0),
        shows=None if shows is None else np.asarray(shows, F32),
        clicks=None if clicks is None else np.asarray(clicks, F32),
    )
    ps.push_many([part], step=step)


def stats_by_key(ps: ParameterServer, table: str) -> dict[int, tuple[float, float, int, int]]:
    """{key: (shows, clicks, count, step)} of the exported rows."""
    out = {}
    for chunk in ps.export(table):
        assert chunk.shows.dtype == F32 and chunk.clicks.dtype == F32
        assert chunk.shows.shape == chunk.clicks.shape == (len(chunk),)
        for key, shows, clicks, count, step in zip(
            chunk.keys.tolist(),
            chunk.shows.tolist(),
            chunk.clicks.tolist(),
            chunk.counts.tolist(),
            chunk.steps.tolist(),
            strict=True,
        ):
            out[key] = (shows, clicks, count, step)
    return out


def test_pushes_feed_shows_and_clicks_with_lazy_decay(ps: ParameterServer) -> None:
    """Increments are added after the row's statistics decay from its last
    update to the push's step; a repeated key's are summed; a push without
    increments decays them; ``count`` counts applied pushes as before."""
    t = stats_table(ps)
    push_stats(ps, t, [1, 2, 2, 3], step=0, shows=[1, 1, 1, 1], clicks=[1, 0, 1, 0])
    assert stats_by_key(ps, t) == {1: (1, 1, 1, 0), 2: (2, 1, 1, 0), 3: (1, 0, 1, 0)}
    push_stats(ps, t, [2], step=10, shows=[1])  # no clicks: they only decay
    push_stats(ps, t, [1], step=20)  # no increments at all
    push_stats(ps, t, [3], step=5, clicks=[4])
    rows = stats_by_key(ps, t)
    assert rows[2] == (2 * 0.5 + 1, 0.5, 2, 10)
    assert rows[1] == (0.25, 0.25, 2, 20)
    assert rows[3][2:] == (2, 5)
    np.testing.assert_allclose(rows[3][:2], [0.5**0.5, 4], rtol=1e-6)
    ps.push(t, [9], full(1, 2, 0.0), step=30)  # plain push: no statistics
    assert stats_by_key(ps, t)[9] == (0, 0, 1, 30)

    still = stats_table(ps, "still", half_life=0)
    push_stats(ps, still, [5], step=1, shows=[3], clicks=[1])
    push_stats(ps, still, [5], step=1000, shows=[1])
    assert stats_by_key(ps, still) == {5: (4, 1, 2, 1000)}


def test_top_keys_orders_by_decayed_shows(ps: ParameterServer) -> None:
    """The hottest keys by shows decayed to a step (default: the newest
    row's), most first, ties by key, over every shard and server."""
    t = stats_table(ps, half_life=4)
    keys = np.arange(1, 61, dtype=np.int64) * 7919
    shows = (np.arange(60) % 7 + 1).astype(F32)  # ties across keys
    push_stats(ps, t, keys, step=0, shows=shows)
    late = keys[:5]
    push_stats(ps, t, late, step=8, shows=np.full(5, 2, F32))  # newest step: 8

    def expected(at: int) -> list[tuple[int, float]]:  # at >= 8
        decayed = {
            int(k): float(s) * 0.5 ** (at / 4) for k, s in zip(keys, shows, strict=True)
        }  # stamped at 0
        for k, s in zip(late.tolist(), shows[:5].tolist(), strict=True):
            decayed[k] = (s * 0.25 + 2) * 0.5 ** ((at - 8) / 4)  # 0.5 ** (8 / 4), + 2 at 8
        return sorted(decayed.items(), key=lambda kv: (-kv[1], kv[0]))

    for step, n in ((None, 10), (8, 60), (12, 100), (20, 1)):
        top, top_shows = ps.top_keys(t, n) if step is None else ps.top_keys(t, n, step=step)
        assert top.dtype == np.uint64 and top_shows.dtype == F32
        want = expected(8 if step is None else step)[:n]
        assert top.tolist() == [k for k, _ in want], step
        np.testing.assert_allclose(top_shows, [s for _, s in want], rtol=1e-6)
    assert len(ps.top_keys(t, 0)[0]) == 0
    empty = stats_table(ps, "empty")
    assert len(ps.top_keys(empty, 5)[0]) == 0
    with pytest.raises(UnknownTableError, match="nope"):
        ps.top_keys("nope", 5)
    with pytest.raises(ValueError, match="n must be"):
        ps.top_keys(t, -1)


def test_statistics_round_trip_through_load_and_part_files(
    ps: ParameterServer, make_ps: MakeServer, shards: int, tmp_path: Any
) -> None:
    """``export`` → ``load`` and ``write_rows`` → ``load_rows`` carry shows
    and clicks as of each row's step: the copies decay and rank alike."""
    t = stats_table(ps, half_life=3)
    rng = np.random.default_rng(SEED)
    keys = np.unique(rng.integers(1, 2**62, 80, dtype=np.int64))
    for step in range(1, 6):
        idx = rng.integers(0, len(keys), 40)
        push_stats(ps, t, keys[idx], step, rng.integers(1, 4, 40), rng.integers(0, 2, 40))
    source = stats_by_key(ps, t)
    assert len({s for s, *_ in source.values()}) > 3

    other = make_ps(OTHER_SHARDS[shards])
    other.create_table(ps.spec(t))
    for chunk in ps.export(t, chunk_rows=7):
        other.load(
            t,
            chunk.keys,
            chunk.weights,
            chunk.state,
            chunk.counts,
            chunk.steps,
            chunk.times,
            chunk.versions,
            shows=chunk.shows,
            clicks=chunk.clicks,
        )
    assert stats_by_key(other, t) == source

    files, n = ps.write_rows(tmp_path, ps.spec(t), state=True)
    assert n == len(source)
    back = make_ps(shards)
    back.create_table(ps.spec(t))
    assert back.load_rows(tmp_path, t, [name for name, _ in files]) == n
    assert stats_by_key(back, t) == source
    for server in (other, back):
        for step in (None, 9):
            mine, theirs = ps.top_keys(t, 20, step=step), server.top_keys(t, 20, step=step)
            np.testing.assert_array_equal(mine[0], theirs[0])
            np.testing.assert_array_equal(mine[1], theirs[1])
    push_stats(back, t, keys[:1], step=9, shows=[1])
    push_stats(ps, t, keys[:1], step=9, shows=[1])
    assert stats_by_key(back, t)[int(keys[0])] == stats_by_key(ps, t)[int(keys[0])]


def test_statistics_accumulate_over_training_steps(
    ps: ParameterServer,
) -> None:
    """A trainer's pattern (a training pull, then a push with increments,
    step after step) adds up as one push at a time does, decay included."""
    t = stats_table(ps, half_life=20)
    keys = np.array([1, 2, 3, 4], np.int64)
    expected = np.zeros(4)
    for step in range(1, 41):
        ps.pull(t, keys, step=step)
        shows = np.array([1, 2, 3, 4], F32)
        push_stats(ps, t, keys, step, shows=shows, clicks=shows / 2)
        expected = expected * 0.5 ** (1 / 20) + shows
    rows = stats_by_key(ps, t)
    got = np.array([rows[k][0] for k in range(1, 5)])
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose([rows[k][1] for k in range(1, 5)], expected / 2, rtol=1e-5)
    top, top_shows = ps.top_keys(t, 2)
    assert top.tolist() == [4, 3]
    np.testing.assert_allclose(top_shows, expected[[3, 2]], rtol=1e-5)


# --- 11. read_rows -------------------------------------------------------------------

ALL_COLUMNS = (*COLUMNS, "shows", "clicks")


def export_every_column(ps: ParameterServer, table: str) -> RowChunk:
    """``export_all`` with the shows and clicks too."""
    rows = export_all(ps, table)
    chunks = list(ps.export(table))
    if not chunks:
        return rows
    keys = np.concatenate([c.keys for c in chunks])
    order = np.argsort(keys, kind="stable")
    stats = {
        name: np.concatenate([getattr(c, name) for c in chunks])[order] for name in ALL_COLUMNS[-2:]
    }
    np.testing.assert_array_equal(keys[order], rows.keys)
    return RowChunk(**{name: getattr(rows, name) for name in COLUMNS}, **stats)


def expected_rows(exported: RowChunk, keys: np.ndarray) -> tuple[RowChunk, np.ndarray]:
    """What ``read_rows`` must give of ``keys``: the exported rows (sorted
    by key) of the keys that have one, in the order of ``keys``, and which do."""
    keys = np.asarray(keys).astype(np.uint64)
    at = np.minimum(np.searchsorted(exported.keys, keys), max(len(exported) - 1, 0))
    found = exported.keys[at] == keys if len(exported) else np.zeros(len(keys), bool)
    picked = at[found]
    return RowChunk(**{name: getattr(exported, name)[picked] for name in ALL_COLUMNS}), found


def check_read(ps: ParameterServer, table: str, keys: Any, exported: RowChunk) -> np.ndarray:
    """``read_rows(table, keys)`` equals ``expected_rows``, column by column
    (dtypes and shapes too); returns ``found``."""
    spec = ps.spec(table)
    rows, found = ps.read_rows(table, keys)
    want, want_found = expected_rows(exported, np.asarray(keys, np.int64 if len(keys) else None))
    assert found.dtype == bool and found.shape == (len(keys),)
    np.testing.assert_array_equal(found, want_found)
    n = int(want_found.sum())
    assert len(rows) == n
    assert rows.weights.shape == (n, spec.dim) and rows.state.shape == (n, spec.state_dim)
    for name in ALL_COLUMNS:
        got = getattr(rows, name)
        assert got.dtype == getattr(want, name).dtype, name
        np.testing.assert_array_equal(got, getattr(want, name), err_msg=name)
    return found


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam", "ftrl"])
def test_read_rows_gives_what_export_gives(
    opt_name: str, ps: ParameterServer, rng: np.random.Generator
) -> None:
    """After loads, training pulls and pushes with show and click increments
    over steps and versions, ``read_rows`` of present keys (shuffled), absent
    keys and repeats gives each key's exported row, every column (weights,
    optimizer state, count, step, time, version, shows, clicks), and changes
    nothing: the rows, the stats and the version are the same afterwards."""
    spec = TableSpec(
        "t",
        dim=3,
        optimizer=OPTIMIZERS[opt_name],
        initializer=TruncatedNormal(stddev=0.1),
        seed=5,
        stats_half_life=4.0,
    )
    ps.create_table(spec)
    keys = train_rows(ps, "t", rng)
    for step in (110, 113):
        idx = rng.integers(0, len(keys), size=len(keys) // 3)
        shows = rng.integers(1, 4, len(idx)).astype(F32)
        part = PushPart(
            "t",
            keys[idx],
            rng.standard_normal((len(idx), 3)).astype(F32),
            shows=shows,
            clicks=shows * (rng.random(len(idx)) < 0.3),
        )
        ps.push_many([part], step=step)
    exported = export_every_column(ps, "t")
    assert (exported.shows > 0).any() and (exported.clicks > 0).any()
    stats, version = ps.stats("t"), ps.version
    absent = np.array([7, -3, 2**62], np.int64)
    absent = absent[~np.isin(absent.astype(np.uint64), exported.keys)]
    asked = np.concatenate([rng.permutation(keys)[:90], absent, keys[:5], keys[3:4], absent[:1]])
    found = check_read(ps, "t", asked, exported)
    assert found[:90].sum() > 45 and not found[90 : 90 + len(absent)].any()
    check_read(ps, "t", keys.view(np.uint64), exported)  # every row, as uint64
    check_read(ps, "t", asked.tolist(), exported)  # a list of ints
    assert unmoved(ps.stats("t")) == unmoved(stats) and ps.version == version
    assert_same_rows(export_every_column(ps, "t"), exported, ALL_COLUMNS)


def exchange_setup(ps: ParameterServer) -> np.ndarray:
    """Two tables (one admitting on the second training pull) with trained
    rows, the clock fixed; returns the trained keys of "a"."""
    ps.set_clock(1_750_000_000)
    spec = TableSpec(
        "a", dim=3, optimizer=OPTIMIZERS["adagrad"], initializer=TruncatedNormal(stddev=0.1),
        seed=5, stats_half_life=4.0,
    )  # fmt: skip
    ps.create_table(spec)
    sgd_table(ps, "b", dim=2, admission=Admission(min_count=2))
    return train_rows(ps, "a", np.random.default_rng(SEED))


def test_exchange_many_equals_its_calls_one_by_one(
    ps: ParameterServer, make_ps: MakeServer
) -> None:
    """``exchange_many`` (rows given back loaded, misses pulled for training,
    incoming rows read whole) gives what ``load``, ``pull_many`` and
    ``read_rows`` give one after the other on a server in the same state:
    the same ``out``, the same rows read (found or not: a key waiting for
    admission has none), and the same rows afterwards, every column."""
    other = make_ps(ps.num_shards)
    trained = exchange_setup(ps)
    assert (exchange_setup(other) == trained).all()
    back, _ = ps.read_rows("a", trained[:20])  # a cache's victims, changed there
    back = RowChunk(
        keys=back.keys, weights=back.weights + 1, state=back.state * 2, counts=back.counts + 3,
        steps=back.steps + 1, times=back.times, versions=back.versions,
        shows=back.shows + 2, clicks=back.clicks,
    )  # fmt: skip
    back = dataclasses.replace(back, versions=None)  # the server's version now, as a load's
    new = np.array([11, -7, 2**40], np.int64)
    misses_a = np.concatenate([trained[30:60], new, trained[35:37], new[:1]])
    incoming_a = np.concatenate([trained[30:40], new])
    misses_b = np.array([5, 6, 5, 9], np.int64)  # 5 is admitted (seen twice), 6 and 9 wait
    reads_only = np.concatenate([trained[100:103], [999]])  # 999: no row
    out = {name: (np.empty((len(m), d), F32), np.empty((len(m), d), F32))
           for name, m, d in (("a", misses_a, 3), ("b", misses_b, 2))}  # fmt: skip
    got = ps.exchange_many(
        [
            ExchangePart("a", misses_a, out["a"][0], incoming_a, back=back),
            ExchangePart("b", misses_b, out["b"][0], np.array([5, 6], np.int64)),
            ExchangePart("a", [], np.empty((0, 3), F32), []),
            ExchangePart("a", [], np.empty((0, 3), F32), reads_only),  # no pull: rows read
        ],
        step=120,
    )
    other.load(
        "a", back.keys, back.weights, back.state, back.counts, back.steps, back.times,
        back.versions, back.shows, back.clicks, step=120,
    )  # fmt: skip
    asked = [("a", incoming_a), ("b", np.array([5, 6], np.int64)), ("a", []), ("a", reads_only)]
    before = [other.contains(table, keys) for table, keys in asked]
    other.pull_many(
        [PullPart("a", misses_a, out["a"][1]), PullPart("b", misses_b, out["b"][1])], step=120
    )
    want = [other.read_rows(table, keys) for table, keys in asked]
    for name in ("a", "b"):
        np.testing.assert_array_equal(out[name][0], out[name][1], err_msg=name)
    assert [g.found.tolist() for g in got] == [f.tolist() for _, f in want]
    assert [g.created.tolist() for g in got] == [
        (f & ~b).tolist() for (_, f), b in zip(want, before, strict=True)
    ]
    assert got[1].found.tolist() == [True, False] and got[1].created.tolist() == [True, False]
    assert got[0].created.tolist() == [False] * 10 + [True] * 3  # the new keys' rows
    for exchanged, (expected, _) in zip(got, want, strict=True):
        assert_same_rows(exchanged.rows, expected, ALL_COLUMNS)
    for name in ("a", "b"):
        assert_same_rows(export_every_column(ps, name), export_every_column(other, name),
                         ALL_COLUMNS)  # fmt: skip
    assert ps.version == other.version
    with pytest.raises(ValueError, match="weights"):  # rows given back need their weights
        bad = RowChunk(**{**back.__dict__, "weights": np.zeros((20, 2), F32)})
        ps.exchange_many([ExchangePart("a", [], np.empty((0, 3), F32), [], back=bad)])
    with pytest.raises(UnknownTableError, match="nope"):
        ps.exchange_many([ExchangePart("nope", [1], np.empty((1, 3), F32), [])])


def test_exchange_many_merges_changes_of_several_trainers(ps: ParameterServer) -> None:
    """``merge=True``: the changes given back add up on the server, whoever
    sends them (two trainers' caches, Geo-SGD): weights and state added,
    counts added, shows and clicks added after the row's decay to the
    change's step, step and time the later; a key without a row gets its
    initial row first; the incoming rows read in the same exchange are the
    merged ones; the rows enter the server's version now."""
    trained = exchange_setup(ps)
    keys = trained[40:50]  # rows trained over steps (not loaded)
    base, found = ps.read_rows("a", keys)
    assert found.all()
    fresh = np.array([77_000_001], np.int64)  # no row on the server
    initial = ps.lookup("a", fresh, missing="initial").rows
    version = ps.version
    rng = np.random.default_rng(SEED)
    everything = np.concatenate([keys, fresh])
    n, half_life = len(everything), ps.spec("a").stats_half_life

    def change(step: int) -> RowChunk:
        return RowChunk(
            keys=everything, weights=rng.standard_normal((n, 3)).astype(F32),
            state=rng.random((n, 3)).astype(F32), counts=np.full(n, 2, np.uint32),
            steps=np.full(n, step, np.uint64), times=np.full(n, 1_750_000_100 + step, np.uint32),
            versions=None, shows=np.full(n, 1.5, F32), clicks=np.full(n, 0.5, F32),
        )  # fmt: skip

    first, second = change(200), change(210)
    none = np.empty((0, 3), F32)
    ps.exchange_many([ExchangePart("a", [], none, [], back=first, merge=True)])
    got = ps.exchange_many([ExchangePart("a", [], none, everything, back=second, merge=True)])[0]
    assert got.found.all() and not got.created.any()
    rows = got.rows
    np.testing.assert_array_equal(rows.keys.view(np.int64), everything)
    start_w = np.concatenate([base.weights, initial])
    np.testing.assert_allclose(
        rows.weights, start_w + first.weights + second.weights, rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        rows.state[:-1], base.state.reshape(-1, 3) + first.state[:-1] + second.state[:-1],
        rtol=1e-6, atol=1e-6,
    )  # fmt: skip
    np.testing.assert_array_equal(rows.counts[:-1], base.counts + 4)
    np.testing.assert_array_equal(rows.steps, np.full(n, 210, np.uint64))
    np.testing.assert_array_equal(rows.times, second.times)
    decay = 2.0 ** (-(200.0 - base.steps.astype(np.float64)) / half_life)
    shows = (base.shows * decay + 1.5) * 2.0 ** (-10 / half_life) + 1.5
    np.testing.assert_allclose(rows.shows[:-1], shows, rtol=1e-5)
    assert rows.shows[-1] == pytest.approx(1.5 * 2.0 ** (-10 / half_life) + 1.5, rel=1e-5)
    assert set(rows.versions.tolist()) == {version}
    if version > 0:  # the rows are in the version's delta
        changed = np.concatenate([c.keys for c in ps.export("a", since=version - 1)])
        assert set(everything.tolist()) <= set(changed.view(np.int64).tolist())
    with pytest.raises(ValueError, match="version"):
        stamped = dataclasses.replace(first, versions=np.zeros(n, np.uint64))
        ps.exchange_many([ExchangePart("a", [], none, [], back=stamped, merge=True)])


def test_an_fp16_table_trains_with_float32_state(ps: ParameterServer, make_ps: MakeServer) -> None:
    """``precision="fp16"``: pulls and pushes train it (``int8`` only
    serves); its weights are halves (updated in float32, stored rounded
    stochastically, the same bits on every server given the same calls),
    ``updated`` reports what is stored, the state is float32, and its rows
    read, export and reload as any table's."""
    other = make_ps(ps.num_shards)
    spec = TableSpec("h", dim=4, optimizer=OPTIMIZERS["adagrad"],
                     initializer=TruncatedNormal(stddev=0.1), seed=2, precision="fp16")  # fmt: skip
    rng = np.random.default_rng(SEED)
    keys = rng.integers(0, 50, 80).astype(np.int64)
    for server in (ps, other):
        server.set_clock(1_750_000_000)  # the same times on both
        server.create_table(spec)
    reported = []
    for step in range(1, 6):
        grads = rng.standard_normal((80, 4)).astype(F32)
        for server in (ps, other):
            out = np.empty((80, 4), F32)
            server.pull_many([PullPart("h", keys, out)], step=step)
            updated = np.empty((80, 4), F32)
            server.push_many([PushPart("h", keys, grads, updated=updated)], step=step)
            reported.append(updated)
    every = np.unique(keys)
    rows, found = ps.read_rows("h", every)
    assert found.all()
    np.testing.assert_array_equal(rows.weights, rows.weights.astype(np.float16).astype(F32))
    assert rows.state.dtype == F32 and rows.state.reshape(len(every), -1).shape[1] == 4
    assert (rows.state > 0.1).any()  # the accumulator took the squared gradients
    np.testing.assert_array_equal(rows.weights, other.read_rows("h", every)[0].weights)
    np.testing.assert_array_equal(reported[-1], reported[-2])  # both servers, the last push
    np.testing.assert_array_equal(ps.lookup("h", keys).rows, reported[-1])
    assert_same_rows(export_all(ps, "h"), export_all(other, "h"), COLUMNS)


def test_read_rows_of_no_keys_absent_keys_and_an_empty_table(ps: ParameterServer) -> None:
    """No keys, only absent keys, or an empty table: no rows (of the
    table's shapes) and every key not found; bad keys raise as elsewhere."""
    ps.create_table(TableSpec("a", dim=2, optimizer=Adam(), stats_half_life=2.0))
    exported = export_every_column(ps, "a")
    for keys in ([], np.zeros(0, np.int64), np.zeros(0, np.uint64), [1, 2, 2]):
        assert not check_read(ps, "a", keys, exported).any()
    ps.push_many(
        [PushPart("a", np.array([5, 6], np.int64), full(2, 2), shows=np.ones(2, F32))], step=1
    )
    exported = export_every_column(ps, "a")
    assert check_read(ps, "a", [6, 1, 5, 6, 6], exported).tolist() == [1, 0, 1, 1, 1]
    assert not check_read(ps, "a", [1, 2, 2**62], exported).any()
    with pytest.raises(TypeError, match="keys"):
        ps.read_rows("a", np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="keys"):
        ps.read_rows("a", np.zeros((2, 2), np.int64))
    with pytest.raises(UnknownTableError, match="'nope'"):
        ps.read_rows("nope", [])


# --- 12. the clock ------------------------------------------------------------------

CLOCK = 1_700_000_000  # 2023-11-14: a data time far behind the wall clock
HOUR, DAY = 3600, 86400


def times_of(ps: ParameterServer, table: str, keys: list[int]) -> list[int]:
    """The exported update time (unix seconds) of each key's row."""
    rows = export_all(ps, table)
    where = {k: i for i, k in enumerate(rows.keys.tolist())}
    return [int(rows.times[where[k]]) for k in keys]


def test_rows_carry_the_clock(ps: ParameterServer) -> None:
    """With ``set_clock(T)`` every call that writes a row stamps T whatever
    the wall clock (``push``, ``push_many``, a training pull that creates
    the row, a ``load`` without times); ``clock()`` reads T back; a later
    clock stamps only the rows updated under it."""
    t = sgd_table(ps)
    assert ps.clock() is None
    ps.set_clock(CLOCK)
    assert ps.clock() == CLOCK
    ps.push(t, [1, 2], full(2), step=1)
    ps.push_many([PushPart(t, [3], full(1))], step=1)
    ps.pull(t, [4], step=1)
    ps.load(t, [5], full(1), step=1)
    assert times_of(ps, t, [1, 2, 3, 4, 5]) == [CLOCK] * 5
    ps.set_clock(CLOCK + HOUR)
    assert ps.clock() == CLOCK + HOUR
    ps.pull(t, [1, 2], step=2)  # reading is not an update
    ps.push(t, [1], full(1), step=2)
    ps.load(t, [6, 7], full(2), times=np.array([5, 6], np.uint32), step=2)  # times given: kept
    assert times_of(ps, t, [1, 2, 6, 7]) == [CLOCK + HOUR, CLOCK, 5, 6]


def test_ttl_in_seconds_counts_back_from_the_clock(ps: ParameterServer) -> None:
    """``TTL(seconds=3600)``: rows stamped at T stay while the clock is at
    most an hour past T and go once it is more, whatever the wall clock;
    rows stamped at a later clock stay."""
    t = sgd_table(ps, eviction=Eviction(ttl_seconds=HOUR))
    ps.set_clock(CLOCK)
    ps.push(t, [1, 2], full(2), step=1)
    ps.set_clock(CLOCK + HOUR // 2)
    assert ps.evict(t, step=2)["total"] == 0
    ps.set_clock(CLOCK + HOUR)  # exactly the TTL old: not older than it
    assert ps.evict(t, step=2)["total"] == 0
    ps.set_clock(CLOCK + 7000)
    ps.push(t, [3], full(1), step=3)
    ps.set_clock(CLOCK + 2 * HOUR)
    result = ps.evict(t, step=4)
    assert (result["ttl"], result["total"]) == (2, 2)
    np.testing.assert_array_equal(ps.contains(t, [1, 2, 3]), [False, False, True])
    assert set(removed(ps, t)) == {1, 2}


def test_replaying_old_partitions_evicts_nothing_live(ps: ParameterServer) -> None:
    """A trainer replaying the partitions of a month ago, its clock set to
    each one's hour: nothing pushed under a partition's clock goes while it
    is younger than the TTL by the data's time, however fast the replay;
    rows stamped by the wall clock (live ones) never go; replayed rows go
    once the replay's clock passes their TTL."""
    t = sgd_table(ps, eviction=Eviction(ttl_seconds=2 * HOUR))
    ps.push(t, [1, 2], full(2), step=1)  # live rows, stamped by the wall clock
    past = int(time.time()) - 30 * DAY
    for hour in range(3):
        ps.set_clock(past + hour * HOUR)
        ps.push(t, [10 + hour], full(1), step=2 + hour)
        assert ps.evict(t, step=2 + hour)["total"] == 0, hour
    assert times_of(ps, t, [10, 11, 12]) == [past, past + HOUR, past + 2 * HOUR]
    ps.set_clock(past + 3 * HOUR)  # key 10 is 3 h old by the data's time
    assert ps.evict(t, step=5)["total"] == 1
    np.testing.assert_array_equal(
        ps.contains(t, [1, 2, 10, 11, 12]), [True, True, False, True, True]
    )


def test_none_returns_to_the_wall_clock(ps: ParameterServer) -> None:
    """A trainer that resumes days after its last partition sets the next
    one's time: nothing goes by the wall clock. ``set_clock(None)`` (or 0)
    returns to the wall clock: rows are stamped with the time of the call
    and TTLs count back from it (the old partition's rows go)."""
    t = sgd_table(ps, eviction=Eviction(ttl_seconds=2 * HOUR))
    ps.set_clock(CLOCK)
    ps.push(t, [1], full(1), step=1)
    ps.set_clock(CLOCK + HOUR)  # the next partition, years later by the wall clock
    assert ps.evict(t, step=2)["total"] == 0
    ps.set_clock(None)
    assert ps.clock() is None
    before = int(time.time())
    ps.push(t, [2], full(1), step=3)
    after = int(time.time())
    (stamped,) = times_of(ps, t, [2])
    assert before - 1 <= stamped <= after + 1, (before, stamped, after)
    assert ps.evict(t, step=4)["total"] == 1  # key 1: years old by the wall clock
    np.testing.assert_array_equal(ps.contains(t, [1, 2]), [False, True])
    ps.set_clock(CLOCK)
    ps.set_clock(0)  # 0 is the wall clock too
    assert ps.clock() is None


@pytest.mark.parametrize("bad", [-1, 2**32, 2**33, "x", 1.5, True, [CLOCK]])
def test_a_bad_clock_names_the_value(bad: Any, ps: ParameterServer) -> None:
    """A clock that is no int in [0, 2**32) (nor None) raises ValueError
    naming the value; the clock stays as it was and the server goes on."""
    t = sgd_table(ps)
    ps.set_clock(CLOCK)
    with pytest.raises(ValueError, match=f"got {re.escape(repr(bad))}$"):
        ps.set_clock(bad)
    assert ps.clock() == CLOCK
    ps.push(t, [1], full(1), step=1)
    assert times_of(ps, t, [1]) == [CLOCK]
    ps.set_clock(2**32 - 1)  # the largest
    assert ps.clock() == 2**32 - 1


def test_a_sized_tables_block_grows_and_shrinks_by_its_base_rows_score(
    ps: ParameterServer,
) -> None:
    ps.create_table(TableSpec("b", 2, optimizer=SGD(0.5), stats_half_life=10.0))
    grow = Grow("b", 4.0, 2.0, click_weight=2.0)
    ps.create_table(TableSpec("b@6", 4, optimizer=SGD(0.5), initializer=Zeros(), grow=grow))
    keys = np.arange(1, 41, dtype=np.int64)  # over every server and shard
    out = np.empty((len(keys), 4), F32)

    def train(step: int, shows: np.ndarray, clicks: np.ndarray | None = None) -> None:
        ps.pull_many([PullPart("b@6", keys, out)], train=True, step=step)
        assert (out[~ps.contains("b@6", keys)] == 0).all()  # pulls read zeros, make no row
        ps.push_many(
            [
                PushPart("b", keys, full(len(keys), 2), shows=shows, clicks=clicks),
                PushPart("b@6", keys, full(len(keys), 4)),
            ],
            step=step,
        )

    odd = (keys % 2 == 1).astype(F32)
    train(1, 3 * odd, clicks=(keys % 4 == 1).astype(F32))  # 1 mod 4: 3 + 2 * 1 = 5
    grown = ps.contains("b@6", keys)
    np.testing.assert_array_equal(grown, keys % 4 == 1)
    rows = ps.lookup("b@6", keys)
    np.testing.assert_allclose(rows.rows[grown], -0.5)  # zeros, then this push's gradient
    assert (rows.rows[~grown] == 0).all()
    stats = ps.stats("b@6")
    assert (stats["rows"], stats["grown"], stats["dropped_pending"]) == (10, 10, 30)
    train(2, 2 * odd)  # odd keys: 3 * 0.5 ** 0.1 + 2 > 4: grow; even keys never do
    grown = ps.contains("b@6", keys)
    np.testing.assert_array_equal(grown, keys % 2 == 1)
    chunk = export_all(ps, "b@6")
    assert sorted(chunk.keys.tolist()) == keys[grown].tolist()
    # scores after step 2: 4.80 (3 mod 4), 6.67 (1 mod 4); halved at step 12: between 2 and 4
    assert ps.evict("b@6", step=12)["shrunk"] == 0
    result = ps.evict("b@6", step=17)  # times 0.354: 1.70 < 2 shrinks, 2.36 stays
    assert result["shrunk"] == result["total"] == 10
    np.testing.assert_array_equal(ps.contains("b@6", keys), keys % 4 == 1)
    assert sorted(ps.removed_keys("b@6").tolist()) == keys[keys % 4 == 3].tolist()
    assert ps.stats("b@6")["shrunk"] == 10
    with pytest.raises(ValueError, match="b@6"):
        ps.drop_table("b")
    ps.drop_table("b@6")
    ps.drop_table("b")
