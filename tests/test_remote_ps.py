"""``wuliang ps`` as real processes, and ``RemoteServer`` over them.

Every server here is a child process (``python -m wuliang ps --port 0 ...``)
started through ``tests/processes.py`` (a process group of its own, stopping
by itself should the test process die); its start line names the port it
bound, which the tests parse. Every wait is bounded, and the ``start_ps``
fixture stops and reaps whatever is still running when a test ends (a test
that stops a server itself asserts its exit code).

What passing guarantees:

* Two servers and a ``RemoteServer`` over them give, bit for bit, what an
  embedded ``Engine`` gives for the same calls: pulls (training, with
  steps, of two tables at once), pushes over several steps (with duplicate
  keys and updated rows), exports (every column; the update times to the
  second), lookups, stats (the counters of the two servers summed), erase
  and contains, the removal log, and versions with a delta export.
* The start line is one line naming the scheme, address and shard threads;
  SIGTERM and SIGINT each make the server exit 0 within a few seconds, with
  a trainer still connected, also when a thread other than the main one
  takes the signal.
* With ``--token-file`` a client without the token, or with a wrong one, is
  refused UNAUTHENTICATED (its data stream too), while a client with it is
  served.
* With ``--tls-cert``/``--tls-key`` a TLS client is served and a plain one
  fails, naming the server.
* A client refuses servers that run different ``--threads``, naming both
  servers' counts.
* A server killed with SIGKILL and started again on its port within the
  client's ``retry_seconds``: a pull issued while it was down completes once
  it is back; one down longer than ``retry_seconds`` fails the call (data
  stream and unary call alike) with an error naming the server.
* A push retried after its answer was lost (the same client id and sequence
  number on a second stream) is answered again, not applied twice.
* ``set_clock`` sets every server's clock; a server restarted comes back on
  the wall clock (``clock()`` names each server's) until it is set again; a
  ``SetClock`` request that does not parse is refused and the server goes on.
"""

from __future__ import annotations

import json
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import processes
import pytest

from wuliang.ps_server import (
    SGD,
    Adagrad,
    Constant,
    Engine,
    PullPart,
    PushPart,
    TableSpec,
    TruncatedNormal,
)
from wuliang.ps_server.remote import proto
from wuliang.ps_server.remote.client import RemoteError, RemoteServer

M = proto.M
START_TIMEOUT = 60.0  # seconds for a server to print its start line (a loaded CI machine)
STOP_TIMEOUT = 8.0  # seconds from SIGTERM/SIGINT to the exit, a trainer connected
CALL_TIMEOUT = 20.0  # a call's deadline
START_LINE = re.compile(
    r"parameter server listening on (grpc|grpc\+tls) 127\.0\.0\.1:(\d+) \((\d+) shard threads\)"
)
COLUMNS = ("keys", "weights", "state", "counts", "steps", "versions")  # times: to the second
# stats that count rows and keys; the others measure memory, which depends on
# the number of shards in all (two servers of two shards hold four).
COUNTERS = (
    "rows", "pending_keys", "removed_log", "change_log", "pulled_keys", "pull_misses",
    "pushed_keys", "inserted", "admitted", "dropped_pending", "dropped_nan",
    "pending_forgotten", "erased", "evicted_ttl", "evicted_min_count", "evicted_lfu",
)  # fmt: skip


# -- the processes ----------------------------------------------------------------------


@dataclass
class Ps:
    """A running ``wuliang ps``: its process, start line, port and log."""

    process: subprocess.Popen[str]
    log: Path
    line: str = ""
    port: int = 0
    threads: int = 0
    scheme: str = ""
    stdout_rest: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> tuple[int, float]:
        """Sends ``sig``; (exit code, seconds until the exit). Fails after ``timeout``."""
        start = time.monotonic()
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"wuliang ps did not exit {timeout:g} s after {sig!r}: {self.log_text()}")
        seconds = time.monotonic() - start
        assert self.process.stdout is not None
        self.stdout_rest.append(self.process.stdout.read())
        return code, seconds

    def kill(self) -> None:
        """SIGKILL, and reaps it."""
        self.process.kill()
        self.process.wait(timeout=30)


StartPs = Callable[..., Ps]


@pytest.fixture
def start_ps(tmp_path: Path) -> Iterator[StartPs]:
    """``start_ps(*args, port=0)``: a ``wuliang ps`` process that has printed
    its start line. Every process started is stopped (SIGTERM, then SIGKILL)
    and reaped afterwards (``tests/processes.py``)."""
    started: list[Ps] = []

    def start(*args: str, port: int = 0) -> Ps:
        log = tmp_path / f"ps-{len(started)}.log"
        command = processes.ps_command("--port", str(port), *args)
        with open(log, "w") as stderr:
            process = processes.spawn(
                command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp_path
            )
        ps = Ps(process, log)
        started.append(ps)
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT)
        ps.line = process.stdout.readline() if ready else ""
        assert ps.line, f"no start line in {START_TIMEOUT:g} s: {ps.log_text()}"
        match = START_LINE.fullmatch(ps.line.rstrip("\n"))
        assert match, f"unexpected start line {ps.line!r}"
        ps.scheme, ps.port, ps.threads = match[1], int(match[2]), int(match[3])
        assert ps.port > 0 and (port == 0 or ps.port == port), ps.line
        return ps

    yield start
    processes.stop_each([ps.process for ps in started])  # all of them, whatever fails


@pytest.fixture
def clients() -> Iterator[Callable[..., RemoteServer]]:
    """``clients(addresses, **options)``: a RemoteServer, closed afterwards."""
    made: list[RemoteServer] = []

    def make(addresses: list[str], **options: Any) -> RemoteServer:
        options.setdefault("timeout", CALL_TIMEOUT)
        options.setdefault("retry_seconds", 5.0)
        client = RemoteServer(addresses, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def table_specs() -> list[TableSpec]:
    return [
        TableSpec(
            "emb",
            8,
            optimizer=Adagrad(0.05, initial_accumulator=0.1),
            initializer=TruncatedNormal(stddev=0.1),
            seed=11,
        ),
        TableSpec("bias", 1, optimizer=Adagrad(0.1), initializer=Constant(0.25), seed=3),
    ]


SPEC = table_specs()[0]


def sorted_export(ps: Any, table: str, since: int = 0) -> dict[str, np.ndarray]:
    """Every column of a table's export, rows sorted by key."""
    chunks = list(ps.export(table, since=since, chunk_rows=97))
    columns = {
        name: np.concatenate([getattr(c, name) for c in chunks]) if chunks else np.zeros(0)
        for name in (*COLUMNS, "times")
    }
    order = np.argsort(columns["keys"], kind="stable")
    return {name: values[order] for name, values in columns.items()}


def assert_same_export(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert len(want["keys"]) > 0
    for name in COLUMNS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name, strict=True)
    # unix seconds of the last update: two processes' clocks read at nearly the same time
    gap = np.abs(got["times"].astype(np.int64) - want["times"].astype(np.int64))
    assert gap.max() <= 5, gap.max()


# -- the same answers as the embedded engine ----------------------------------------------


def test_two_servers_answer_what_the_embedded_engine_answers(
    start_ps: StartPs, clients: Callable[..., RemoteServer]
) -> None:
    """Pulls, pushes, exports, lookups, stats, erase/contains, the removal
    log and versions over two ``wuliang ps`` processes equal, bit for bit,
    an embedded engine's for the same calls."""
    servers = [start_ps("--threads", "2"), start_ps("--threads", "2")]
    remote = clients([s.address for s in servers])
    assert (remote.num_servers, remote.num_shards) == (2, 2)
    engine = Engine(2)
    try:
        for spec in table_specs():
            remote.create_table(spec)
            engine.create_table(spec)
        remote.create_table(SPEC)  # the same spec again: nothing happens (several workers)
        assert remote.tables() == engine.tables() == ["emb", "bias"]
        assert remote.spec("emb") == SPEC

        rng = np.random.default_rng(7)
        pool = rng.integers(0, 2**64 - 1, 400, dtype=np.uint64, endpoint=True)
        for step in range(1, 6):
            keys = rng.choice(pool, 256)  # with repeats
            bias_keys = rng.choice(pool[:50], 64)
            got = [np.empty((256, 8), np.float32), np.empty((64, 1), np.float32)]
            want = [np.empty((256, 8), np.float32), np.empty((64, 1), np.float32)]
            for ps, out in ((remote, got), (engine, want)):
                ps.pull_many(
                    [PullPart("emb", keys, out[0]), PullPart("bias", bias_keys, out[1])],
                    train=True,
                    step=step,
                )
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b, strict=True)

            grads = rng.normal(0, 1, (256, 8)).astype(np.float32)
            bias_grads = rng.normal(0, 1, (64, 1)).astype(np.float32)
            updated = [np.zeros((256, 8), np.float32), np.zeros((256, 8), np.float32)]
            results = []
            for ps, out in zip((remote, engine), updated, strict=True):
                results.append(
                    ps.push_many(
                        [
                            PushPart("emb", keys, grads, updated=out),
                            PushPart("bias", bias_keys, bias_grads),
                        ],
                        step=step,
                    )
                )
            assert results[0] == results[1]
            assert results[0].applied > 0 and results[0].duplicates > 0
            np.testing.assert_array_equal(updated[0], updated[1], strict=True)

        for table in ("emb", "bias"):
            assert_same_export(sorted_export(remote, table), sorted_export(engine, table))
        probe = np.concatenate([pool[:100], np.array([123, 2**64 - 2], np.uint64)])
        for missing in ("zeros", "initial"):
            a = remote.lookup("emb", probe, missing=missing)
            b = engine.lookup("emb", probe, missing=missing)
            np.testing.assert_array_equal(a.rows, b.rows, strict=True)
            np.testing.assert_array_equal(a.found, b.found, strict=True)

        # stats: the two servers' counters summed; each server holds a part of the rows
        each = []
        for server in servers:
            with RemoteServer([server.address], timeout=CALL_TIMEOUT) as one:
                each.append(one.stats("emb"))
        assert all(s["rows"] > 0 for s in each), each
        merged, expected = remote.stats("emb"), engine.stats("emb")
        for name in COUNTERS:
            assert merged[name] == expected[name] == sum(s[name] for s in each), name
        assert {name: remote.stats()[name]["rows"] for name in ("emb", "bias")} == {
            name: engine.stats(name)["rows"] for name in ("emb", "bias")
        }

        # erase and contains, then the removal log; pulls read initial vectors again
        gone = np.concatenate([pool[:60], np.array([5, 6], np.uint64)])  # 5, 6: never seen
        assert remote.erase("emb", gone) == engine.erase("emb", gone) > 0
        np.testing.assert_array_equal(
            remote.contains("emb", probe), engine.contains("emb", probe), strict=True
        )
        assert not remote.contains("emb", pool[:60]).any()
        np.testing.assert_array_equal(
            remote.pull("emb", probe, train=False), engine.pull("emb", probe, train=False)
        )
        for ps_log, engine_log in zip(
            remote.removed_log("emb"), engine.removed_log("emb"), strict=True
        ):
            np.testing.assert_array_equal(np.sort(ps_log), np.sort(engine_log), strict=True)

        # versions: advance, push more, and the delta since the cut is the same
        assert remote.version == engine.version
        cut = remote.advance_version()
        assert cut == engine.advance_version()
        assert remote.version == engine.version == cut
        keys = pool[100:180]
        grads = rng.normal(0, 1, (80, 8)).astype(np.float32)
        assert remote.push("emb", keys, grads, step=9) == engine.push("emb", keys, grads, step=9)
        delta = sorted_export(remote, "emb", since=cut - 1)
        assert_same_export(delta, sorted_export(engine, "emb", since=cut - 1))
        assert set(delta["keys"].tolist()) == set(keys.tolist())
        assert_same_export(sorted_export(remote, "emb"), sorted_export(engine, "emb"))
    finally:
        engine.close()


# -- start and stop -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "connected"),
    [(signal.SIGTERM, True), (signal.SIGINT, False)],
    ids=["SIGTERM-trainer-connected", "SIGINT-trainer-gone"],
)
def test_the_start_line_names_the_address_and_a_signal_stops_it(
    start_ps: StartPs, clients: Callable[..., RemoteServer], sig: int, connected: bool
) -> None:
    """One start line naming the address (the port it bound) and the shard
    threads, nothing else on stdout; SIGTERM or SIGINT makes the server exit
    0 within a few seconds, also while a trainer is connected (its idle data
    stream is ended, not waited for), and the port is free afterwards."""
    ps = start_ps("--threads", "3")
    assert ps.line == f"parameter server listening on grpc 127.0.0.1:{ps.port} (3 shard threads)\n"
    assert (ps.scheme, ps.threads) == ("grpc", 3)
    remote = clients([ps.address])
    remote.create_table(SPEC)
    remote.pull("emb", np.arange(10, dtype=np.uint64))  # opens the data stream
    if not connected:
        remote.close()
    code, seconds = ps.stop(sig)
    assert code == 0, ps.log_text()
    assert seconds < 3.0, seconds
    assert ps.stdout_rest == [""], "more than the start line on stdout"
    assert "parameter server stopped" in ps.log_text()
    assert "Traceback" not in ps.log_text()
    with socket.socket() as probe:  # nothing listens there any more
        assert probe.connect_ex(("127.0.0.1", ps.port)) != 0


# A process that waits for SIGTERM as ``wuliang ps`` and ``wuliang serve`` do
# (``StopSignals``), whose main thread blocks SIGTERM, so that the kernel hands
# it to another thread, as it sometimes does in a busy server (to a thread
# that is creating a thread at that moment, for one).
SIGNAL_ON_ANOTHER_THREAD = """
import signal, threading, time
from wuliang.ps_server.rpc.signals import StopSignals

stop = StopSignals()
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("waiting", flush=True)
print(stop.wait(), flush=True)
"""


def test_a_stop_signal_taken_by_another_thread_still_stops_the_server() -> None:
    """The main thread notices a SIGTERM that another thread took (a main
    thread blocked on ``threading.Event.wait()`` never did: a CI run saw a
    ``wuliang ps`` that ignored SIGTERM until it was killed)."""
    child = processes.spawn(
        [sys.executable, "-c", SIGNAL_ON_ANOTHER_THREAD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert processes.read_line(child) == "waiting\n"
        child.send_signal(signal.SIGTERM)  # the process, not its main thread
        try:
            out, err = child.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGTERM taken by another thread: no stop {STOP_TIMEOUT:g} s later")
    finally:
        processes.stop_each([child])
    assert (child.returncode, out) == (0, "SIGTERM\n"), err


# -- security ---------------------------------------------------------------------------------


def test_a_token_is_required(
    start_ps: StartPs, clients: Callable[..., RemoteServer], tmp_path: Path
) -> None:
    """With ``--token-file``: a client without the token and one with a wrong
    token are refused UNAUTHENTICATED (the unary calls and the data stream),
    and the server keeps serving a client with the token."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    ps = start_ps("--token-file", str(token_file))
    with pytest.raises(RemoteError) as refused:
        clients([ps.address])
    assert refused.value.code == "UNAUTHENTICATED"
    assert ps.address in str(refused.value) and "token" in str(refused.value)

    good = clients([ps.address], token="s3cret-token")
    good.create_table(SPEC)
    keys = np.arange(20, dtype=np.uint64)
    before = good.pull("emb", keys)

    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cre"),)):
        with grpc.insecure_channel(ps.address) as channel:
            info = channel.unary_unary(proto.method_path("Info"))
            with pytest.raises(grpc.RpcError) as error:
                info(b"", timeout=CALL_TIMEOUT, metadata=metadata)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            data = channel.stream_stream(proto.method_path("Data"))
            pull = M["DataRequest"](pull=M["PullRequest"](parts=[M["PullPart"](table="emb")]))
            with pytest.raises(grpc.RpcError) as error:
                list(data(iter([pull.SerializeToString()]), timeout=CALL_TIMEOUT,
                          metadata=metadata))  # fmt: skip
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(RemoteError) as refused:
        clients([ps.address], token="wrong-token")
    assert refused.value.code == "UNAUTHENTICATED"

    # the client with the token is still served, and nothing was changed
    np.testing.assert_array_equal(good.pull("emb", keys), before)
    good.push("emb", keys, np.ones((20, 8), np.float32))
    assert not np.array_equal(good.pull("emb", keys), before)
    assert ps.process.poll() is None


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cert.pem, key.pem), self-signed for 127.0.0.1 (as tests/test_serving_cli.py makes it)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    root = tmp_path_factory.mktemp("tls")
    key, cert = root / "key.pem", root / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls(
    start_ps: StartPs, clients: Callable[..., RemoteServer], certificate: tuple[Path, Path]
) -> None:
    """With ``--tls-cert``/``--tls-key`` the start line says ``grpc+tls``, a
    client trusting the certificate is served, and a plain client fails with
    an error naming the server (after its retry window)."""
    cert, key = certificate
    ps = start_ps("--tls-cert", str(cert), "--tls-key", str(key))
    assert ps.scheme == "grpc+tls"
    secure = clients([ps.address], tls_root=cert.read_bytes())
    secure.create_table(SPEC)
    keys = np.arange(1, 33, dtype=np.uint64)
    engine = Engine(2)
    try:
        engine.create_table(SPEC)
        grads = np.full((32, 8), 0.5, np.float32)
        assert secure.push("emb", keys, grads) == engine.push("emb", keys, grads)
        np.testing.assert_array_equal(secure.pull("emb", keys), engine.pull("emb", keys))
    finally:
        engine.close()

    start = time.monotonic()
    with pytest.raises(RemoteError) as refused:
        clients([ps.address], retry_seconds=1.0, timeout=5.0)
    assert refused.value.code == "UNAVAILABLE"
    assert ps.address in str(refused.value)
    assert time.monotonic() - start < 15
    # the TLS client is still served
    assert secure.tables() == ["emb"]


def test_servers_with_different_threads_are_refused(
    start_ps: StartPs, clients: Callable[..., RemoteServer]
) -> None:
    """A client over servers of different ``--threads`` refuses them with a
    message naming each server's thread count."""
    a, b = start_ps("--threads", "2"), start_ps("--threads", "3")
    with pytest.raises(ValueError, match="different numbers of shard threads") as refused:
        clients([a.address, b.address])
    assert f"{a.address}: 2" in str(refused.value)
    assert f"{b.address}: 3" in str(refused.value)
    assert "--threads" in str(refused.value)
    assert (a.process.poll(), b.process.poll()) == (None, None)


# -- faults ---------------------------------------------------------------------------------


def test_a_pull_waits_for_a_server_restarted_within_the_retry_window(
    start_ps: StartPs, clients: Callable[..., RemoteServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A server killed with SIGKILL: a pull issued while it is down does not
    fail while the client retries (``retry_seconds=30``), and completes with
    the right rows once a new server runs on the same port.

    The new server starts empty, as a restarted one does until the trainer
    restores a checkpoint: the test holds the client's data stream between
    two attempts (its lock) while the table is created on the new server,
    so the retried pull cannot reach it before its table exists."""
    ps = start_ps("--threads", "2")
    remote = clients([ps.address], retry_seconds=30.0, timeout=60.0)
    remote.create_table(SPEC)
    keys = np.arange(100, 164, dtype=np.uint64)
    remote.push("emb", keys, np.ones((64, 8), np.float32))
    first = remote.instances
    ps.kill()

    out = np.full((64, 8), np.nan, np.float32)
    handle = remote.pull_many_async([PullPart("emb", keys, out)], train=False)
    time.sleep(1.5)
    assert not handle.done(), "the pull gave up while the client should retry"
    stream = remote._servers[0].data
    with stream.lock:  # the data stream waits for this before its next attempt
        again = start_ps("--threads", "2", port=ps.port)
        with RemoteServer([again.address], timeout=CALL_TIMEOUT) as admin:
            admin.create_table(SPEC)
            assert admin.instances != first
        assert not handle.done()
    handle.wait(timeout=60)
    assert remote.instances != first and remote._servers[0].restarts == 1
    assert f"parameter server {ps.address} restarted empty" in caplog.text
    engine = Engine(2)
    try:
        engine.create_table(SPEC)  # a fresh table: the rows pushed before are gone
        np.testing.assert_array_equal(out, engine.pull("emb", keys, train=False), strict=True)
    finally:
        engine.close()
    # the client goes on with the new server
    remote.push("emb", keys, np.ones((64, 8), np.float32))
    assert remote.stats("emb")["rows"] == 64
    code, _ = again.stop()
    assert code == 0


def test_a_server_down_longer_than_the_retry_window_fails_the_call(
    start_ps: StartPs, clients: Callable[..., RemoteServer]
) -> None:
    """A server killed and not restarted: after ``retry_seconds`` (2 s) a
    pull (the data stream) and a unary call (stats) fail with an error
    naming the server's address, the call and the table, not sooner and not
    much later."""
    ps = start_ps("--threads", "2")
    remote = clients([ps.address], retry_seconds=2.0, timeout=30.0)
    remote.create_table(SPEC)
    keys = np.arange(8, dtype=np.uint64)
    remote.pull("emb", keys)
    ps.kill()
    for call, what in ((lambda: remote.pull("emb", keys), "pull"),
                       (lambda: remote.stats("emb"), "Stats")):  # fmt: skip
        start = time.monotonic()
        with pytest.raises(RemoteError) as failed:
            call()
        seconds = time.monotonic() - start
        assert failed.value.code == "UNAVAILABLE"
        message = str(failed.value)
        assert f"parameter server {ps.address}, {what}" in message, message
        if what == "pull":
            assert f"{what} of table 'emb'" in message, message
        assert 1.9 <= seconds < 12, seconds


def test_a_restarted_server_is_back_on_the_wall_clock(
    start_ps: StartPs, clients: Callable[..., RemoteServer]
) -> None:
    """``set_clock`` reaches every server; a server killed and started again
    comes back on the wall clock (``clock()`` then raises naming each
    server's) until the trainer sets it again, and its rows are stamped with
    the clock set. A ``SetClock`` that does not parse is refused
    INVALID_ARGUMENT, and the server goes on."""
    clock = 1_700_000_000
    servers = [start_ps("--threads", "2"), start_ps("--threads", "2")]
    remote = clients([s.address for s in servers], retry_seconds=30.0)
    assert remote.clock() is None
    remote.set_clock(clock)
    assert remote.clock() == clock
    with grpc.insecure_channel(servers[0].address) as channel:
        set_clock = channel.unary_unary(proto.method_path("SetClock"))
        with pytest.raises(grpc.RpcError) as error:
            set_clock(b"\xff\xff", timeout=CALL_TIMEOUT)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ClockMessage" in (error.value.details() or "")
    assert servers[0].process.poll() is None and remote.clock() == clock

    servers[1].kill()
    again = start_ps("--threads", "2", port=servers[1].port)
    with pytest.raises(RuntimeError, match="clocks differ") as differ:
        remote.clock()
    message = str(differ.value)
    assert f"{servers[0].address}: {clock}" in message, message
    assert f"{again.address}: wall clock" in message, message
    remote.set_clock(clock + 3600)
    assert remote.clock() == clock + 3600
    remote.create_table(SPEC)
    keys = np.arange(64, dtype=np.uint64)
    remote.push("emb", keys, np.ones((64, 8), np.float32))
    assert sorted_export(remote, "emb")["times"].tolist() == [clock + 3600] * 64


# -- pushes applied once ------------------------------------------------------------------------


def test_a_retried_push_is_applied_once(start_ps: StartPs) -> None:
    """A push of client "c", sequence number 1, sent on one Data stream and
    sent again on a second stream (as a client does whose answer was lost):
    both answers are the same, and the rows moved once (bit for bit an
    engine's after one push). The next sequence number applies again, an
    older one is refused FAILED_PRECONDITION; a push without a client id
    sent twice moves the rows twice (so the check can fail)."""
    ps = start_ps("--threads", "2")
    keys = np.array([5, 6, 2**64 - 1], np.uint64)
    grads = np.array(np.arange(24).reshape(3, 8) / 10, np.float32)

    def push(client: str, seq: int) -> Any:
        part = M["PushPart"](table="emb", keys=keys.astype("<u8").tobytes(),
                             grads=grads.astype("<f4").tobytes())  # fmt: skip
        request = M["PushRequest"](parts=[part], only="all", client=client, seq=seq)
        return M["DataRequest"](push=request).SerializeToString()

    pull = M["DataRequest"](
        pull=M["PullRequest"](parts=[M["PullPart"](table="emb", keys=keys.tobytes())])
    ).SerializeToString()

    with grpc.insecure_channel(ps.address) as channel:
        create = channel.unary_unary(proto.method_path("CreateTable"))
        create(M["Spec"](json=_spec_json(SPEC)).SerializeToString(), timeout=CALL_TIMEOUT)
        data = channel.stream_stream(proto.method_path("Data"))

        def on_a_stream(*requests: bytes) -> list[Any]:
            answers = list(data(iter(requests), timeout=CALL_TIMEOUT))
            assert len(answers) == len(requests)
            return [M["DataResponse"].FromString(a) for a in answers]

        def rows() -> np.ndarray:
            (answer,) = on_a_stream(pull)
            assert not answer.error_code, answer.error_message
            return np.frombuffer(answer.pull.rows[0], "<f4").reshape(3, 8)

        (first,) = on_a_stream(push("c", 1))
        (again,) = on_a_stream(push("c", 1))  # another stream: the first one's answer was lost
        assert not first.error_code, first.error_message
        assert first == again and first.push.applied == 3
        once = rows()
        (second,) = on_a_stream(push("c", 2))
        assert not second.error_code and second.push.applied == 3
        twice = rows()
        (old,) = on_a_stream(push("c", 1))
        assert old.error_code == "FAILED_PRECONDITION", old
        assert "older than its last push 2" in old.error_message
        on_a_stream(push("", 0), push("", 0))  # no client id: not deduplicated
        four_times = rows()

    engine = Engine(2)
    try:
        engine.create_table(SPEC)
        expected = []
        for _ in range(4):
            engine.push("emb", keys, grads)
            expected.append(engine.pull("emb", keys, train=False))
    finally:
        engine.close()
    np.testing.assert_array_equal(once, expected[0], strict=True)
    assert not np.array_equal(once, expected[1])
    np.testing.assert_array_equal(twice, expected[1], strict=True)
    np.testing.assert_array_equal(four_times, expected[3], strict=True)
    code, _ = ps.stop()
    assert code == 0


def _spec_json(spec: TableSpec) -> str:
    return json.dumps(spec.to_dict())


def test_another_spec_for_an_existing_table_is_refused(
    start_ps: StartPs, clients: Callable[..., RemoteServer]
) -> None:
    """Creating a table that exists with another spec is an error naming both
    (ALREADY_EXISTS, a ValueError on the client); the table keeps its spec."""
    ps = start_ps()
    remote = clients([ps.address])
    remote.create_table(SPEC)
    other = TableSpec("emb", 8, optimizer=SGD(0.1), seed=11)
    with pytest.raises(ValueError, match="exists with another spec") as refused:
        remote.create_table(other)
    assert "SGD" in str(refused.value) and "Adagrad" in str(refused.value)
    with RemoteServer([ps.address], timeout=CALL_TIMEOUT) as fresh:
        assert fresh.spec("emb") == SPEC


def test_a_server_with_a_disk_tier(
    start_ps: StartPs, clients: Callable[..., RemoteServer], tmp_path: Path
) -> None:
    """``wuliang ps --disk-dir D --memory-gb G``: rows beyond the budget go to
    row files under D, the answers are the embedded engine's, a client's
    prefetch reads cold rows in, and the files go with the server."""
    disk = tmp_path / "disk"
    server = start_ps("--threads", "1", "--disk-dir", str(disk), "--memory-gb", "0.0001")
    remote = clients([server.address])
    with Engine(1) as engine:
        for ps in (remote, engine):
            ps.create_table(SPEC)
        rng = np.random.default_rng(3)
        for step in range(1, 6):
            keys = rng.integers(1, 20_000, 4000, dtype=np.uint64)
            np.testing.assert_array_equal(
                remote.pull("emb", keys, step=step), engine.pull("emb", keys, step=step)
            )
            grads = rng.standard_normal((len(keys), SPEC.dim)).astype(np.float32)
            remote.push("emb", keys, grads, step=step)
            engine.push("emb", keys, grads, step=step)
        stats = remote.stats("emb")
        assert stats["cold_rows"] > 0 and stats["rows"] == engine.stats("emb")["rows"], stats
        assert any(disk.rglob("*.rows"))
        every = np.arange(1, 20_000, dtype=np.uint64)
        # the trainer's prefetch reaches the server: cold rows come in, none change
        assert remote.prefetches and not engine.prefetches
        read = remote.prefetch_many([PullPart("emb", every[::2], None)])
        after = remote.stats("emb")
        assert 0 < read <= stats["cold_rows"], (read, stats)
        assert after["cold_prefetched"] == stats["cold_prefetched"] + read, after
        assert after["cold_rows"] < stats["cold_rows"], after
        np.testing.assert_array_equal(
            remote.pull("emb", every, train=False), engine.pull("emb", every, train=False)
        )
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0
    assert not any(disk.rglob("*.rows"))
