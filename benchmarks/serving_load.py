"""Load processes for the serving benchmarks (``overload_bench.py``,
``shed_floor.py``): HTTP and gRPC calls from processes of their own, built
to spend little CPU an answer, since they share the machine's cores with
the server (``client_cpu_us`` reports what they spent).

Two kinds of load:

* **closed loop** (``conns``): that many callers, each sending its next
  request as soon as its answer comes, refused or not (no retry, no
  backoff): how most clients are written, and at most ``conns`` requests
  in the server at any moment;
* **open loop** (``rate``): requests sent on a fixed schedule, ``rate`` a
  second evenly spaced, whatever the answers: arrivals that do not slow
  down when the server does, as a fleet of independent users makes them.
  A latency counts from the request's scheduled time, so a generator that
  falls behind its schedule does not hide the server's queue (no
  coordinated omission); ``late_sends`` counts requests sent more than
  ``LATE_S`` after their time and ``behind_ms`` the most any was.

Transports:

* ``http``: ``POST`` on keep-alive connections driven like wrk
  (non-blocking sockets, ``selectors``, request bytes prebuilt, only the
  status line, ``Content-Length`` and the body read). The open loop sends
  each request on an idle connection, opening another (up to
  ``MAX_HTTP_CONNS``, ``PREOPEN`` of them before the start) when none is
  idle: HTTP/1.1 has one request a connection at a time;
* ``grpc``: raw unary calls of a method (serialized requests, answers left
  as bytes: grpcio's ``unary_unary`` with no (de)serializers; not
  ``wuliang.serving.Client``, whose retries would hide answers) on
  ``CHANNELS`` channels (each its own TCP connection), each call a
  ``.future()``: a closed-loop caller's done callback issues its next
  call, the open loop issues calls from one thread on schedule.

An answer is *accepted* (HTTP 200, gRPC OK), *shed* (HTTP 503, gRPC
RESOURCE_EXHAUSTED; those without ``Retry-After`` or
``grpc-retry-pushback-ms`` are counted apart) or *failed*, by kind: any
other status (``http 500``, ``DEADLINE_EXCEEDED`` ...), an answer later
than ``TIMEOUT_S``, a refused or reset connection. Answers count toward a
rate when they come within the window; those still due at its end are
waited for (up to ``TIMEOUT_S``) and count toward latencies and failures.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from array import array
from collections import Counter
from typing import Any

import numpy as np

TIMEOUT_S = 2.0  # an answer later than this is a failure
LATE_S = 0.001  # an open-loop request sent later than this after its time is late
START_MARGIN_S = 0.5  # load processes get a job this long before it starts
CHANNELS = 4  # gRPC channels of a load process
PREOPEN = 64  # HTTP connections an open loop opens before it starts
MAX_HTTP_CONNS = 4096  # the most an open loop opens


class Tally:
    """One load process's answers: latencies (seconds) by kind, failures by
    reason, what came before the window's end, and the open loop's sends."""

    def __init__(self) -> None:
        self.accepted = array("d")
        self.shed = array("d")
        self.accepted_at = array("d")  # when each was due or sent (time.monotonic())
        self.shed_at = array("d")
        self.failures: Counter[str] = Counter()
        self.in_window: Counter[str] = Counter()
        self.shed_without_retry = 0
        self.sent = 0
        self.late_sends = 0
        self.behind = 0.0

    def answer(self, kind: str, latency: float, in_window: bool, reason: str = "") -> None:
        if kind == "accepted":
            self.accepted.append(latency)
            self.accepted_at.append(time.monotonic() - latency)
        elif kind == "shed":
            self.shed.append(latency)
            self.shed_at.append(time.monotonic() - latency)
        else:
            self.failures[reason] += 1
        if in_window:
            self.in_window[kind] += 1

    def sent_at(self, behind: float) -> None:
        """An open-loop request sent ``behind`` seconds after its time."""
        self.sent += 1
        if behind > LATE_S:
            self.late_sends += 1
        self.behind = max(self.behind, behind)

    def result(self, cpu_s: float) -> dict[str, Any]:
        return {
            "accepted": base64.b64encode(self.accepted.tobytes()).decode(),
            "shed": base64.b64encode(self.shed.tobytes()).decode(),
            "accepted_at": base64.b64encode(self.accepted_at.tobytes()).decode(),
            "shed_at": base64.b64encode(self.shed_at.tobytes()).decode(),
            "failures": dict(self.failures),
            "accepted_in_window": self.in_window["accepted"],
            "shed_in_window": self.in_window["shed"],
            "shed_without_retry": self.shed_without_retry,
            "sent": self.sent,
            "late_sends": self.late_sends,
            "behind_ms": round(self.behind * 1e3, 3),
            "cpu_s": cpu_s,
        }


def schedule(start_at: float, seconds: float, rate: float) -> np.ndarray:
    """An open loop's send times: ``rate`` a second, evenly spaced."""
    return start_at + np.arange(int(seconds * rate)) / rate


# -- HTTP -----------------------------------------------------------------------------


class _HttpConn:
    __slots__ = ("buf", "busy_since", "connecting", "pending", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.busy_since = 0.0  # when its request was due (open) or sent (closed); 0: idle
        self.connecting = True
        self.pending: bytes | None = None  # to send once connected


def http_load(job: dict[str, Any], payloads: list[bytes]) -> dict[str, Any]:
    """The job's HTTP load (see the module docstring)."""
    port, path = job["port"], job["target"]
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    )
    requests = [head.format(len(b)).encode() + b for b in payloads]
    start_at, end = job["start_at"], job["start_at"] + job["seconds"]
    open_loop = job.get("rate") is not None
    times = schedule(start_at, job["seconds"], job["rate"]) if open_loop else None
    sel = selectors.DefaultSelector()
    idle: list[_HttpConn] = []
    conns: set[_HttpConn] = set()
    tally = Tally()
    n = job["first"]

    def connect() -> _HttpConn:  # non-blocking: a full backlog must not stall the others
        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        conn = _HttpConn(sock)
        conn.busy_since = time.monotonic()  # the connect's own deadline
        conns.add(conn)
        sel.register(sock, selectors.EVENT_WRITE, conn)
        return conn

    def close(conn: _HttpConn) -> None:
        sel.unregister(conn.sock)
        conn.sock.close()
        conns.discard(conn)
        with contextlib.suppress(ValueError):
            idle.remove(conn)

    def send(conn: _HttpConn, due: float) -> None:
        nonlocal n
        request = requests[n % len(requests)]
        n += 1
        conn.busy_since = due
        if conn.connecting:
            conn.pending = request
            return
        try:  # one request in flight: the socket's buffer is empty
            if conn.sock.send(request) != len(request):
                raise OSError("short send")
        except OSError as error:
            fail(conn, type(error).__name__)

    def fail(conn: _HttpConn, reason: str) -> None:
        now = time.monotonic()
        tally.answer("failed", now - conn.busy_since, now <= end, reason)
        close(conn)
        if not open_loop and now < end:
            send(connect(), now)

    def answered(conn: _HttpConn) -> None:
        """A whole answer is in ``conn.buf``: tallied; the connection goes on."""
        buf = conn.buf
        header_end = buf.find(b"\r\n\r\n")
        header = bytes(buf[:header_end]).lower()
        now = time.monotonic()
        status = int(buf[9:12])
        if status == 200:
            tally.answer("accepted", now - conn.busy_since, now <= end)
        elif status == 503:
            tally.answer("shed", now - conn.busy_since, now <= end)
            if b"\r\nretry-after:" not in header:
                tally.shed_without_retry += 1
        else:
            tally.answer("failed", now - conn.busy_since, now <= end, f"http {status}")
        conn.busy_since = 0.0
        buf.clear()
        if b"\r\nconnection: close" in header:
            close(conn)
            if not open_loop and now < end:
                send(connect(), now)
        elif open_loop:
            idle.append(conn)
        elif now < end:
            send(conn, now)

    def read(conn: _HttpConn) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as error:
            fail(conn, type(error).__name__)
            return
        if not data:
            if conn.busy_since:
                fail(conn, "closed")
            else:
                close(conn)
            return
        buf = conn.buf
        buf += data
        header_end = buf.find(b"\r\n\r\n")
        if header_end < 0:
            return
        header = bytes(buf[:header_end]).lower()
        at = header.find(b"\r\ncontent-length:")
        if at < 0:
            fail(conn, "no content-length")
            return
        stop = header.find(b"\r\n", at + 2)
        length = int(header[at + 17 : stop if stop >= 0 else None])
        if len(buf) >= header_end + 4 + length:
            answered(conn)

    def connected(conn: _HttpConn) -> None:
        error = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            fail(conn, f"connect: {os.strerror(error)}")
            return
        conn.connecting = False
        sel.modify(conn.sock, selectors.EVENT_READ, conn)
        if conn.pending is not None:
            request, conn.pending = conn.pending, None
            try:
                if conn.sock.send(request) != len(request):
                    raise OSError("short send")
            except OSError as error:
                fail(conn, type(error).__name__)
        elif open_loop:
            conn.busy_since = 0.0
            idle.append(conn)

    def poll(timeout: float) -> None:
        for key, _ in sel.select(timeout):
            conn = key.data
            if conn not in conns:
                continue
            if conn.connecting:
                connected(conn)
            else:
                read(conn)

    opening = PREOPEN if open_loop else job["conns"]
    for _ in range(opening):
        connect()
    while time.monotonic() < start_at:  # connected before the start
        poll(max(0.0, start_at - time.monotonic()))
    if any(c.connecting for c in conns):
        raise OSError(f"cannot connect to port {port}")
    cpu0 = time.process_time()
    if not open_loop:
        for conn in list(conns):
            send(conn, time.monotonic())
    k = 0
    last_scan = time.monotonic()
    while True:
        now = time.monotonic()
        if times is not None:
            while k < len(times) and times[k] <= now:
                due = float(times[k])
                k += 1
                if idle:
                    conn = idle.pop()
                elif len(conns) < MAX_HTTP_CONNS:
                    conn = connect()
                else:
                    tally.answer("failed", 0.0, True, "generator: no connection")
                    continue
                tally.sent_at(now - due)
                send(conn, due)
            wait = 0.05 if k >= len(times) else min(0.05, max(0.0, times[k] - now))
        else:
            wait = 0.05
        poll(wait)
        now = time.monotonic()
        if now - last_scan > 0.05:
            last_scan = now
            for conn in list(conns):
                if conn.busy_since and now - conn.busy_since > TIMEOUT_S:
                    fail(conn, "timeout" if not conn.connecting else "connect timeout")
            done_sending = times is None or k >= len(times)
            if now >= end and done_sending and not any(c.busy_since for c in conns):
                break
            if now > end + TIMEOUT_S + 1:
                break
    cpu = time.process_time() - cpu0
    for conn in list(conns):
        close(conn)
    sel.close()
    return tally.result(cpu)


# -- gRPC -----------------------------------------------------------------------------


def grpc_load(job: dict[str, Any], payloads: list[bytes]) -> dict[str, Any]:
    """The job's gRPC load (see the module docstring)."""
    import grpc

    port, method = job["port"], job["target"]
    channels = [
        grpc.insecure_channel(
            f"127.0.0.1:{port}",
            # a channel of its own: its own TCP connection, not a shared subchannel
            options=[
                ("grpc.use_local_subchannel_pool", 1),
                ("wuliang.bench.channel", c),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        for c in range(CHANNELS)
    ]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    calls = [channel.unary_unary(method) for channel in channels]  # bytes in, bytes out
    tally = Tally()
    lock = threading.Lock()
    finished = threading.Event()
    start_at, end = job["start_at"], job["start_at"] + job["seconds"]
    open_loop = job.get("rate") is not None
    ok, shed = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
    n = job["first"]
    outstanding = 0
    issuing = True  # the open loop's sender has not finished

    def issue(slot: int, due: float) -> None:
        nonlocal n, outstanding
        with lock:
            request = payloads[n % len(payloads)]
            n += 1
            outstanding += 1
        try:
            future = calls[slot % len(calls)].future(request, timeout=TIMEOUT_S)
        except Exception as error:
            with lock:
                outstanding -= 1
                tally.answer("failed", 0.0, True, type(error).__name__)
            return
        future.add_done_callback(lambda f: done(f, slot, due))

    def done(future: Any, slot: int, due: float) -> None:
        nonlocal outstanding
        now = time.monotonic()
        reason = ""
        try:
            code = future.code()
            hint = None
            if code == shed:
                hint = dict(future.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        except Exception as error:  # never lose a caller of the loop
            code, reason = None, type(error).__name__
        with lock:
            if code == ok:
                tally.answer("accepted", now - due, now <= end)
            elif code == shed:
                tally.answer("shed", now - due, now <= end)
                tally.shed_without_retry += hint is None
            else:
                tally.answer("failed", now - due, now <= end, code.name if code else reason)
        if not open_loop and now < end:
            issue(slot, now)  # the caller's next call
        with lock:
            outstanding -= 1
            if outstanding == 0 and not issuing:
                finished.set()

    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu0 = time.process_time()
    if open_loop:
        times = schedule(start_at, job["seconds"], job["rate"])
        for k, due in enumerate(times.tolist()):
            now = time.monotonic()
            if due > now + 0.0002:
                time.sleep(due - now)
                now = time.monotonic()
            with lock:
                tally.sent_at(now - due)
            issue(k, due)
    else:
        for slot in range(job["conns"]):
            issue(slot, time.monotonic())
    with lock:
        issuing = False
        if outstanding == 0:
            finished.set()
    if not finished.wait(max(0.0, end - time.monotonic()) + TIMEOUT_S + 10):
        with lock:
            tally.failures["never answered"] += outstanding
    cpu = time.process_time() - cpu0
    for channel in channels:
        channel.close()
    with lock:
        return tally.result(cpu)


# -- the processes --------------------------------------------------------------------


def load_worker() -> None:
    """A load process: a job (JSON) a line on stdin, its result a line on stdout."""
    payloads: dict[str, list[bytes]] = {}
    for line in sys.stdin.buffer:
        job = json.loads(line)
        if "payloads" in job:  # sent once per payload set, then named
            payloads[job["name"]] = [base64.b64decode(p) for p in job["payloads"]]
            continue
        load = http_load if job["transport"] == "http" else grpc_load
        try:
            result = load(job, payloads[job["name"]])
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.buffer.write(json.dumps(result).encode() + b"\n")
        sys.stdout.buffer.flush()


class LoadProcess:
    """A started load process (``load_worker``), its answers read with deadlines."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--load-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.buffer = b""
        self.named: set[str] = set()

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()

    def payloads(self, name: str, payloads: list[str]) -> None:
        """Sends a set of requests (base64) once, to be named by jobs."""
        if name not in self.named:
            self.send({"name": name, "payloads": payloads})
            self.named.add(name)

    def poll(self) -> dict[str, Any] | None:
        """The result, once a whole line has come (call when readable)."""
        assert self.proc.stdout is not None
        data = os.read(self.proc.stdout.fileno(), 1 << 20)
        if not data:
            raise RuntimeError(f"a load process ended (exit code {self.proc.poll()})")
        self.buffer += data
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        result = json.loads(line)
        if "error" in result:
            raise RuntimeError(f"a load process failed: {result['error']}")
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def run_load(
    procs: list[LoadProcess],
    transport: str,
    port: int,
    target: str,
    payloads: tuple[str, list[str]],
    seconds: float,
    server_pid: int,
    conns: int | None = None,
    rate: float | None = None,
) -> dict[str, Any]:
    """One load, closed (``conns`` callers) or open (``rate`` a second),
    shared among the load processes: the answers merged, the server's CPU
    and its RSS (sampled meanwhile) beside them. ``payloads``: (a name, the
    requests in base64)."""
    from serving_setup import cpu_seconds, rss_mb

    if (conns is None) == (rate is None):
        raise ValueError("a load is closed (conns) or open (rate)")
    used = procs[: min(len(procs), conns)] if conns is not None else procs
    start_at = time.monotonic() + START_MARGIN_S
    name, requests = payloads
    for k, proc in enumerate(used):
        proc.payloads(name, requests)
        job: dict[str, Any] = {
            "transport": transport,
            "port": port,
            "target": target,
            "name": name,
            "start_at": start_at,
            "seconds": seconds,
            "first": k * 1000,
        }
        if conns is not None:
            job["conns"] = conns // len(used) + (k < conns % len(used))
        else:
            job["rate"] = rate / len(used)
        proc.send(job)
    server_cpu0 = cpu_seconds(server_pid)
    rss_max = 0.0
    results: dict[int, dict[str, Any]] = {}
    deadline = start_at + seconds + TIMEOUT_S + 60
    with selectors.DefaultSelector() as sel:
        for k, proc in enumerate(used):
            assert proc.proc.stdout is not None
            sel.register(proc.proc.stdout, selectors.EVENT_READ, k)
        while len(results) < len(used):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {transport} load on {target} did not end")
            for key, _ in sel.select(0.1):
                result = used[key.data].poll()
                if result is not None:
                    results[key.data] = result
                    sel.unregister(key.fileobj)
            if time.monotonic() >= start_at:
                rss_max = max(rss_max, rss_mb(server_pid))
    server_cpu = cpu_seconds(server_pid) - server_cpu0
    parts = list(results.values())
    failures: Counter[str] = Counter()
    for p in parts:
        failures.update(p["failures"])
    return {
        "conns": conns,
        "rate": rate,
        "seconds": seconds,
        "accepted": np.concatenate([np.frombuffer(base64.b64decode(p["accepted"])) for p in parts]),
        "shed": np.concatenate([np.frombuffer(base64.b64decode(p["shed"])) for p in parts]),
        "accepted_at": np.concatenate(
            [np.frombuffer(base64.b64decode(p["accepted_at"])) for p in parts]
        )
        - start_at,
        "shed_at": np.concatenate([np.frombuffer(base64.b64decode(p["shed_at"])) for p in parts])
        - start_at,
        "failures": failures,
        "accepted_in_window": sum(p["accepted_in_window"] for p in parts),
        "shed_in_window": sum(p["shed_in_window"] for p in parts),
        "shed_without_retry": sum(p["shed_without_retry"] for p in parts),
        "sent": sum(p["sent"] for p in parts),
        "late_sends": sum(p["late_sends"] for p in parts),
        "behind_ms": max(p["behind_ms"] for p in parts),
        "client_cpu_s": sum(p["cpu_s"] for p in parts),
        "server_cpu_s": server_cpu,
        "rss_max_mb": rss_max,
        "rss_end_mb": rss_mb(server_pid),
    }


def ms(latencies: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(latencies, q)) * 1e3, 3) if len(latencies) else None


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one load over its rounds: rates and latencies of
    accepted and of shed answers, failures by kind, CPU per answer."""
    seconds = sum(r["seconds"] for r in runs)
    accepted = np.concatenate([r["accepted"] for r in runs])
    shed = np.concatenate([r["shed"] for r in runs])
    failures: Counter[str] = Counter()
    for r in runs:
        failures.update(r["failures"])
    answers = len(accepted) + len(shed) + sum(failures.values())
    out = {
        "conns": runs[0]["conns"],
        "rate": runs[0]["rate"],
        "accepted_qps": round(sum(r["accepted_in_window"] for r in runs) / seconds, 1),
        "shed_qps": round(sum(r["shed_in_window"] for r in runs) / seconds, 1),
        "accepted_p50_ms": ms(accepted, 50),
        "accepted_p99_ms": ms(accepted, 99),
        "shed_p50_ms": ms(shed, 50),
        "shed_p99_ms": ms(shed, 99),
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "shed_without_retry": sum(r["shed_without_retry"] for r in runs),
        "server_cpu_us": round(sum(r["server_cpu_s"] for r in runs) / max(answers, 1) * 1e6, 1),
        "client_cpu_us": round(sum(r["client_cpu_s"] for r in runs) / max(answers, 1) * 1e6, 1),
    }
    if runs[0]["rate"] is not None:
        out["offered_qps"] = round(sum(r["sent"] for r in runs) / seconds, 1)
        out["late_sends"] = sum(r["late_sends"] for r in runs)
        out["behind_ms"] = max(r["behind_ms"] for r in runs)
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--load-worker"]:
        load_worker()
    else:
        sys.exit("serving_load.py is started by the serving benchmarks (--load-worker)")
