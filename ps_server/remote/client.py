"""``RemoteServer``: tables spread over ``wuliang ps`` processes, as one
``ParameterServer``.

Key ``k`` lives on server ``server_of(k, N)`` of the N addresses, in its shard
``shard_of(k, S)``; every server must run the same number of shard threads
S (``wuliang ps --threads``: checked at connection). ``num_shards`` is S and
``num_servers`` N, so the key preparer groups a batch's unique keys by
(server, shard) cell, server-major (``KeyPreparer(num_servers=N)``): each
server's keys are one contiguous run of them, sent without sorting again.
Keys not grouped so are routed by ``server_of``.

Per server:

* **data calls** (pulls and pushes) go through one bidirectional stream
  (``_DataStream``), one request after another: the server runs them in that
  order and answers in that order, and each answer is written into the
  caller's arrays by the thread that reads that server's answers, in order.
  So a pull of step i and the push of step i - 1 that writes the rows step i
  shares into step i's pulled rows land in the order the server ran them,
  as staleness 0 needs. The requests of one call to several servers go out
  at once and are answered concurrently; ``*_async`` calls return a
  ``Handle`` without a thread of their own. Batches larger than
  ``max_message_mb`` are split into several requests.
* **admin calls** (tables, stats, export, load, logs, versions) are unary or
  streamed calls, fanned out to the servers at once where they concern all.

Every call has a deadline (``timeout``). A server that is unavailable (not
started yet, restarting) is retried with exponential backoff for up to
``retry_seconds``; a data stream reconnects and sends its unanswered
requests again, in order (pushes carry the client's id and a sequence
number, so the server applies each once). An error names the server, the
call and the table.

Merged answers: ``stats`` sums the servers' counters and takes the maxima of
their floors; ``removed_log`` merges the servers' logs by version;
``advance_version`` advances every server (their versions stay equal);
``export`` yields every server's chunks, server by server; ``set_clock``
sets every server's clock (a server that restarts is back on the wall clock
until it is set again), ``clock`` reads them (an error when they differ).

Checkpoints and exports do not stream rows through the client:
``write_rows`` has each server write its part files into the version's
folder (which the servers see at the same path, or reach at the same URI
of an object store) and returns their checksums; ``load_rows`` has each
server load the rows it owns from a version's part files, whatever the
number of servers that wrote them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from wuliang.ps_server.checks import (
    as_column,
    as_float32,
    check_clock,
    check_float32,
    check_restored_version,
    check_step,
    check_version,
    load_columns,
)
from wuliang.ps_server.chunk import concat_rows, stats_decay
from wuliang.ps_server.interface import (
    MISSING,
    ONLY,
    Exchanged,
    ExchangePart,
    Handle,
    KeyArray,
    LookupResult,
    ParameterServer,
    PullPart,
    PushPart,
    PushResult,
    RowChunk,
    TableUpdate,
    UnknownTableError,
    as_keys,
    check_top,
    merge_rows,
    top_of,
)
from wuliang.ps_server.job import JobState
from wuliang.ps_server.remote import proto
from wuliang.ps_server.remote.wire import (
    FLOAT,
    KEY,
    MASK,
    U32,
    Encoded,
    array,
    chunk_of,
    chunk_to_message,
    to_bytes,
)
from wuliang.ps_server.routing import server_of
from wuliang.ps_server.rpc.auth import bearer
from wuliang.ps_server.spec import TableSpec
from wuliang.ps_server.storage.location import Location, RemotePath
from wuliang.ps_server.storage.manifest import FileEntry

__all__ = ["RemoteError", "RemoteServer"]

log = logging.getLogger("wuliang.ps")
M = proto.M
FLOORS = ("removed_floor", "change_floor")  # stats: the maxima over servers, not sums
_BACKOFF = (0.05, 2.0)  # first and longest pause between attempts, seconds


class RemoteError(RuntimeError):
    """A call to a parameter server failed; the message names the server,
    the call and the table. ``code`` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _error(code: str, message: str, server: str, call: str, table: str = "") -> Exception:
    """The exception a server's status becomes: the interface's own kinds
    for bad arguments and unknown tables, RemoteError otherwise."""
    where = f"parameter server {server}, {call}" + (f" of table {table!r}" if table else "")
    if code == "NOT_FOUND":
        return UnknownTableError(f"{where}: {message}")
    if code in ("INVALID_ARGUMENT", "ALREADY_EXISTS"):
        return ValueError(f"{where}: {message}")
    return RemoteError(code, f"{where}: {code}: {message}")


@dataclass
class _Call:
    """A data request waiting for its answer."""

    request: bytes
    future: Future
    call: str
    table: str


class _DataStream:
    """One server's pulls and pushes, in order, on one bidirectional stream
    (see the module docstring). ``submit`` queues a request; its future
    completes with the answer (a ``DataResponse``) on this stream's thread,
    which reads the answers in order. A stream that breaks is opened again
    and its unanswered requests are sent again, in order."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.lock = threading.Lock()
        self.unanswered: deque[_Call] = deque()  # submitted, not answered, in order
        self.outbox: queue.Queue = queue.Queue()  # the current stream's
        self.closed = False
        self.sent_bytes = 0  # requests queued (resent ones once), under lock
        self.received_bytes = 0  # answers read
        self.thread = threading.Thread(
            target=self._run, name=f"wuliang-ps-stream-{server.index}", daemon=True
        )
        self.thread.start()

    def submit(self, request: bytes, call: str, table: str) -> Future:
        future: Future = Future()
        item = _Call(request, future, call, table)
        with self.lock:
            if self.closed:
                raise RemoteError(
                    "CANCELLED", f"parameter server {self.server.address}: the client is closed"
                )
            self.unanswered.append(item)
            self.sent_bytes += len(request)
            self.outbox.put(item)
        return future

    def close(self) -> None:
        """Ends the stream once the requests sent are answered."""
        with self.lock:
            self.closed = True
            self.outbox.put(None)
        self.thread.join(timeout=self.server.timeout)

    @staticmethod
    def _requests(resend: list[_Call], box: queue.Queue) -> Iterator[bytes]:
        for item in resend:
            yield item.request
        while True:
            item = box.get()
            if item is None or item is _END_STREAM:
                return
            yield item.request

    def _run(self) -> None:
        server = self.server
        pause, down_since = _BACKOFF[0], None
        broken = False
        while True:
            with self.lock:
                if self.closed and not self.unanswered:
                    return
                resend = list(self.unanswered)
                box = self.outbox = queue.Queue()
                if self.closed:
                    box.put(None)
            try:
                call = server.stream_call("Data")(
                    self._requests(resend, box), metadata=server.metadata
                )
                for raw in call:
                    pause, down_since = _BACKOFF[0], None
                    if broken:  # the first answer after a break: the same server process?
                        broken = False
                        server.check_restart()
                    self._answer(raw)
                if self.closed:
                    self._fail_all("CANCELLED", "the client closed the stream")
                    return
                continue  # the server ended the stream: open it again
            except grpc.RpcError as error:
                box.put(_END_STREAM)  # the old stream's request generator ends
                broken = True
                code, details = error.code(), error.details() or str(error.code())
            except ValueError as error:  # the channel is closed
                box.put(_END_STREAM)
                code, details = grpc.StatusCode.CANCELLED, str(error)
            if self.closed:
                self._fail_all("CANCELLED", "the client closed the stream")
                return
            if code != grpc.StatusCode.UNAVAILABLE:
                self._fail_all(code.name, details)  # those calls fail; later ones try again
            elif self.unanswered:
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since > server.retry_seconds:
                    self._fail_all(
                        "UNAVAILABLE", f"unavailable for {server.retry_seconds:g} s: {details}"
                    )
                    down_since = None
                else:
                    log.warning(
                        "parameter server %s: %s; retrying in %.2f s",
                        server.address,
                        details,
                        pause,
                    )
            time.sleep(pause)
            pause = min(pause * 2, _BACKOFF[1])

    def _answer(self, raw: bytes) -> None:
        with self.lock:
            item = self.unanswered.popleft()
            self.received_bytes += len(raw)
        try:
            response = M["DataResponse"].FromString(raw)
        except Exception as error:  # not a DataResponse: the server is not ours
            item.future.set_exception(
                RemoteError("INTERNAL", f"parameter server {self.server.address}: {error}")
            )
            return
        if response.error_code:
            item.future.set_exception(
                _error(
                    response.error_code,
                    response.error_message,
                    self.server.address,
                    item.call,
                    item.table,
                )
            )
            return
        item.future.set_result(response)

    def _fail_all(self, code: str, message: str) -> None:
        with self.lock:
            failed, self.unanswered = list(self.unanswered), deque()
        for item in failed:
            if not item.future.done():
                item.future.set_exception(
                    _error(code, message, self.server.address, item.call, item.table)
                )


_END_STREAM = object()  # ends a broken stream's request generator


class _Server:
    """One ``wuliang ps`` process: its channel, calls and data stream."""

    def __init__(
        self,
        index: int,
        address: str,
        *,
        token: str | None,
        tls_root: bytes | None,
        timeout: float,
        retry_seconds: float,
        max_message_bytes: int,
    ) -> None:
        self.index = index
        self.address = address
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.metadata = bearer(token) if token else ()
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls_root is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_root)
            self.channel = grpc.secure_channel(address, credentials, options=options)
        self.instance = ""  # the server process's id (InfoResponse.instance)
        self.restarts = 0  # times it was found to be a new process
        # called (address, checkpoint step or None: empty) when it came back
        self.on_restart: list[Callable[[str, int | None], None]] = []
        self.seq = 0  # pushes sent, under push_lock (the order they are queued in)
        self.push_lock = threading.Lock()
        self.data = _DataStream(self)  # one, for the order of this client's calls

    def check_restart(self) -> None:
        """After a broken stream: logs when the server is a new process (it
        came back from a checkpoint, or empty), whose rows went back."""
        try:
            info = self.call("Info", M["Empty"](), "InfoResponse")
        except Exception as error:  # the next data call reports it
            log.warning(
                "parameter server %s: Info failed after reconnecting: %s", self.address, error
            )
            return
        if info.instance == self.instance:
            return
        self.instance = info.instance
        self.restarts += 1
        for listener in list(self.on_restart):
            try:
                listener(self.address, info.restored_step if info.restored else None)
            except Exception:  # a listener's failure is not the data stream's
                log.exception("a restart listener failed")
        if info.restored:
            log.warning(
                "parameter server %s restarted from its checkpoint of step %d: the updates its "
                "rows received after that step are lost",
                self.address,
                info.restored_step,
            )
        else:
            log.warning(
                "parameter server %s restarted empty (no --restore): the rows it held are lost",
                self.address,
            )

    def stream_call(self, method: str) -> Any:
        return self.channel.stream_stream(proto.method_path(method))

    def call(self, method: str, request: Any, response: str, table: str = "") -> Any:
        """A unary call with its deadline, retried while the server is unavailable."""
        stub = self.channel.unary_unary(
            proto.method_path(method),
            request_serializer=type(request).SerializeToString,
            response_deserializer=M[response].FromString,
        )
        return self._retrying(
            method, table, lambda: stub(request, timeout=self.timeout, metadata=self.metadata)
        )

    def call_future(self, method: str, request: Any, response: str, table: str = "") -> Future:
        """``call`` started now (for fan-outs)."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self.call(method, request, response, table))
            except BaseException as error:
                future.set_exception(error)

        threading.Thread(target=run, name=f"wuliang-ps-call-{self.index}", daemon=True).start()
        return future

    def stream_in(self, method: str, requests: Iterable[Any], table: str = "") -> Any:
        """A client-streamed call (no retry: its messages are gone once sent)."""
        stub = self.channel.stream_unary(
            proto.method_path(method),
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=M["Empty"].FromString,
        )
        try:
            return stub(iter(requests), timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as error:
            raise _error(
                error.code().name, error.details() or "", self.address, method, table
            ) from None

    def stream_out(self, method: str, request: Any, table: str = "") -> Iterator[Any]:
        """A server-streamed call's messages."""
        stub = self.channel.unary_stream(
            proto.method_path(method),
            request_serializer=type(request).SerializeToString,
            response_deserializer=M["Rows"].FromString,
        )
        try:
            yield from stub(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as error:
            raise _error(
                error.code().name, error.details() or "", self.address, method, table
            ) from None

    def stream_all(self, method: str, request: Any, response: str, table: str = "") -> list[Any]:
        """A server-streamed call's messages, all of them, with its deadline;
        retried (from the start) while the server is unavailable: for calls
        that change nothing."""
        stub = self.channel.unary_stream(
            proto.method_path(method),
            request_serializer=type(request).SerializeToString,
            response_deserializer=M[response].FromString,
        )
        return self._retrying(
            method,
            table,
            lambda: list(stub(request, timeout=self.timeout, metadata=self.metadata)),
        )

    def _retrying(self, method: str, table: str, attempt: Callable[[], Any]) -> Any:
        pause, start = _BACKOFF[0], time.monotonic()
        while True:
            try:
                return attempt()
            except grpc.RpcError as error:
                code = error.code()
                late = time.monotonic() - start > self.retry_seconds
                if code != grpc.StatusCode.UNAVAILABLE or late:
                    raise _error(
                        code.name, error.details() or "", self.address, method, table
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, _BACKOFF[1])

    def close(self) -> None:
        self.data.close()
        self.channel.close()


def _in_thread(call: Callable[[], Any], name: str) -> Future:
    """``call()`` run on a thread of its own; its result or error in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, name=f"wuliang-ps-{name}", daemon=True).start()
    return future


def _wait_all(futures: Sequence[Future], timeout: float | None) -> list[Any]:
    """Every call's answer, in order. Waits for all of them before raising
    the first error, so that no call is still on its way to a server when
    this returns (a later call could overtake it: a failed DropTable on one
    server arriving after the next CreateTable of that name)."""
    wait(futures, timeout)
    return [f.result(0) for f in futures]


def _combined(futures: Sequence[Future], result: Callable[[list[Any]], Any]) -> Future:
    """A future done when all are: ``result(their results)``, or the first error."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()
    if not futures:
        out.set_result(result([]))
        return out

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if not last or out.done():
            return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(result([f.result() for f in futures]))

    for future in futures:
        future.add_done_callback(done)
    return out


@dataclass
class _Route:
    """Where one part's keys go: per server, the keys sent and where their
    rows come from or go to (a slice of the caller's arrays, or positions)."""

    keys: list[np.ndarray]  # per server
    where: list[slice | np.ndarray]  # per server: the positions of its keys
    offsets: list[np.ndarray | None]  # per server: its shards' offsets (grouped keys)


class RemoteServer(ParameterServer):
    """Tables on remote parameter servers (see the module docstring).

    Args:
        addresses: ``host:port`` of every server, in the same order in every
            client (a key's server is its index in this list).
        token: sent as ``authorization: Bearer <token>``.
        tls_root: PEM of the CA to trust (TLS); None: plain TCP.
        timeout: seconds a call may take (its deadline).
        retry_seconds: how long an unavailable server is retried before the
            call fails naming it.
        max_message_mb: the largest message sent or received (the servers'
            ``--max-message-mb``); larger batches are split.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str | None = None,
        tls_root: bytes | None = None,
        timeout: float = 60.0,
        retry_seconds: float = 60.0,
        max_message_mb: int = 64,
    ) -> None:
        super().__init__()
        addresses = list(addresses)
        if not addresses:
            raise ValueError("a RemoteServer needs at least one address")
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"an address is given twice: {addresses}")
        self.addresses = addresses
        self.timeout = timeout
        self.max_message_bytes = max_message_mb << 20
        self.client_id = uuid.uuid4().hex
        self._servers = [
            _Server(
                i,
                address,
                token=token,
                tls_root=tls_root,
                timeout=timeout,
                retry_seconds=retry_seconds,
                max_message_bytes=self.max_message_bytes,
            )
            for i, address in enumerate(addresses)
        ]
        self._specs: dict[str, TableSpec] = {}
        try:
            infos = self._all("Info", lambda s: M["Empty"](), "InfoResponse")
        except BaseException:
            self.close()
            raise
        shards = {info.shards for info in infos}
        if len(shards) != 1:
            threads = ", ".join(
                f"{s.address}: {i.shards}" for s, i in zip(self._servers, infos, strict=True)
            )
            self.close()
            raise ValueError(
                f"the parameter servers run different numbers of shard threads ({threads}); "
                "start every server with the same --threads"
            )
        self._shards = shards.pop()
        self._prefetches = any(info.prefetches for info in infos)
        for server, info in zip(self._servers, infos, strict=True):
            server.instance = info.instance

    def __repr__(self) -> str:
        return f"RemoteServer({self.addresses!r})"

    def add_restart_listener(self, listener: Callable[[str, int | None], None]) -> None:
        """Calls ``listener(address, step)`` when a server is found to be a
        new process: ``step`` is the checkpoint's it restored, None when it
        came back empty (called on the thread that reads its answers)."""
        for server in self._servers:
            server.on_restart.append(listener)

    @property
    def instances(self) -> list[str]:
        """Each server process's id; a server that restarted has a new one."""
        return [server.instance for server in self._servers]

    # -- lifecycle -----------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return self._shards

    @property
    def num_servers(self) -> int:
        return len(self._servers)

    def close(self) -> None:
        super().close()
        for server in getattr(self, "_servers", []):
            server.close()

    def data_bytes(self) -> dict[str, int]:
        """Bytes of pull and push messages this client has sent and received
        (serialized protobuf, without gRPC's framing), over all servers."""
        return {
            "sent": sum(s.data.sent_bytes for s in self._servers),
            "received": sum(s.data.received_bytes for s in self._servers),
        }

    def _all(
        self, method: str, request: Callable[[_Server], Any], response: str, table: str = ""
    ) -> list[Any]:
        """The same call on every server at once; their answers in order
        (an error names the server, the call and ``table``)."""
        futures = [s.call_future(method, request(s), response, table) for s in self._servers]
        return _wait_all(futures, None)  # each call has its own deadline

    # -- routing -------------------------------------------------------------

    def _route(self, keys: np.ndarray, offsets: np.ndarray | None) -> _Route:
        n, s = self.num_servers, self._shards
        if offsets is not None:
            offsets = np.ascontiguousarray(offsets, np.int64)
            if offsets.shape != (n * s + 1,):
                raise ValueError(
                    f"shard_offsets must have num_servers * num_shards + 1 = {n * s + 1} "
                    f"entries, got shape {offsets.shape}"
                )
            if offsets[0] != 0 or offsets[-1] != len(keys) or (np.diff(offsets) < 0).any():
                raise ValueError("shard_offsets must rise from 0 to the number of keys")
            starts = offsets[::s]
            return _Route(
                [keys[starts[j] : starts[j + 1]] for j in range(n)],
                [slice(int(starts[j]), int(starts[j + 1])) for j in range(n)],
                [offsets[j * s : (j + 1) * s + 1] - starts[j] for j in range(n)],
            )
        if n == 1:
            return _Route([keys], [slice(0, len(keys))], [None])
        owner = server_of(keys, n)
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(n + 1))
        where = [order[bounds[j] : bounds[j + 1]] for j in range(n)]
        return _Route([keys[w] for w in where], where, [None] * n)

    def _dim(self, table: str) -> int:
        return self.spec(table).dim

    def _batches(self, sizes: Sequence[int], widths: Sequence[int]) -> list[list[tuple]]:
        """Splits parts (their key counts and bytes per key) into requests
        under the message limit: per request, (part index, start, stop);
        every part appears, an empty one as (i, 0, 0)."""
        budget = max(1, self.max_message_bytes - (1 << 16))
        requests: list[list[tuple]] = [[]]
        used = 0
        for i, (n, width) in enumerate(zip(sizes, widths, strict=True)):
            start = 0
            while True:
                room = (budget - used) // width
                if room < 1 and requests[-1]:
                    requests.append([])
                    used, room = 0, budget // width
                stop = min(n, start + max(room, 1))
                requests[-1].append((i, start, stop))
                used += (stop - start) * width
                start = stop
                if start >= n:
                    break
        return requests

    # -- data half -----------------------------------------------------------

    def pull_many(
        self, parts: Sequence[PullPart], *, train: bool = True, step: int | None = None
    ) -> None:
        self.pull_many_async(parts, train=train, step=step).wait(self.timeout)

    def pull_many_async(
        self, parts: Sequence[PullPart], *, train: bool = True, step: int | None = None
    ) -> Handle[None]:
        try:
            return self._pull_many_async(parts, train, check_step(step))
        except Exception as error:  # bad arguments come out of wait(), as the errors of the call
            return _failed(error)

    def _pull_many_async(
        self, parts: Sequence[PullPart], train: bool, step: int | None
    ) -> Handle[None]:
        plans = []
        for part in parts:
            if part.out is None:
                raise ValueError(f"pull_many: the part for table {part.table!r} has no out")
            keys = as_keys(part.keys).view(np.uint64)
            dim = self._dim(part.table)
            check_float32(part.out, (len(keys), dim), "out")
            if not part.out.flags.c_contiguous or not part.out.flags.writeable:
                raise ValueError("out must be a writeable C-contiguous array")
            plans.append((part, dim, self._route(keys, part.shard_offsets)))
        futures = []
        for j, server in enumerate(self._servers):
            sizes = [len(route.keys[j]) for _, _, route in plans]
            if not sum(sizes):
                continue
            for pieces in self._batches(sizes, [8 + 4 * dim for _, dim, _ in plans]):
                futures.append(self._pull_request(server, j, plans, pieces, train, step))
        return Handle(_combined(futures, lambda _: None))

    def _pull_request(
        self,
        server: _Server,
        j: int,
        plans: list[tuple[PullPart, int, _Route]],
        pieces: list[tuple],
        train: bool,
        step: int | None,
    ) -> Future:
        request = Encoded(
            M["PullRequest"],
            train=train,
            has_step=step is not None,
            step=step or 0,
            sparse_rows=True,
        )
        whole = len(pieces) == len(plans) and all(
            start == 0 and stop == len(plans[i][2].keys[j]) for i, start, stop in pieces
        )
        for i, start, stop in pieces:
            part, _, route = plans[i]
            message = Encoded(M["PullPart"], table=part.table)
            message.add_array("keys", route.keys[j][start:stop])
            offsets = route.offsets[j]
            if offsets is not None and whole:
                message.add_array("shard_offsets", offsets)
            request.add_message("parts", message)
        data = Encoded(M["DataRequest"]).add_message("pull", request).join()
        tables = ",".join(dict.fromkeys(plans[i][0].table for i, _, _ in pieces))
        answer = server.data.submit(data, "pull", tables)

        def write(done: Future) -> None:
            if done.exception() is not None:
                return
            answer = done.result().pull
            for p, ((i, start, stop), data) in enumerate(zip(pieces, answer.rows, strict=True)):
                part, dim, route = plans[i]
                what = f"rows of table {part.table!r}"
                present = answer.present[p] if p < len(answer.present) else b""
                if present:  # the nonzero rows only
                    flags = array(present, np.dtype(np.uint8), f"{what}: present", stop - start)
                    mask = flags.view(bool)
                    values = np.zeros((stop - start, dim), np.float32)
                    values[mask] = array(data, FLOAT, what, int(mask.sum()), dim)
                else:
                    values = array(data, FLOAT, what, stop - start, dim)
                where = route.where[j]
                if isinstance(where, slice):
                    part.out[where.start + start : where.start + stop] = values
                else:
                    part.out[where[start:stop]] = values

        return _then(answer, write)

    def exchange_many(
        self, parts: Sequence[ExchangePart], *, step: int | None = None
    ) -> list[Exchanged]:
        """One ``exchange`` request per server on its data stream (ordered
        with the pulls and pushes), the servers at once: each loads, pulls
        and reads its keys of every part in one round of its shards. Each
        server's request and answer is one message (a step's misses): over
        ``max_message_mb`` is a ValueError naming the sizes."""
        step = check_step(step)
        plans = []
        for part in parts:
            spec = self.spec(part.table)
            keys = as_keys(part.keys).view(np.uint64)
            check_float32(part.out, (len(keys), spec.dim), "out")
            if not part.out.flags.c_contiguous or not part.out.flags.writeable:
                raise ValueError("out must be a writeable C-contiguous array")
            back = None
            if part.back is not None and len(part.back):
                b = part.back
                back = _load_chunk(
                    spec, b.keys, b.weights, b.state, b.counts, b.steps, b.times, b.versions,
                    b.shows, b.clicks,
                )  # fmt: skip
            incoming = as_keys(part.incoming).view(np.uint64)
            plans.append((part, spec, keys, self._route(keys, part.shard_offsets), back,
                          self._route(incoming, None)))  # fmt: skip
        futures: dict[int, Future] = {}
        for j, server in enumerate(self._servers):
            request = M["ExchangeRequest"](has_step=step is not None, step=step or 0)
            size = 0
            for part, spec, _, route, back, incoming in plans:
                message = request.parts.add(
                    table=part.table, keys=route.keys[j].tobytes(), merge=part.merge
                )
                if route.offsets[j] is not None:
                    message.shard_offsets = route.offsets[j].tobytes()
                if back is not None:
                    mine = server_of(back.keys, self.num_servers) == j
                    if mine.any():
                        chunk_to_message(_rows_at(back, mine), message.back)
                message.incoming = incoming.keys[j].tobytes()
                row = 4 * (spec.dim + spec.state_dim) + 40
                size += len(route.keys[j]) * 4 * spec.dim + len(incoming.keys[j]) * row
            data = M["DataRequest"](exchange=request).SerializeToString()
            if not any(len(m.keys) or len(m.incoming) or len(m.back.keys) for m in request.parts):
                continue
            if max(len(data), size) > self.max_message_bytes:
                raise ValueError(
                    f"exchange_many: {max(len(data), size):,} bytes for server "
                    f"{server.address}, over its message limit of {self.max_message_bytes:,} "
                    "(max_message_mb): exchange fewer keys at a time"
                )
            tables = ",".join(dict.fromkeys(part.table for part, *_ in plans))
            futures[j] = server.data.submit(data, "exchange", tables)
        answers = dict(zip(futures, _wait_all(list(futures.values()), None), strict=True))
        read: list[list[tuple[np.ndarray, RowChunk, np.ndarray]]] = [[] for _ in plans]
        created = [np.zeros(sum(map(len, plan[5].keys)), bool) for plan in plans]
        for j, answer in answers.items():
            exchange = answer.exchange
            if (
                not len(exchange.rows)
                == len(exchange.incoming)
                == len(exchange.created)
                == len(plans)
            ):
                raise RemoteError(
                    "INTERNAL", f"parameter server {self._servers[j].address}: an exchange "
                    f"answered {len(exchange.rows)} parts of {len(plans)}",
                )  # fmt: skip
            for i, (part, spec, _, route, _, incoming) in enumerate(plans):
                what = f"exchange with table {part.table!r}"
                values = array(exchange.rows[i], FLOAT, f"{what}: rows",
                               len(route.keys[j]), spec.dim)  # fmt: skip
                part.out[route.where[j]] = values
                answer_i = exchange.incoming[i]
                found = array(answer_i.found, MASK, f"{what}: found", len(incoming.keys[j])) != 0
                rows = chunk_of(answer_i.rows, f"{what}: incoming rows", spec.dim)
                if not np.array_equal(rows.keys, incoming.keys[j][found]):
                    raise RemoteError(
                        "INTERNAL", f"parameter server {self._servers[j].address}, {what}: "
                        "the rows answered are not those of the keys asked",
                    )  # fmt: skip
                where = incoming.where[j]
                if isinstance(where, slice):
                    where = np.arange(where.start, where.stop)
                read[i].append((where, rows, found))
                mask = array(exchange.created[i], MASK, f"{what}: created", len(found)) != 0
                created[i][where] = mask
        answers_by_part = []
        for i, (_, spec, *_) in enumerate(plans):
            rows, found = merge_rows(read[i], len(created[i]), spec.dim, spec.state_dim)
            answers_by_part.append(Exchanged(rows, found, created[i]))
        return answers_by_part

    @property
    def prefetches(self) -> bool:
        """Whether any server has a disk tier (``wuliang ps --disk-dir``)."""
        return self._prefetches

    def prefetch_many(self, parts: Sequence[PullPart]) -> int:
        """Each server with keys reads their cold rows into memory
        (``Prefetch``, the servers at once, in requests under the message
        limit). Outside the order of pulls and pushes: it changes no row."""
        if not self._prefetches:
            return 0
        plans = []
        for part in parts:
            keys = as_keys(part.keys).view(np.uint64)
            plans.append((part, self._route(keys, part.shard_offsets)))
        futures = []
        for j, server in enumerate(self._servers):
            sizes = [len(route.keys[j]) for _, route in plans]
            if not sum(sizes):
                continue
            for pieces in self._batches(sizes, [8] * len(plans)):
                whole = len(pieces) == len(plans) and all(
                    start == 0 and stop == sizes[i] for i, start, stop in pieces
                )
                request = M["PullRequest"]()
                for i, start, stop in pieces:
                    part, route = plans[i]
                    message = request.parts.add(
                        table=part.table, keys=route.keys[j][start:stop].tobytes()
                    )
                    if route.offsets[j] is not None and whole:
                        message.shard_offsets = route.offsets[j].tobytes()
                tables = ",".join(dict.fromkeys(plans[i][0].table for i, _, _ in pieces))
                futures.append(server.call_future("Prefetch", request, "Count", tables))
        return sum(answer.count for answer in _wait_all(futures, None))

    def push_many(
        self,
        parts: Sequence[PushPart],
        *,
        unique: bool = False,
        only: str = "all",
        step: int | None = None,
    ) -> PushResult:
        return self.push_many_async(parts, unique=unique, only=only, step=step).wait(self.timeout)

    def push_many_async(
        self,
        parts: Sequence[PushPart],
        *,
        unique: bool = False,
        only: str = "all",
        step: int | None = None,
    ) -> Handle[PushResult]:
        try:
            return self._push_many_async(parts, unique, only, check_step(step))
        except Exception as error:  # bad arguments come out of wait(), as the errors of the call
            return _failed(error)

    def _push_many_async(
        self, parts: Sequence[PushPart], unique: bool, only: str, step: int | None
    ) -> Handle[PushResult]:
        if only not in ONLY:
            raise ValueError(f"only must be one of {', '.join(ONLY)}, got {only!r}")
        if only != "all" and not unique:
            raise ValueError(f"push_many(only={only!r}) needs unique=True")
        plans = []
        for part in parts:
            keys = as_keys(part.keys).view(np.uint64)
            dim = self._dim(part.table)
            grads = as_float32(part.grads, (len(keys), dim), f"grads for table {part.table!r}")
            if part.updated is not None:
                rows_n = len(keys) if part.updated_rows is None else part.updated.shape[0]
                check_float32(part.updated, (rows_n, dim), "updated")
            if part.updated_rows is not None:
                check_rows = np.asarray(part.updated_rows)
                if check_rows.dtype != np.int32 or check_rows.shape != (len(keys),):
                    raise ValueError(
                        f"updated_rows must be int32 [{len(keys)}], got "
                        f"{check_rows.dtype} {list(check_rows.shape)}"
                    )
                if part.updated is None:
                    raise ValueError("updated_rows needs updated")
            rows = part.updated_rows
            if part.updated is not None and rows is None:
                rows = np.arange(len(keys), dtype=np.int32)
            if part.shows is not None or part.clicks is not None:
                part = dataclasses.replace(
                    part,
                    shows=as_column(part.shows, np.float32, (len(keys),), "shows"),
                    clicks=as_column(part.clicks, np.float32, (len(keys),), "clicks"),
                )
            plans.append((part, dim, grads, rows, self._route(keys, part.shard_offsets)))
        futures = []
        for j, server in enumerate(self._servers):
            sizes = [len(route.keys[j]) for *_, route in plans]
            if not sum(sizes):
                continue
            # key, mask, show, click, gradient, updated row
            widths = [17 + 8 * dim for _, dim, *_ in plans]
            for pieces in self._batches(sizes, widths):
                futures.append(self._push_request(server, j, plans, pieces, unique, only, step))
        return Handle(_combined(futures, lambda results: sum(results, PushResult(0, 0, 0, 0))))

    def _push_request(
        self,
        server: _Server,
        j: int,
        plans: list[tuple],
        pieces: list[tuple],
        unique: bool,
        only: str,
        step: int | None,
    ) -> Future:
        request = Encoded(
            M["PushRequest"],
            unique=unique,
            only=only,
            has_step=step is not None,
            step=step or 0,
            client=self.client_id,
        )
        masks = []
        for i, start, stop in pieces:
            part, _, grads, rows, route = plans[i]
            where = route.where[j]
            pick = (
                slice(where.start + start, where.start + stop)
                if isinstance(where, slice)
                else where[start:stop]
            )
            message = Encoded(M["PushPart"], table=part.table)
            message.add_array("keys", route.keys[j][start:stop])
            message.add_array("grads", np.ascontiguousarray(grads[pick]))
            offsets = route.offsets[j]
            if offsets is not None and start == 0 and stop == len(route.keys[j]):
                message.add_array("shard_offsets", offsets)
            for name in ("shows", "clicks"):
                if getattr(part, name) is not None:
                    message.add_array(name, np.ascontiguousarray(getattr(part, name)[pick]))
            mask = None
            if rows is not None:
                mask = np.asarray(rows)[pick] >= 0
                message.add_array("updated_mask", mask.view(np.uint8))
            request.add_message("parts", message)
            masks.append((part, pick, mask, rows))
        tables = ",".join(dict.fromkeys(plans[i][0].table for i, _, _ in pieces))
        with server.push_lock:  # sequence numbers in queue order
            server.seq += 1
            request.add_fields(seq=server.seq)
            data = Encoded(M["DataRequest"]).add_message("push", request).join()
            answer = server.data.submit(data, "push", tables)

        def result(done: Future) -> PushResult:
            response = done.result().push
            if only != "rest":
                for (part, pick, mask, rows), data in zip(masks, response.updated, strict=True):
                    if mask is None or not data:
                        continue
                    dim = part.updated.shape[1]
                    values = array(data, FLOAT, f"updated rows of {part.table!r}", None, dim)
                    targets = np.asarray(rows)[pick][mask]
                    part.updated[targets] = values
            return PushResult(
                response.applied,
                response.dropped_nan,
                response.dropped_pending,
                response.duplicates,
            )

        return _then(answer, result)

    def lookup(self, table: str, keys: KeyArray, *, missing: str = "zeros") -> LookupResult:
        if missing not in MISSING:
            raise ValueError(f"missing must be 'zeros' or 'initial', got {missing!r}")
        keys = as_keys(keys).view(np.uint64)
        dim = self._dim(table)
        route = self._route(keys, None)
        rows = np.empty((len(keys), dim), np.float32)
        found = np.zeros(len(keys), bool)
        futures = [
            s.call_future(
                "Lookup",
                M["LookupRequest"](table=table, keys=route.keys[j].tobytes(), missing=missing),
                "LookupResponse",
                table,
            )
            for j, s in enumerate(self._servers)
        ]
        versions = []
        for j, answer in enumerate(_wait_all(futures, None)):
            n = len(route.keys[j])
            rows[route.where[j]] = array(answer.rows, FLOAT, "rows", n, dim)
            found[route.where[j]] = array(answer.found, MASK, "found", n) != 0
            versions.append(answer.version)
        return LookupResult(rows, found, min(versions) if versions else 0)

    # -- admin half: tables --------------------------------------------------

    def create_table(self, spec: TableSpec) -> None:
        if not isinstance(spec, TableSpec):
            raise TypeError(f"spec must be a TableSpec, got {type(spec).__name__}")
        message = M["Spec"](json=json.dumps(spec.to_dict()))
        self._all("CreateTable", lambda s: message, "Empty", spec.name)
        self._specs[spec.name] = spec

    def drop_table(self, name: str) -> None:
        self._all("DropTable", lambda s: M["TableRequest"](table=name), "Empty", name)
        self._specs.pop(name, None)

    def tables(self) -> list[str]:
        return list(self._servers[0].call("Tables", M["Empty"](), "TablesResponse").names)

    def spec(self, name: str) -> TableSpec:
        spec = self._specs.get(name)
        if spec is None:
            answer = self._servers[0].call("GetSpec", M["TableRequest"](table=name), "Spec", name)
            spec = self._specs[name] = TableSpec.from_dict(json.loads(answer.json))
        return spec

    def stats(self, table: str | None = None) -> dict[str, Any]:
        answers = self._all(
            "Stats", lambda s: M["TableRequest"](table=table or ""), "Json", table or ""
        )
        stats = [json.loads(a.json) for a in answers]
        if table is not None:
            return _merge_stats(stats)
        return {name: _merge_stats([s[name] for s in stats]) for name in stats[0]}

    # -- admin half: rows ----------------------------------------------------

    def export(self, table: str, since: int = 0, chunk_rows: int = 65536) -> Iterator[RowChunk]:
        dim = self._dim(table)  # checks the table now
        since = check_version(since, "since")
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
        request = M["ExportRequest"](table=table, since=since, chunk_rows=chunk_rows)

        def chunks() -> Iterator[RowChunk]:
            for server in self._servers:
                for message in server.stream_out("Export", request, table):
                    yield chunk_of(message, f"rows of table {table!r}", dim)

        return chunks()

    def load(
        self,
        table: str,
        keys: KeyArray,
        weights: np.ndarray,
        state: np.ndarray | None = None,
        counts: np.ndarray | None = None,
        steps: np.ndarray | None = None,
        times: np.ndarray | None = None,
        versions: np.ndarray | None = None,
        shows: np.ndarray | None = None,
        clicks: np.ndarray | None = None,
        *,
        step: int | None = None,
    ) -> None:
        spec = self.spec(table)
        step = check_step(step)
        chunk = _load_chunk(
            spec, keys, weights, state, counts, steps, times, versions, shows, clicks
        )
        keys = chunk.keys
        route = self._route(keys, None)
        width = 4 * (spec.dim + chunk.state.shape[1]) + 40
        for j, server in enumerate(self._servers):
            if len(route.keys[j]) == 0:
                continue
            mine = _rows_at(chunk, route.where[j])
            messages = []
            for piece in self._batches([len(mine.keys)], [width]):
                (_, start, stop) = piece[0]
                message = M["LoadRequest"](table=table, has_step=step is not None, step=step or 0)
                chunk_to_message(_rows_at(mine, slice(start, stop)), message.rows)
                messages.append(message)
            server.stream_in("Load", messages, table)

    def erase(self, table: str, keys: KeyArray) -> int:
        route = self._route(as_keys(keys).view(np.uint64), None)
        futures = [
            s.call_future(
                "Erase", M["KeysRequest"](table=table, keys=route.keys[j].tobytes()), "Count", table
            )
            for j, s in enumerate(self._servers)
        ]
        return sum(a.count for a in _wait_all(futures, None))

    def contains(self, table: str, keys: KeyArray) -> np.ndarray:
        keys = as_keys(keys).view(np.uint64)
        route = self._route(keys, None)
        futures = [
            s.call_future(
                "Contains",
                M["KeysRequest"](table=table, keys=route.keys[j].tobytes()),
                "Mask",
                table,
            )
            for j, s in enumerate(self._servers)
        ]
        found = np.zeros(len(keys), bool)
        for j, answer in enumerate(_wait_all(futures, None)):
            found[route.where[j]] = array(answer.mask, MASK, "mask", len(route.keys[j])) != 0
        return found

    def read_rows(self, table: str, keys: KeyArray) -> tuple[RowChunk, np.ndarray]:
        """Each server reads the rows of its keys (``ReadRows``, the servers
        at once, in requests and answers under the message limit; retried
        while a server is unavailable); the rows come back merged in the
        order of ``keys``."""
        keys = as_keys(keys).view(np.uint64)
        spec = self.spec(table)
        route = self._route(keys, None)
        futures = [
            _in_thread(lambda j=j: self._read_rows(j, table, route.keys[j], spec), f"read-{j}")
            for j in range(self.num_servers)
        ]
        parts = []
        for j, (rows, found) in enumerate(_wait_all(futures, None)):
            where = route.where[j]
            positions = np.arange(where.start, where.stop) if isinstance(where, slice) else where
            parts.append((positions, rows, found))
        return merge_rows(parts, len(keys), spec.dim, spec.state_dim)

    def _read_rows(
        self, j: int, table: str, keys: np.ndarray, spec: TableSpec
    ) -> tuple[RowChunk, np.ndarray]:
        """Server j's answer for its keys: (rows, found), checked against them."""
        server = self._servers[j]
        parts: list[RowChunk] = []
        found = np.zeros(len(keys), bool)
        at = 0  # keys answered so far
        for piece in self._batches([len(keys)], [8]):
            (_, start, stop) = piece[0]
            request = M["KeysRequest"](table=table, keys=keys[start:stop].tobytes())
            for answer in server.stream_all("ReadRows", request, "ReadRowsResponse", table):
                mask = array(answer.found, MASK, "found") != 0
                rows = chunk_of(answer.rows, f"rows of table {table!r}", spec.dim)
                run = keys[at : at + len(mask)]
                if at + len(mask) > stop or not np.array_equal(rows.keys, run[mask]):
                    raise RemoteError(
                        "INTERNAL",
                        f"parameter server {server.address}, ReadRows of table {table!r}: "
                        "the rows answered are not those of the keys asked",
                    )
                found[at : at + len(mask)] = mask
                parts.append(rows)
                at += len(mask)
            if at != stop:
                raise RemoteError(
                    "INTERNAL",
                    f"parameter server {server.address}, ReadRows of table {table!r}: "
                    f"{stop - start} keys asked, {at - start} answered",
                )
        return concat_rows(parts, spec.dim, spec.state_dim), found

    def evict(self, table: str | None = None, *, step: int | None = None) -> dict[str, int]:
        """Each table's policy over all its servers: TTL and min-count on
        each, then ``max_rows`` for the table as a whole, cut the way one
        engine cuts over its shards (the least frequently updated rows
        first, the oldest first among equal counts)."""
        step = check_step(step)
        names = [table] if table is not None else self.tables()
        total: dict[str, int] = {}
        for name in names:
            total = _sum_dicts([total, self._evict_table(name, step)])
        return total

    def _evict_table(self, table: str, step: int | None) -> dict[str, int]:
        has, value = step is not None, step or 0
        request = M["EvictRequest"](table=table, has_step=has, step=value)
        counts = _sum_dicts(
            [json.loads(a.json) for a in self._all("EvictByAge", lambda s: request, "Json", table)]
        )
        bound = self.spec(table).eviction.max_rows
        if not bound:
            return counts
        histograms = self._all(
            "CountHistogram", lambda s: M["TableRequest"](table=table), "Records", table
        )
        merged: dict[int, int] = {}
        for answer in histograms:
            buckets = array(answer.keys, KEY, "buckets")
            rows = array(answer.values, KEY, "rows", len(buckets))
            for bucket, n in zip(buckets.tolist(), rows.tolist(), strict=True):
                merged[bucket] = merged.get(bucket, 0) + n
        excess = sum(merged.values()) - bound
        if excess <= 0:
            return counts
        below, threshold = 0, 0
        for threshold in sorted(merged):  # every count below the threshold goes
            if below + merged[threshold] >= excess:
                break
            below += merged[threshold]
        ask = M["CountRequest"](table=table, count=threshold)
        steps = [
            array(a.values, KEY, "steps")
            for a in self._all("StepsAtCount", lambda s: ask, "Records", table)
        ]
        everything = np.concatenate(steps)
        need = min(excess - below, len(everything))
        if need <= 0:
            return counts
        cutoff = int(np.partition(everything, need - 1)[need - 1])
        ties = need - int((everything < cutoff).sum())
        quotas = []
        for server_steps in steps:  # the ties at the cutoff step, server by server
            at = int((server_steps == cutoff).sum())
            quotas.append(min(at, ties))
            ties -= quotas[-1]
        cut = self._all(
            "EvictLeastFrequent",
            lambda s: M["LeastFrequentRequest"](
                table=table, threshold=threshold, cutoff=cutoff, quota=quotas[s.index],
                has_step=has, step=value,
            ),
            "Json",
            table,
        )  # fmt: skip
        return _sum_dicts([counts, *(json.loads(a.json) for a in cut)])

    # -- admin half: logs and admission --------------------------------------

    def removed_log(self, table: str, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        request = M["RemovedLogRequest"](table=table, since=check_version(since, "since"))
        answers = self._all("RemovedLog", lambda s: request, "Records", table)
        keys = np.concatenate([array(a.keys, KEY, "keys") for a in answers])
        versions = np.concatenate(
            [array(a.values, KEY, "versions", len(array(a.keys, KEY, "keys"))) for a in answers]
        )
        order = np.argsort(versions, kind="stable")
        return keys[order], versions[order]

    def load_removed(
        self, table: str, keys: KeyArray, versions: np.ndarray, floor: int = 0
    ) -> None:
        keys = as_keys(keys).view(np.uint64)
        floor = check_version(floor, "floor")
        versions = as_column(versions, np.uint64, keys.shape, "versions")
        route = self._route(keys, None)
        futures = [
            s.call_future(
                "LoadRemoved",
                M["LoadRemovedRequest"](
                    table=table,
                    keys=route.keys[j].tobytes(),
                    versions=to_bytes(versions[route.where[j]], KEY),
                    floor=floor,
                ),
                "Empty",
                table,
            )
            for j, s in enumerate(self._servers)
        ]
        _wait_all(futures, None)

    def trim_removed(self, table: str, upto: int) -> None:
        upto = check_version(upto, "upto")
        self._all("TrimRemoved", lambda s: M["TrimRequest"](table=table, upto=upto), "Empty", table)

    def pending_counts(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        answers = self._all(
            "PendingCounts", lambda s: M["TableRequest"](table=table), "Records", table
        )
        keys = [array(a.keys, KEY, "keys") for a in answers]
        counts = [
            array(a.values, U32, "counts", len(k)) for a, k in zip(answers, keys, strict=True)
        ]
        return np.concatenate(keys), np.concatenate(counts)

    def top_keys(
        self, table: str, n: int, *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each server's top ``n`` (decayed to ``step``, or to its newest
        row's step), brought to one step (the newest of theirs when ``step``
        is None) and merged."""
        n = check_top(n)
        if step is not None and (isinstance(step, bool) or not 0 <= step < 2**63):
            raise ValueError(f"step must be an int in [0, 2**63), got {step!r}")
        half_life = self.spec(table).stats_half_life
        request = M["TopKeysRequest"](
            table=table, n=min(n, 2**32 - 1), has_step=step is not None, step=step or 0
        )
        answers = self._all("TopKeys", lambda s: request, "TopKeysResponse", table)
        at = step if step is not None else max((a.step for a in answers), default=0)
        parts = []
        for a in answers:
            keys = array(a.keys, KEY, "top keys")
            shows = array(a.shows, FLOAT, "top shows", len(keys))
            factor = stats_decay(np.array([a.step], np.uint64), half_life, at)[0]
            parts.append((keys, (shows * factor).astype(np.float32) if factor != 1 else shows))
        return top_of(parts, n)

    def load_pending(self, table: str, keys: KeyArray, counts: np.ndarray) -> None:
        keys = as_keys(keys).view(np.uint64)
        counts = as_column(counts, np.uint32, keys.shape, "counts")
        route = self._route(keys, None)
        futures = [
            s.call_future(
                "LoadPending",
                M["LoadPendingRequest"](
                    table=table,
                    keys=route.keys[j].tobytes(),
                    counts=to_bytes(counts[route.where[j]], U32),
                ),
                "Empty",
                table,
            )
            for j, s in enumerate(self._servers)
        ]
        _wait_all(futures, None)

    def apply_update(self, updates: Mapping[str, TableUpdate], label: int = 0) -> None:
        """Each server stages every table's rows it owns, then switches;
        tables switch atomically per server (a lookup spanning servers may
        see one server switched before another)."""
        chunks: dict[str, list[list[RowChunk]]] = {}
        removed: dict[str, list[np.ndarray | None]] = {}
        for name, update in updates.items():
            per_server: list[list[RowChunk]] = [[] for _ in self._servers]
            for chunk in update.rows:
                route = self._route(as_keys(chunk.keys).view(np.uint64), None)
                for j in range(self.num_servers):
                    if len(route.keys[j]):
                        per_server[j].append(_rows_at(chunk, route.where[j]))
            chunks[name] = per_server
            gone = update.removed
            if gone is not None and len(gone):
                route = self._route(as_keys(gone).view(np.uint64), None)
                removed[name] = list(route.keys)
            else:
                removed[name] = [None] * self.num_servers

        def messages(j: int) -> Iterator[Any]:
            for name, update in updates.items():
                spec = update.spec.with_name(name)
                table = M["UpdateTable"](
                    table=name, spec=M["Spec"](json=json.dumps(spec.to_dict())), full=update.full
                )
                yield M["UpdateRequest"](table=table, label=label)
            for name in updates:
                for chunk in chunks[name][j]:
                    message = M["UpdateRequest"](label=label)
                    message.rows.table = name
                    chunk_to_message(chunk, message.rows.rows)
                    yield message
                keys = removed[name][j]
                if keys is not None and len(keys):
                    yield M["UpdateRequest"](
                        removed=M["KeysRequest"](table=name, keys=keys.tobytes()), label=label
                    )

        futures = []
        for j, server in enumerate(self._servers):
            future: Future = Future()

            def run(j: int = j, server: _Server = server, future: Future = future) -> None:
                try:
                    future.set_result(server.stream_in("ApplyUpdate", messages(j)))
                except BaseException as error:
                    future.set_exception(error)

            threading.Thread(target=run, daemon=True, name=f"wuliang-ps-apply-{j}").start()
            futures.append(future)
        _wait_all(futures, None)
        for name in updates:
            self._specs.pop(name, None)

    # -- admin half: versions ------------------------------------------------

    @property
    def version(self) -> int:
        return max(
            a.version for a in self._all("GetVersion", lambda s: M["Empty"](), "VersionMessage")
        )

    def advance_version(self) -> int:
        """Advances every server; when a restarted server was behind, it is
        raised to the others first, so the versions stay equal."""
        current = self.version
        self.restore_version(current)
        answers = self._all("AdvanceVersion", lambda s: M["Empty"](), "VersionMessage")
        return max(a.version for a in answers)

    def restore_version(self, version: int) -> None:
        version = check_restored_version(version)
        self._all("RestoreVersion", lambda s: M["VersionMessage"](version=version), "Empty")

    # -- admin half: the clock ----------------------------------------------

    def set_clock(self, seconds: int | None) -> None:
        """Sets every server's clock (``ParameterServer.set_clock``). A
        server that restarts comes back on the wall clock until it is set
        again (the trainer sets it at each new partition)."""
        message = M["ClockMessage"](seconds=check_clock(seconds) or 0)
        self._all("SetClock", lambda s: message, "Empty")

    def clock(self) -> int | None:
        """The servers' clock; RuntimeError naming each server's when they
        differ (one restarted since ``set_clock``)."""
        answers = self._all("GetClock", lambda s: M["Empty"](), "ClockMessage")
        clocks = [a.seconds for a in answers]
        if len(set(clocks)) > 1:
            each = ", ".join(
                f"{s.address}: {c or 'wall clock'}"
                for s, c in zip(self._servers, clocks, strict=True)
            )
            raise RuntimeError(f"the parameter servers' clocks differ ({each}): set it again")
        return clocks[0] or None

    # -- the job board: on the first server ---------------------------------

    def job(
        self,
        *,
        add_steps: int = 0,
        floor: int = 0,
        put: Mapping[str, bytes] | None = None,
        get: Sequence[str] = (),
        prefix: str | None = None,
    ) -> JobState:
        request = M["JobRequest"](
            add_steps=check_step(add_steps),
            floor=check_step(floor),
            put=dict(put or {}),
            get=list(get),
            has_prefix=prefix is not None,
            prefix=prefix or "",
        )
        answer = self._servers[0].call("Job", request, "JobResponse")
        return JobState(answer.step, dict(answer.values))

    # -- checkpoints and exports: part files written by the servers ----------

    def write_rows(
        self, folder: Location, spec: TableSpec, *, since: int = 0, state: bool
    ) -> tuple[list[tuple[str, FileEntry]], int]:
        """Each server writes its part files of the table into the folder
        (``tables/<table>/part-s<i>-NNNNN.arrow``), which it must see at
        the same path (or reach at the same URI)."""
        answers = self._all(
            "WriteRows",
            lambda s: M["WriteRowsRequest"](
                folder=_folder_name(folder),
                table=spec.name,
                since=since,
                state=state,
                prefix=f"part-s{s.index}-",
            ),
            "WriteRowsResponse",
            spec.name,
        )
        files = [(f.path, FileEntry(f.sha256, f.bytes, f.rows)) for a in answers for f in a.files]
        return files, sum(a.rows for a in answers)

    def load_rows(
        self,
        folder: Location,
        table: str,
        files: Sequence[str],
        *,
        step: int | None = None,
        since: int = 0,
        owned: tuple[int, int] | None = None,
    ) -> int:
        """Each server loads the rows it owns of the part files (every
        server reads them all: any number of servers may have written them)."""
        if owned is not None:
            raise ValueError("owned is for one server's engine; a RemoteServer routes by itself")
        answers = self._all(
            "LoadRows",
            lambda s: M["LoadRowsRequest"](
                folder=_folder_name(folder),
                table=table,
                files=list(files),
                server=s.index,
                servers=self.num_servers,
                has_step=step is not None,
                step=step or 0,
                since=since,
            ),
            "Count",
            table,
        )
        return sum(a.count for a in answers)


def _folder_name(folder: Location) -> str:
    """A version's folder as the servers are told it: an absolute path, or
    a URI (with its query: the servers open it)."""
    if isinstance(folder, RemotePath):
        return folder.uri
    return str(Path(folder).resolve())


def _failed(error: BaseException) -> Handle[Any]:
    """A handle whose ``wait()`` raises ``error``."""
    future: Future = Future()
    future.set_exception(error)
    return Handle(future)


def _then(answer: Future, handle: Callable[[Future], Any]) -> Future:
    """A future of ``handle(answer)``, run when the answer arrives (on the
    thread that reads it, so answers are applied in the server's order)."""
    out: Future = Future()

    def done(future: Future) -> None:
        if future.exception() is not None:
            out.set_exception(future.exception())
            return
        try:
            out.set_result(handle(future))
        except BaseException as error:
            out.set_exception(error)

    answer.add_done_callback(done)
    return out


def _load_chunk(
    spec: TableSpec,
    keys: KeyArray,
    weights: Any,
    state: Any,
    counts: Any,
    steps: Any,
    times: Any,
    versions: Any,
    shows: Any,
    clicks: Any,
) -> RowChunk:
    """Rows for a load (or given back in an exchange), every column checked;
    a column that is None travels empty: the server's default."""
    keys = as_keys(keys).view(np.uint64)
    columns = load_columns(
        spec, keys, weights, state, counts, steps, times, versions, shows, clicks
    )
    empty = {"state": np.zeros((len(keys), 0), np.float32)}
    for name, dtype in (
        ("counts", np.uint32),
        ("steps", np.uint64),
        ("times", np.uint32),
        ("versions", np.uint64),
        ("shows", np.float32),
        ("clicks", np.float32),
    ):
        empty[name] = np.zeros(0, dtype)  # fmt: skip
    return RowChunk(**{name: empty[name] if v is None else v for name, v in columns.items()})


def _rows_at(chunk: RowChunk, where: slice | np.ndarray) -> RowChunk:
    """The rows of a chunk at ``where``; columns left empty stay empty."""
    n = len(chunk.keys)

    def pick(column: np.ndarray) -> np.ndarray:
        return column[where] if len(column) == n else column

    return RowChunk(
        keys=chunk.keys[where],
        weights=chunk.weights[where],
        state=chunk.state[where] if chunk.state.shape[0] == n else chunk.state,
        counts=pick(chunk.counts),
        steps=pick(chunk.steps),
        times=pick(chunk.times),
        versions=pick(chunk.versions),
        shows=pick(chunk.shows),
        clicks=pick(chunk.clicks),
    )


def _merge_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counters summed, floors as their maxima, texts (a disk's error) the
    first one given, prefixed with its server."""
    out: dict[str, Any] = {}
    for name in stats[0]:
        values = [s[name] for s in stats]
        if isinstance(values[0], str):
            given = [f"server {i}: {v}" for i, v in enumerate(values) if v]
            out[name] = given[0] if given else ""
        else:
            out[name] = max(values) if name in FLOORS else sum(values)
    return out


def _sum_dicts(dicts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
