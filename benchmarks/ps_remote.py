"""Remote parameter servers vs the embedded engine vs grpcio's floor
(``python benchmarks/ps_bench.py --remote``).

One table (``--rows`` rows, dim 16, Adagrad) is pulled and pushed in
training-sized batches of ``--batch`` unique keys (55K by default, what a
4096-sample Criteo-shaped batch has) through:

* ``embedded``: the engine in this process (``parameter_server("embedded")``,
  2 shard threads);
* ``remote1`` / ``remote2``: ``RemoteServer`` over 1 and 2 ``wuliang ps``
  processes (2 shard threads each) on loopback;
* ``floor1`` / ``floor2``: grpcio's own floor for the same messages: bare
  grpcio servers (one process each, the same sync server and pool size as
  ``wuliang ps``) whose handler answers bytes of a pull answer's size (or a
  push answer's) for a request of the keys' (and gradients') size, called
  with one concurrent unary call per server per batch; the requests are
  built before the clock starts, so the floor has no routing, no protobuf
  and no engine.

Pulls are training pulls (rows are created on first sight; the table is
filled before timing), pushes apply Adagrad to unique keys. Each batch's
keys come grouped as a trainer's key preparer groups them for that
parameter server (by shard, or by (server, shard) cell), with their
offsets, as the session passes them. Phases
alternate in rounds (ABCDE, EDCBA, ...) so that a slow spell of the machine
weighs on all; each phase's figure is its best round. Client and server
CPU seconds per batch are read from ``/proc`` (the servers') and
``time.process_time`` (this process), and two batch sizes through one
server give the per-call and per-key costs that ``docs/remote.md`` models
throughput over servers on separate machines with. The last line printed
is one JSON object.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

DIM = 16
FLOOR_METHOD = "/wuliang.bench.Floor/Call"
PULL_ANSWER_PER_KEY = 4 * DIM  # float32 rows
PUSH_REQUEST_PER_KEY = 8 + 4 * DIM  # keys and float32 gradients
LISTENING = re.compile(r"listening on grpc (\S+):(\d+)")


# -- processes -------------------------------------------------------------------------


class PsProcess:
    """One ``wuliang ps`` process on a free loopback port (``start``), its
    address once it has printed its listening line, its CPU time."""

    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc, self.address, self.pid = proc, address, proc.pid

    @staticmethod
    def start(threads: int = 2, timeout: float = 60.0) -> PsProcess:
        proc = subprocess.Popen(
            [sys.executable, "-m", "wuliang", "ps", "--port", "0", "--threads", str(threads)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        match = LISTENING.search(box[0]) if box else None
        if match is None:
            proc.kill()
            proc.wait(timeout=10)
            raise RuntimeError(f"wuliang ps did not start in {timeout:g} s: {box[:1]!r}")
        return PsProcess(proc, f"127.0.0.1:{match[2]}")

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    """CPU time of all of a process's threads (``schedstat``: nanoseconds)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return total / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def floor_server(port: int, max_bytes: int, ready: Any, engine_shards: int = 0) -> None:
    """A bare grpcio server. Without an engine it answers ``len(request) *
    ratio`` zero bytes, the ratio in the request's first byte (8 for a pull
    of dim 16: keys in, rows out; 0 for a push: an empty answer). With
    ``engine_shards`` it holds an engine of that many shards with the
    benchmark's table: a request is the shard offsets (int64 [shards + 1]),
    the keys, and for a push the gradients; a pull answers the rows' bytes
    (``engine.pull(...).tobytes()``), a push nothing."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    zeros = b"\0" * max_bytes

    def answer(request: bytes, context: Any) -> bytes:
        return zeros[: (len(request) - 1) * request[0]]

    if engine_shards:
        from wuliang.ps_server import Adagrad, Engine, TableSpec

        engine = Engine(engine_shards)
        engine.create_table(TableSpec("bench", DIM, optimizer=Adagrad(learning_rate=0.05)))
        head = 8 * (engine_shards + 1)

        def answer(request: bytes, context: Any) -> bytes:
            offsets = np.frombuffer(request, np.int64, engine_shards + 1)
            n = int(offsets[-1])
            keys = np.frombuffer(request, np.uint64, n, head)
            if len(request) == head + 8 * n:  # a pull
                return engine.pull("bench", keys, shard_offsets=offsets).tobytes()
            grads = np.frombuffer(request, np.float32, n * DIM, head + 8 * n).reshape(n, DIM)
            engine.push("bench", keys, grads, unique=True, shard_offsets=offsets)
            return b""

    server = grpc.server(
        ThreadPoolExecutor(16),
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
        ],
    )
    handler = grpc.unary_unary_rpc_method_handler(answer)
    service, method = FLOOR_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def start_floor(n: int, max_bytes: int, engine_shards: int = 0) -> tuple[list[Any], list[str]]:
    ctx = mp.get_context("spawn")
    procs, addresses = [], []
    for _ in range(n):
        port, ready = free_port(), ctx.Event()
        child = ctx.Process(
            target=floor_server, args=(port, max_bytes, ready, engine_shards), daemon=True
        )
        child.start()
        procs.append(child)
        if not ready.wait(60):
            raise RuntimeError("a grpcio floor server did not start")
        addresses.append(f"127.0.0.1:{port}")
    return procs, addresses


# -- phases ----------------------------------------------------------------------------


class Phase:
    """Something pulled and pushed batch by batch: ``pull(i)``, ``push(i)``,
    the processes whose CPU time is its servers'."""

    def __init__(
        self,
        name: str,
        pull: Callable[[int], None],
        push: Callable[[int], None],
        server_pids: list[int],
        wire: Callable[[], int] | None = None,
    ) -> None:
        self.name, self.pull, self.push, self.server_pids = name, pull, push, server_pids
        self.wire = wire


def measure(phase: Phase, call: str, batches: int, keys_per_batch: int) -> dict[str, float]:
    """One pass over the batches: keys/s, client and server CPU s per batch,
    wire bytes per key."""
    fn = phase.pull if call == "pull" else phase.push
    servers0 = sum(cpu_seconds(p) for p in phase.server_pids)
    wire0 = phase.wire() if phase.wire else 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(batches):
        fn(i)
    elapsed = time.perf_counter() - t0
    client = time.process_time() - cpu0
    servers = sum(cpu_seconds(p) for p in phase.server_pids) - servers0
    keys = batches * keys_per_batch
    out = {
        "keys_per_s": keys / elapsed,
        "client_cpu_per_batch": client / batches,
        "server_cpu_per_batch": servers / batches,
        "seconds_per_batch": elapsed / batches,
    }
    if phase.wire:
        out["wire_bytes_per_key"] = (phase.wire() - wire0) / keys
    return out


def grouped(keys: np.ndarray, ps: Any) -> tuple[np.ndarray, np.ndarray]:
    """The keys as a trainer's key preparer hands them to ``ps``: grouped by
    (server, shard) cell, with their offsets."""
    from wuliang.reader import Csr, CsrBatch, KeyPreparer

    batch = CsrBatch(
        {"k": Csr(keys, np.array([0, len(keys)], np.int64))}, np.zeros((1, 0), np.float32), None, 1
    )
    preparer = KeyPreparer({"k": "bench"}, ps.num_shards, num_servers=ps.num_servers)
    table = preparer(batch).tables["bench"]
    return table.uniques, table.shard_offsets


def ps_phase(name: str, ps: Any, batches: list[np.ndarray], pids: list[int]) -> Phase:
    prepared = [grouped(keys, ps) for keys in batches]
    out = np.empty((len(batches[0]), DIM), np.float32)
    grads = np.random.default_rng(1).standard_normal(out.shape, dtype=np.float32) * 0.01

    def wire() -> int:
        counts = ps.data_bytes()
        return counts["sent"] + counts["received"]

    def pull(i: int) -> None:
        keys, offsets = prepared[i]
        ps.pull("bench", keys, out=out, shard_offsets=offsets)

    def push(i: int) -> None:
        keys, offsets = prepared[i]
        ps.push("bench", keys, grads, unique=True, shard_offsets=offsets)

    return Phase(name, pull, push, pids, wire if hasattr(ps, "data_bytes") else None)


def floor_phase(
    name: str, addresses: list[str], pids: list[int], batches: list[np.ndarray], max_bytes: int
) -> Phase:
    import grpc

    from wuliang.ps_server.routing import server_of

    options = [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]
    channels = [grpc.insecure_channel(a, options=options) for a in addresses]
    stubs = [c.unary_unary(FLOOR_METHOD) for c in channels]
    n = len(addresses)
    pulls, pushes = [], []
    for keys in batches:  # each server's share of the keys, as bytes of the same sizes
        share = np.bincount(server_of(keys, n), minlength=n) if n > 1 else [len(keys)]
        pulls.append([bytes([PULL_ANSWER_PER_KEY // 8]) + b"\1" * (8 * k) for k in share])
        pushes.append([b"\0" + b"\1" * (PUSH_REQUEST_PER_KEY * k) for k in share])

    def call(requests: list[bytes]) -> None:
        futures = [stub.future(r, timeout=60) for stub, r in zip(stubs, requests, strict=True)]
        for f in futures:
            f.result()

    return Phase(name, lambda i: call(pulls[i]), lambda i: call(pushes[i]), pids)


def engine_floor_phase(
    name: str,
    addresses: list[str],
    pids: list[int],
    batches: list[np.ndarray],
    max_bytes: int,
    shards: int,
    rows: int,
) -> Phase:
    """The engine-holding floor servers: raw bytes, unary calls, the keys
    grouped by (server, shard) as for ``RemoteServer``; filled first."""
    import grpc

    options = [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]
    n = len(addresses)
    layout = Layout(shards, n)
    stubs = [grpc.insecure_channel(a, options=options).unary_unary(FLOOR_METHOD) for a in addresses]

    def requests(keys: np.ndarray, grads: np.ndarray | None = None) -> list[bytes]:
        uniques, offsets = grouped(keys, layout)
        out = []
        for j in range(n):
            cells = offsets[j * shards : (j + 1) * shards + 1]
            part = [(cells - cells[0]).astype(np.int64), uniques[cells[0] : cells[-1]]]
            if grads is not None:
                part.append(np.ascontiguousarray(grads[: cells[-1] - cells[0]]))
            out.append(b"".join(part))
        return out

    def call(batch: list[bytes]) -> None:
        futures = [stub.future(r, timeout=60) for stub, r in zip(stubs, batch, strict=True)]
        for f in futures:
            f.result()

    step = 1 << 18
    for start in range(0, rows, step):
        call(requests(table_keys(np.arange(start, min(rows, start + step)))))
    grads = np.random.default_rng(1).standard_normal((len(batches[0]), DIM), np.float32) * 0.01
    pulls = [requests(keys) for keys in batches]
    pushes = [requests(keys, grads) for keys in batches]
    return Phase(name, lambda i: call(pulls[i]), lambda i: call(pushes[i]), pids)


@dataclass
class Layout:
    """Shards per server and servers, as ``grouped`` reads them off a ps."""

    num_shards: int
    num_servers: int


def fill(ps: Any, rows: int) -> None:
    """Creates every row of the table (training pulls of all keys)."""
    step = 1 << 18
    for start in range(0, rows, step):
        ps.pull("bench", table_keys(np.arange(start, min(rows, start + step))))


def table_keys(index: np.ndarray) -> np.ndarray:
    return index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def unique_batches(rows: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [table_keys(rng.choice(rows, size=batch, replace=False)) for _ in range(count)]


# -- the run ---------------------------------------------------------------------------


def run(args: Any) -> dict[str, Any]:
    from wuliang.ps_server import Adagrad, TableSpec, parameter_server

    spec = TableSpec("bench", DIM, optimizer=Adagrad(learning_rate=0.05))
    batches = unique_batches(args.rows, args.batch, args.batches, seed=0)
    small = [b[: args.batch // 10] for b in batches]
    max_bytes = 64 << 20
    print(
        f"remote: {args.rows:,} rows, dim {DIM}, Adagrad; {args.batches} batches of "
        f"{args.batch:,} unique keys; {args.rounds} rounds",
        flush=True,
    )
    servers: list[PsProcess] = []
    floors: list[Any] = []
    clients: list[Any] = []
    try:
        servers = [PsProcess.start(args.server_threads) for _ in range(3)]
        one, two = servers[:1], servers[1:]
        floors, floor_addr = start_floor(3, max_bytes)
        engine_floors, engine_addr = start_floor(2, max_bytes, engine_shards=2)
        floors += engine_floors
        embedded = parameter_server("embedded", num_shards=2)
        remote1 = parameter_server([s.address for s in one])
        remote2 = parameter_server([s.address for s in two])
        clients = [embedded, remote1, remote2]
        for ps in clients:
            ps.create_table(spec)
            fill(ps, args.rows)
        phases = [
            ps_phase("embedded", embedded, batches, []),
            ps_phase("remote1", remote1, batches, [p.pid for p in one]),
            ps_phase("remote2", remote2, batches, [p.pid for p in two]),
            floor_phase("floor1", floor_addr[:1], [floors[0].pid], batches, max_bytes),
            floor_phase("floor2", floor_addr[1:], [f.pid for f in floors[1:3]], batches, max_bytes),
            ps_phase("remote1_small", remote1, small, [p.pid for p in one]),
            engine_floor_phase(
                "engine_floor2",
                engine_addr,
                [f.pid for f in engine_floors],
                batches,
                max_bytes,
                shards=2,
                rows=args.rows,
            ),
        ]
        best: dict[tuple[str, str], dict[str, float]] = {}
        for r in range(args.rounds):
            order = phases if r % 2 == 0 else phases[::-1]
            for phase in order:
                size = len(small[0]) if phase.name.endswith("_small") else args.batch
                for call in ("pull", "push"):
                    got = measure(phase, call, args.batches, size)
                    key = (phase.name, call)
                    if key not in best or got["keys_per_s"] > best[key]["keys_per_s"]:
                        best[key] = got
            print(
                f"round {r + 1}: "
                + " | ".join(
                    f"{p.name} pull {best[(p.name, 'pull')]['keys_per_s'] / 1e6:.2f}M "
                    f"push {best[(p.name, 'push')]['keys_per_s'] / 1e6:.2f}M"
                    for p in phases
                )
                + " keys/s (best so far)",
                flush=True,
            )
    finally:
        for ps in clients:
            ps.close()
        for server in servers:
            server.stop()
        for floor in floors:
            floor.kill()
    return summarize(best, args)


def summarize(best: dict[tuple[str, str], dict[str, float]], args: Any) -> dict[str, Any]:
    def rate(name: str, call: str = "pull") -> float:
        return best[(name, call)]["keys_per_s"]

    costs = per_call_costs(best, args.batch)
    result: dict[str, Any] = {
        "rows": args.rows,
        "dim": DIM,
        "batch_unique_keys": args.batch,
        "embedded_pull_keys_per_s": round(rate("embedded")),
        "embedded_push_keys_per_s": round(rate("embedded", "push")),
        "remote_pull_keys_per_s": round(rate("remote2")),
        "remote_push_keys_per_s": round(rate("remote2", "push")),
        "remote1_pull_keys_per_s": round(rate("remote1")),
        "remote1_push_keys_per_s": round(rate("remote1", "push")),
        "remote_to_embedded_pull_ratio": round(rate("remote2") / rate("embedded"), 3),
        "remote_to_embedded_push_ratio": round(
            rate("remote2", "push") / rate("embedded", "push"), 3
        ),
        "remote_bytes_per_key": round(best[("remote2", "pull")]["wire_bytes_per_key"], 1),
        "remote_push_bytes_per_key": round(best[("remote2", "push")]["wire_bytes_per_key"], 1),
        "grpc_floor_keys_per_s": round(rate("floor2")),
        "grpc_floor1_keys_per_s": round(rate("floor1")),
        "grpc_floor_push_keys_per_s": round(rate("floor2", "push")),
        "remote_vs_floor": round(rate("remote2") / rate("floor2"), 3),
        "remote1_vs_floor1": round(rate("remote1") / rate("floor1"), 3),
        "remote_push_vs_floor": round(rate("remote2", "push") / rate("floor2", "push"), 3),
        "grpc_engine_floor_keys_per_s": round(rate("engine_floor2")),
        "grpc_engine_floor_push_keys_per_s": round(rate("engine_floor2", "push")),
        "remote_vs_engine_floor": round(rate("remote2") / rate("engine_floor2"), 3),
        "remote_push_vs_engine_floor": round(
            rate("remote2", "push") / rate("engine_floor2", "push"), 3
        ),
        **costs,
        "pull_cpu_ms_per_batch": {
            name: {
                side: round(1e3 * best[(name, "pull")][f"{side}_cpu_per_batch"], 2)
                for side in ("client", "server")
            }
            for name, _ in best
        },
    }
    return result


def per_call_costs(best: dict[tuple[str, str], dict[str, float]], batch: int) -> dict[str, float]:
    """Client and server CPU microseconds per call and per key of a pull,
    from one server's big and small batches (a line through two points)."""
    big, small = best[("remote1", "pull")], best[("remote1_small", "pull")]
    n_big, n_small = batch, batch // 10
    out = {}
    for side in ("client", "server"):
        a, b = small[f"{side}_cpu_per_batch"], big[f"{side}_cpu_per_batch"]
        per_key = (b - a) / (n_big - n_small)
        out[f"pull_{side}_us_per_call"] = round(max(0.0, a - per_key * n_small) * 1e6, 1)
        out[f"pull_{side}_ns_per_key"] = round(per_key * 1e9, 2)
    out["pull_seconds_per_batch_1_server"] = round(big["seconds_per_batch"], 5)
    out["pull_seconds_per_batch_2_servers"] = round(
        best[("remote2", "pull")]["seconds_per_batch"], 5
    )
    for name in ("remote1", "remote2"):
        b = best[(name, "pull")]
        out[f"{name}_pull_cpu_per_batch"] = round(
            b["client_cpu_per_batch"] + b["server_cpu_per_batch"], 5
        )
    return out


def main(args: Any) -> None:
    print(json.dumps(run(args)))
